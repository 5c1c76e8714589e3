"""The one runtime configuration (SPEC §6): a frozen dataclass; environment and CLI read here only.

Every switch restores the old behaviour exactly when flipped, so A/B runs are honest.
Environment overrides: `STRATA_<FIELD>` (upper case), for example `STRATA_PREFETCH=16`.
CLI flags become a mapping of field names; `load_config(cli)` applies the environment first and
the CLI over it, so a flag always wins over a variable. Unknown keys are errors everywhere.
"""

from __future__ import annotations

import dataclasses
import enum
import os
from dataclasses import dataclass
from typing import Mapping

from strata.errors import ConfigError
from strata.reference.routing import STOCK_DROP_TAIL_RANK, BonusScale, MoCEPolicy


class Backend(enum.Enum):
    AUTO = "auto"  # MLX where a GPU is and the experts are Q2_0, numpy otherwise (docs/perf.md)
    NUMPY = "numpy"
    MLX = "mlx"


STOCK_PREFETCH = 10
STOCK_MOCE_J = 3
STOCK_MOCE_LAMBDA = 0.85
STOCK_PREFILL_CHUNK = 64  # prompt positions per chunk: bounds a chunk's expert union and its activations
STOCK_IO_TIMEOUT = 60.0  # seconds a wait may block before it is an error: a stuck disk is not a hang


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
    moce_scale: BonusScale = BonusScale.ABSOLUTE  # λ in logits, or scaled by the running logit range
    moce_margin: float = 0.0  # margin gating: cap the bonus at this many logits (0: off)
    moce_drop_tail: float = 0.0  # drop-tail: skip non-resident picks with weight < w (0: off)
    moce_drop_rank: int = STOCK_DROP_TAIL_RANK  # ... at selected rank >= r
    moce_pre: bool = False  # count unclaimed read-aheads (PRE) as resident for the bonus
    arena: str = ""  # arena size ("2GB", "512MB", "300slots"); empty: the budget rule
    keep: str = "auto"  # memory the budget rule leaves to the system; auto: 7 GB per 24 GB of RAM (the seed's)
    ple_reserve: str = "0"  # memory the budget rule reserves for per-layer embeddings
    mlock_dense: bool = False
    wire_arena: bool = False
    verify_reads: bool = False  # check each record's checksum when it lands in a slot
    direct_io: bool = True  # O_DIRECT reads where the filesystem allows (buffered otherwise)
    io_threads: int = 4
    io_timeout: float = STOCK_IO_TIMEOUT
    io_switch_ms: float = 0.2  # thread switch interval while streaming (0: Python's own 5 ms)
    prefill_chunk: int = STOCK_PREFILL_CHUNK
    profile: bool = False  # per-phase timings in the stream report
    reference_cache: bool = False  # drive the runtime with the pure reference cache machine (slow; for A/B and debugging)
    logpos: str = ""  # path: dump per-position logits for KLD (raw float32 rows of vocab_size)
    force_arena: bool = False  # run an --arena above the budget rule's (or the GPU's wired ceiling) anyway

    def __post_init__(self) -> None:
        for name, typ in _field_types().items():  # Config(backend="numpy", prefetch="16") reads like the CLI
            value = getattr(self, name)
            coerced = _coerce(name, value, typ)
            if coerced is not value:
                object.__setattr__(self, name, coerced)
        if self.prefetch < 0:
            raise ConfigError(f"prefetch must be >= 0, got {self.prefetch}")
        if self.moce_j < 0:
            raise ConfigError(f"moce_j must be >= 0, got {self.moce_j}")
        if self.moce_lambda < 0:
            raise ConfigError(f"moce_lambda must be >= 0, got {self.moce_lambda}")
        if self.moce_margin < 0:
            raise ConfigError(f"moce_margin must be >= 0 (0: off), got {self.moce_margin}")
        if self.io_threads < 1:
            raise ConfigError(f"io_threads must be >= 1, got {self.io_threads}")
        if self.io_switch_ms < 0:
            raise ConfigError(f"io_switch_ms must be >= 0 (0: Python's own), got {self.io_switch_ms}")
        if not self.io_timeout > 0:
            raise ConfigError(f"io_timeout must be > 0 seconds, got {self.io_timeout}")
        if self.prefill_chunk < 1:
            raise ConfigError(f"prefill_chunk must be >= 1, got {self.prefill_chunk}")
        from strata.runtime.budget import parse_size  # late: budget imports nothing from here

        for name in ("arena", "keep", "ple_reserve"):
            value = getattr(self, name)
            if value and not (name == "keep" and value == "auto"):
                parse_size(value, what=name, allow_slots=name == "arena")
        self.moce_policy()  # validates the MoCE fields together

    def replace(self, **changes) -> "Config":
        return from_mapping(changes, base=self)

    def moce_policy(self) -> MoCEPolicy:
        """The routing policy these fields describe (λ = 0 and no drop-tail: the model's own)."""
        try:
            return MoCEPolicy(protect_top_j=self.moce_j, bonus=float(self.moce_lambda),
                              bonus_scale=self.moce_scale, margin=self.moce_margin or None,
                              drop_tail_weight=float(self.moce_drop_tail), drop_tail_min_rank=self.moce_drop_rank)
        except ConfigError as e:
            raise ConfigError(f"config: {e}") from None


