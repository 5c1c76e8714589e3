"""The one runtime configuration (SPEC §6): a frozen dataclass; environment and CLI read here only.

Every switch restores the old behaviour exactly when flipped, so A/B runs are honest.
Environment overrides: `STRATA_<FIELD>` (upper case), for example `STRATA_PREFETCH=16`.
"""

from __future__ import annotations

import dataclasses
import enum
import os
from dataclasses import dataclass
from typing import Mapping

from strata.errors import ConfigError


class Backend(enum.Enum):
    AUTO = "auto"  # MLX where a GPU is, numpy otherwise (chosen by measurement: docs/perf.md)
    NUMPY = "numpy"
    MLX = "mlx"


STOCK_PREFETCH = 10
STOCK_MOCE_J = 3
STOCK_MOCE_LAMBDA = 0.85


@dataclass(frozen=True)
class Config:
    backend: Backend = Backend.AUTO
    prefetch: int = STOCK_PREFETCH  # read-ahead depth K (0: no read-ahead)
    prefetch_touch: bool = False  # move resident guesses to the LRU front
    prefetch2: bool = False  # also read ahead two layers ahead
    split_turn: bool = True  # read-ahead bookkeeping after the GPU is released
    shexp_overlap: bool = True  # shared expert computed during the host turn
    pred_q8: bool = True  # read-ahead guess on a Q8_0 copy of the routers
    moce_j: int = STOCK_MOCE_J  # protected top-J
    moce_lambda: float = STOCK_MOCE_LAMBDA  # resident bonus λ (0: the model's own routing)
    arena: str = ""  # arena size ("2GB", "512MB", "300slots"); empty: the budget rule
    keep: str = "7GB"  # memory the budget rule leaves to the system
    mlock_dense: bool = False
    wire_arena: bool = False
    verify_reads: bool = False  # check each record's checksum when it lands in a slot
    io_threads: int = 4
    profile: bool = False
    logpos: str = ""  # path: dump per-position logits for KLD

    def __post_init__(self) -> None:
        if self.prefetch < 0:
            raise ConfigError(f"prefetch must be >= 0, got {self.prefetch}")
        if self.moce_j < 0:
            raise ConfigError(f"moce_j must be >= 0, got {self.moce_j}")
        if self.moce_lambda < 0:
            raise ConfigError(f"moce_lambda must be >= 0, got {self.moce_lambda}")
        if self.io_threads < 1:
            raise ConfigError(f"io_threads must be >= 1, got {self.io_threads}")

    def replace(self, **changes) -> "Config":
        return from_mapping(changes, base=self)


def _field_types() -> dict[str, type]:
    return {f.name: f.type for f in dataclasses.fields(Config)}


def _coerce(name: str, value, typ: str):
    if typ in ("bool", bool):
        if isinstance(value, bool):
            return value
        text = str(value).strip().lower()
        if text in ("1", "true", "on", "yes"):
            return True
        if text in ("0", "false", "off", "no"):
            return False
        raise ConfigError(f"{name}: expected on/off, got {value!r}")
    try:
        if typ in ("int", int):
            return int(value)
        if typ in ("float", float):
            return float(value)
        if typ in ("Backend", Backend):
            return value if isinstance(value, Backend) else Backend(str(value).lower())
    except ValueError:
        raise ConfigError(f"{name}: cannot read {value!r} as {typ}") from None
    return str(value)


def from_mapping(values: Mapping[str, object], base: Config | None = None) -> Config:
    """A Config with `values` (field name -> value or text) applied; unknown keys are rejected."""
    types = _field_types()
    unknown = sorted(set(values) - set(types))
    if unknown:
        raise ConfigError(f"unknown config keys {unknown}; known: {', '.join(sorted(types))}")
    coerced = {k: _coerce(k, v, types[k]) for k, v in values.items()}
    return dataclasses.replace(base or Config(), **coerced)


ENV_PREFIX = "STRATA_"
_NOT_CONFIG_ENV = {"STRATA_CACHE_DIR", "STRATA_HOME"}


def from_env(environ: Mapping[str, str] | None = None, base: Config | None = None) -> Config:
    """Apply `STRATA_<FIELD>` variables. An unknown `STRATA_*` name is an error, not ignored,
    so a misspelt A/B switch cannot silently measure the default."""
    environ = os.environ if environ is None else environ
    values = {}
    for key, value in environ.items():
        if key.startswith(ENV_PREFIX) and key not in _NOT_CONFIG_ENV:
            values[key[len(ENV_PREFIX):].lower()] = value
    return from_mapping(values, base=base)
