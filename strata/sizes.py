"""Sizes as people write them: "2GB", "512MB", "1.5GiB", "300slots" (one grammar for every flag)."""

from __future__ import annotations

import re
from dataclasses import dataclass

from strata.errors import ConfigError

__all__ = ["SizeSpec", "parse_size", "fmt_bytes"]

_UNITS = {"": 1, "b": 1, "k": 1000, "kb": 1000, "m": 1000**2, "mb": 1000**2, "g": 1000**3, "gb": 1000**3,
          "t": 1000**4, "tb": 1000**4, "kib": 1024, "mib": 1024**2, "gib": 1024**3, "tib": 1024**4}
_SIZE = re.compile(r"^\s*([0-9]*\.?[0-9]+)\s*([a-zA-Z]*)\s*$")


@dataclass(frozen=True)
class SizeSpec:
    """A parsed size: bytes, or a slot count (`300slots`)."""

    nbytes: int = 0
    slots: int = 0

    def to_slots(self, slot_bytes: int) -> int:
        return self.slots if self.slots else self.nbytes // slot_bytes


def parse_size(text: str, *, what: str = "size", allow_slots: bool = True) -> SizeSpec:
    """"2GB", "512MB", "1.5GiB", "4096", "300slots" -> SizeSpec. Decimal units (GB = 10^9),
    binary with an i (GiB = 2^30); a bare number is bytes."""
    m = _SIZE.match(str(text))
    if m:
        number, unit = m.group(1), m.group(2).lower()
        if unit in ("slot", "slots"):
            if allow_slots and "." not in number:
                return SizeSpec(slots=int(number))
        elif unit in _UNITS:
            return SizeSpec(nbytes=int(float(number) * _UNITS[unit]))
    slots = ", a slot count like 300slots" if allow_slots else ""
    raise ConfigError(f"{what}: cannot read {text!r} as a size (like 2GB, 512MB, 1.5GiB{slots})")


def fmt_bytes(n: float) -> str:
    for unit, scale in (("GB", 1e9), ("MB", 1e6), ("kB", 1e3)):
        if abs(n) >= scale:
            return f"{n / scale:.2f} {unit}"
    return f"{int(n)} B"