_ENUMS: dict[str, type[enum.Enum]] = {"Backend": Backend, "BonusScale": BonusScale}


def _field_types() -> dict[str, str]:
    return {f.name: f.type if isinstance(f.type, str) else f.type.__name__ for f in dataclasses.fields(Config)}


def _coerce(name: str, value, typ: str):
    if typ == "bool":
        if isinstance(value, bool):
            return value
        text = str(value).strip().lower()
        if text in ("1", "true", "on", "yes"):
            return True
        if text in ("0", "false", "off", "no"):
            return False
        raise ConfigError(f"{name}: expected on/off, got {value!r}")
    try:
        if typ == "int":
            if isinstance(value, bool) or (isinstance(value, float) and not value.is_integer()):
                raise ValueError
            return value if type(value) is int else int(value)
        if typ == "float":
            return value if type(value) is float else float(value)
        if typ in _ENUMS:
            cls = _ENUMS[typ]
            return value if isinstance(value, cls) else cls(str(value).lower())
    except ValueError:
        choices = f" (one of {', '.join(m.value for m in _ENUMS[typ])})" if typ in _ENUMS else ""
        raise ConfigError(f"{name}: cannot read {value!r} as {typ}{choices}") from None
    return value if type(value) is str else str(value)


def from_mapping(values: Mapping[str, object], base: Config | None = None) -> Config:
    """A Config with `values` (field name -> value or text) applied; unknown keys are rejected."""
    types = _field_types()
    unknown = sorted(set(values) - set(types))
    if unknown:
        raise ConfigError(f"unknown config keys {unknown}; known: {', '.join(sorted(types))}")
    coerced = {k: _coerce(k, v, types[k]) for k, v in values.items()}
    return dataclasses.replace(base or Config(), **coerced)


ENV_PREFIX = "STRATA_"


def from_env(environ: Mapping[str, str] | None = None, base: Config | None = None) -> Config:
    """Apply `STRATA_<FIELD>` variables. An unknown `STRATA_*` name is an error, not ignored,
    so a misspelt A/B switch cannot silently measure the default."""
    environ = os.environ if environ is None else environ
    values = {}
    for key, value in environ.items():
        if key.startswith(ENV_PREFIX):
            values[key[len(ENV_PREFIX):].lower()] = value
    return from_mapping(values, base=base)


def load_config(overrides: Mapping[str, object] | None = None, *,
                environ: Mapping[str, str] | None = None) -> Config:
    """The configuration of a run: defaults, then `STRATA_*` variables, then `overrides`
    (CLI flags, `--set KEY=VALUE`). The only place the environment is read."""
    return from_mapping(dict(overrides or {}), base=from_env(environ))


def parse_assignments(items: list[str] | tuple[str, ...]) -> dict[str, str]:
    """`["prefetch=16", "split_turn=off"]` -> {"prefetch": "16", "split_turn": "off"} (CLI `--set`)."""
    out = {}
    for item in items:
        key, sep, value = item.partition("=")
        if not sep or not key.strip():
            raise ConfigError(f"--set wants KEY=VALUE, got {item!r}")
        out[key.strip().replace("-", "_").lower()] = value.strip()
    return out
