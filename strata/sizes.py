"""Sizes as people write them, one grammar for every flag that takes one (generate's --arena,
--keep and --ple-reserve, replay's / quality's --caps):

    2GB, 512MB, 1.5GiB, 4096B   bytes: a number with a unit (GB = 10^9, GiB = 2^30)
    300, 300slots               arena slots (one expert record each): a bare number counts slots
    25%                         a share of all the model's experts (L x E slots)

A bare number used to mean bytes in `--arena` and slots in `--caps`; now it means slots in both.
Where slots mean nothing (keep, ple_reserve) a bare number other than 0 is refused: name a unit.
"""

from __future__ import annotations

import math
import re
from dataclasses import dataclass

from strata.errors import ConfigError

__all__ = ["SizeSpec", "parse_size", "fmt_bytes"]

_UNITS = {"b": 1, "k": 1000, "kb": 1000, "m": 1000**2, "mb": 1000**2, "g": 1000**3, "gb": 1000**3,
          "t": 1000**4, "tb": 1000**4, "kib": 1024, "mib": 1024**2, "gib": 1024**3, "tib": 1024**4}
_SIZE = re.compile(r"^\s*([0-9]*\.?[0-9]+)\s*([a-zA-Z%]*)\s*$")


@dataclass(frozen=True)
class SizeSpec:
    """A parsed size: bytes, a slot count (`300`, `300slots`) or a share of all experts (`25%`)."""

    nbytes: int = 0
    slots: int = 0
    percent: float = 0.0

    def to_slots(self, slot_bytes: int, total_experts: int | None = None) -> int:
        if self.slots:
            return self.slots
        if self.percent:
            if total_experts is None:
                raise ConfigError(f"a size of {self.percent:g}% needs the model's expert count")
            return max(1, round(self.percent / 100.0 * total_experts))
        return self.nbytes // slot_bytes


def parse_size(text: str, *, what: str = "size", allow_slots: bool = True) -> SizeSpec:
    """"2GB", "512MB", "1.5GiB", "4096B" -> bytes; "300", "300slots" -> slots; "25%" -> a share
    of all experts (the last two only where `allow_slots`). "0" is zero bytes everywhere."""
    m = _SIZE.match(str(text))
    if m:
        number, unit = m.group(1), m.group(2).lower()
        if unit in ("", "slot", "slots") and allow_slots:
            if "." not in number:
                return SizeSpec(slots=int(number))
        elif unit == "" and float(number) == 0:
            return SizeSpec(nbytes=0)
        elif unit == "%" and allow_slots:
            if 0 < float(number) <= 100 and math.isfinite(float(number)):
                return SizeSpec(percent=float(number))
        elif unit in _UNITS:
            return SizeSpec(nbytes=int(float(number) * _UNITS[unit]))
    forms = "bytes with a unit like 2GB, 512MB, 1.5GiB, 4096B"
    if allow_slots:
        forms += "; slots like 300 or 300slots; or a share of all experts like 25%"
    raise ConfigError(f"{what}: cannot read {text!r} as a size ({forms})")


def fmt_bytes(n: float) -> str:
    for unit, scale in (("GB", 1e9), ("MB", 1e6), ("kB", 1e3)):
        if abs(n) >= scale:
            return f"{n / scale:.2f} {unit}"
    return f"{int(n)} B"
