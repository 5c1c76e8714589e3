"""The one runtime configuration (design §6): a frozen dataclass; environment and CLI read here only.

Every switch restores the old behaviour exactly when flipped, so A/B runs are honest.
Environment overrides: `STRATA_<FIELD>` (upper case), for example `STRATA_PREFETCH=16`.
CLI flags become a mapping of field names; `load_config(cli)` applies the environment first and
the CLI over it, so a flag always wins over a variable. Unknown keys are errors everywhere.
"""

from __future__ import annotations

import dataclasses
import difflib
import enum
import math
import os
from dataclasses import dataclass
from pathlib import Path
from typing import Mapping

from strata.errors import ConfigError
from strata.reference.attention import KVPrecision
from strata.reference.routing import STOCK_DROP_TAIL_RANK, BonusScale, MoCEPolicy


class Backend(enum.Enum):
    AUTO = "auto"  # MLX where a GPU is and a fused kernel reads the experts, numpy otherwise (docs/perf.md)
    NUMPY = "numpy"
    MLX = "mlx"


STOCK_PREFETCH = 10
STOCK_MOCE_J = 3
STOCK_MOCE_LAMBDA = 0.85  # the reference engine's stock bonus: lossy, so not the default (λ = 0 is exact)
MOCE_PRESETS = {  # `moce=` fills these fields where they are left at their defaults
    "stock": dict(moce_j=STOCK_MOCE_J, moce_lambda=STOCK_MOCE_LAMBDA),  # the reference engine's measured policy (lossy)
    "off": dict(moce_lambda=0.0, moce_drop_tail=0.0),  # the model's own routing, bit for bit
}
STOCK_PREFILL_CHUNK = 64  # prompt positions per chunk: bounds a chunk's expert union and its activations
MAX_SUFFIX_DRAFT = 3  # drafted tokens per window: the range measured (docs/perf.md, speculative windows)
STOCK_IO_TIMEOUT = 60.0  # seconds a wait may block before it is an error: a stuck disk is not a hang


def knob(default, help: str, *, flag: bool = True):
    """A Config field with its one-line help: the CLI derives its flag from it (`--field-name`;
    flag=False: reachable through `--set` and the environment only)."""
    return dataclasses.field(default=default, metadata={"help": help, "flag": flag})


@dataclass(frozen=True)
class Config:
    backend: Backend = knob(Backend.AUTO, "auto, numpy or mlx (auto: MLX where a GPU is and a fused kernel reads the experts)")
    prefetch: int = knob(STOCK_PREFETCH, "read-ahead depth K (default 10; 16 recommended; 0 off)")
    prefetch_touch: bool = knob(False, "move resident guesses to the LRU front (default off)")
    prefetch2: bool = knob(False, "also read ahead two MoE layers ahead (default off)")
    split_turn: bool = knob(True, "read-ahead bookkeeping after compute is handed off (default on)")
    layer_pins: bool = knob(False, "numpy: a decode pin lasts one layer, not the window, so the smallest arena holds "
                                   "one layer's experts (default off; the budget rule turns it on, and lowers "
                                   "prefetch, where the arena is short, and says so)", flag=False)
    shexp_overlap: bool = knob(True, "shared expert during the host turn (default on)")
    pred_q8: bool = knob(True, "read-ahead guess on a Q8_0 router copy (default on)")
    moce_j: int = knob(STOCK_MOCE_J, "MoCE: protected top-J (default 3)")
    moce: str = knob("", "MoCE preset: stock (J=3, λ=0.85 logits: lossy, the reference engine's; refused on sigmoid-routed models) or off (exact); default: the moce_* fields")
    moce_lambda: float = knob(0.0, "MoCE: resident bonus λ (default 0: exact, the model's routing; > 0 is lossy)")
    moce_scale: BonusScale = knob(BonusScale.ABSOLUTE, "MoCE: λ absolute, in the rule's score units (logits; σ(z)+bias on sigmoid rules), or range: x the score spread")
    moce_margin: float = knob(0.0, "MoCE: margin gating in logits (default 0: off)")
    moce_drop_tail: float = knob(0.0, "MoCE: drop non-resident picks with weight below this (default 0: off)")
    moce_drop_rank: int = knob(STOCK_DROP_TAIL_RANK, "MoCE: ... at selected rank >= this (default 6)")
    moce_pre: bool = knob(False, "MoCE: unclaimed read-aheads count as resident (default off)")
    arena: str = knob("", "arena size: 2GB or 512MB (bytes), 300 or 300slots (slots), 25% (of all experts); "
                            "default: the budget rule; streams when set")
    keep: str = knob("auto", "memory the budget rule leaves beside the arena, with a unit (default auto: a 16th "
                          "of the machine, at least 40MiB, at most 512MiB; docs/runtime.md)")
    ple_reserve: str = knob("0", "memory the budget rule reserves for per-layer embeddings", flag=False)
    mlock_dense: bool = knob(False, "wire the dense weights (default off)")
    wire_arena: bool = knob(False, "wire the arena (default off)")
    verify_reads: bool = knob(True, "check each record's CRC-32 when it lands (default on; off lets corrupt bytes compute)")
    direct_io: bool = knob(True, "O_DIRECT reads where allowed (default on)")
    io_threads: int = knob(4, "reader threads (default 4)")
    io_timeout: float = knob(STOCK_IO_TIMEOUT, "seconds a read may block before it is an error", flag=False)
    io_switch_ms: float = knob(0.2, "thread switch interval while streaming (default 0.2; 0: Python's)")
    prefill_chunk: int = knob(STOCK_PREFILL_CHUNK, "prompt positions per chunk (default 64)")
    window: int = knob(1, "positions one decode window may hold (decode_window, drafts; default 1)")
    profile: bool = knob(False, "per-phase ms/token in the stream report")
    reference_cache: bool = knob(False, "drive the runtime with the pure reference cache machine (slow; A/B)",
                                 flag=False)
    logpos: str = knob("", "append every position's logits (float32 rows) to this file, for KLD")
    # entry points (issue 23): the CPU path's threads (BLAS and the compiled kernels)
    threads: int = knob(0, "threads of numpy's BLAS and the compiled CPU kernels (default 0: auto, strata/threads.py)")
    cpu_kernels: bool = knob(True, "numpy backend: quantized products (experts, dense, head) on compiled CPU kernels, "
                                   "built at first use (default on; off: the float32 reference's; docs/cpu.md)")
    force_arena: bool = knob(False, "run an --arena above this machine's budget (or the GPU's wired ceiling) anyway "
                                    "(default off: refused)")
    # speculative windows (strata.speculative): drafted tokens verified in one decode window
    suffix_draft: int = knob(0, "speculate: draft up to N tokens (1..3) from a suffix index over prompt and "
                                "generation, verified in one window (raises window to N+1; default 0: off)")
    mtp_draft: bool = knob(False, "speculate: draft one token per window through the model's MTP layer (a Qwen3-Next "
                                  "/ Qwen3.5 conversion that kept mtp.*, or a DeepSeek-V3 / GLM-4.5 one that kept its "
                                  "nextn layer; numpy reference drafter; default off)")
    spec_gate: bool = knob(True, "speculation switches itself off while it stops paying in bytes and ms per "
                                 "token (default on)")
    # issue 19 (long-context decode): the attention caches' precision (reference.attention.KVPrecision)
    kv_cache: KVPrecision = knob(KVPrecision.F32, "KV cache precision: f32 (exact, default) or f16 (each key and "
                                                  "value rounded once: half the bytes; MLX engines only)")

    def __post_init__(self) -> None:
        for name, typ in _field_types().items():  # Config(backend="numpy", prefetch="16") reads like the CLI
            value = getattr(self, name)
            coerced = _coerce(name, value, typ)
            if coerced is not value:
                object.__setattr__(self, name, coerced)
        if self.moce:  # a preset resolves into the fields once (then `replace` edits fields, not the preset)
            if self.moce not in MOCE_PRESETS:
                raise ConfigError(f"moce: unknown preset {self.moce!r} (one of {', '.join(MOCE_PRESETS)})")
            defaults = {f.name: f.default for f in dataclasses.fields(self)}
            for name, value in MOCE_PRESETS[self.moce].items():
                if getattr(self, name) == defaults[name]:
                    object.__setattr__(self, name, value)
            object.__setattr__(self, "moce", "")
        if self.prefetch < 0:
            raise ConfigError(f"prefetch must be >= 0, got {self.prefetch}")
        if self.moce_j < 0:
            raise ConfigError(f"moce_j must be >= 0, got {self.moce_j}")
        if self.moce_lambda < 0:
            raise ConfigError(f"moce_lambda must be >= 0, got {self.moce_lambda}")
        if self.moce_margin < 0:
            raise ConfigError(f"moce_margin must be >= 0 (0: off), got {self.moce_margin}")
        if not 0 <= self.moce_drop_tail <= 1:  # checked here too, so the message names the field
            raise ConfigError(f"moce_drop_tail must be in [0, 1] (0: off), got {self.moce_drop_tail}")
        if self.moce_drop_rank < 0:
            raise ConfigError(f"moce_drop_rank must be >= 0, got {self.moce_drop_rank}")
        if self.io_threads < 1:
            raise ConfigError(f"io_threads must be >= 1, got {self.io_threads}")
        if self.io_switch_ms < 0:
            raise ConfigError(f"io_switch_ms must be >= 0 (0: Python's own), got {self.io_switch_ms}")
        if not 0 < self.io_timeout < float("inf"):  # an infinite wait is the hang the timeout exists to end
            raise ConfigError(f"io_timeout must be a finite number of seconds > 0, got {self.io_timeout}")
        for name, typ in _field_types().items():  # NaN passes every `<` check above; inf is no setting either
            if typ == "float" and not math.isfinite(getattr(self, name)):
                raise ConfigError(f"{name} must be a finite number, got {getattr(self, name)}")
        if self.prefill_chunk < 1:
            raise ConfigError(f"prefill_chunk must be >= 1, got {self.prefill_chunk}")
        if self.window < 1:
            raise ConfigError(f"window must be >= 1, got {self.window}")
        if self.threads < 0:
            raise ConfigError(f"threads must be >= 0 (0: auto), got {self.threads}")
        if not 0 <= self.suffix_draft <= MAX_SUFFIX_DRAFT:
            raise ConfigError(f"suffix_draft must be in 0..{MAX_SUFFIX_DRAFT} (0: off), got {self.suffix_draft}")
        if self.mtp_draft and self.suffix_draft:
            raise ConfigError("mtp_draft and suffix_draft are two drafters; choose one")
        drafted = 1 if self.mtp_draft else self.suffix_draft
        if self.window < drafted + 1:  # a draft and the token before it are one cache window
            object.__setattr__(self, "window", drafted + 1)
        from strata.sizes import parse_size

        for name in ("arena", "keep", "ple_reserve"):
            value = getattr(self, name)
            if value and not (name == "keep" and value == "auto"):
                parse_size(value, what=name, allow_slots=name == "arena")
        self.moce_policy()  # validates the MoCE fields together
        if self.logpos:
            _check_logpos(self.logpos)

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


def _check_logpos(path: str) -> None:
    """`logpos` names a file that can be created or appended to: not a directory, in a directory
    that exists and is writable (a write that fails later, as on a full disk, is refused then)."""
    p = Path(path)
    if p.is_dir():
        raise ConfigError(f"logpos {path}: is a directory; name a file")
    parent = p.absolute().parent
    if not parent.is_dir():
        raise ConfigError(f"logpos {path}: no such directory {parent} (create it first)")
    if not os.access(parent, os.W_OK | os.X_OK) and not (p.exists() and os.access(p, os.W_OK)):
        raise ConfigError(f"logpos {path}: directory {parent} is not writable")


_ENUMS: dict[str, type[enum.Enum]] = {"Backend": Backend, "BonusScale": BonusScale, "KVPrecision": KVPrecision}


def field_types() -> dict[str, type]:
    """Each field's Python type (int, float, bool, str or an enum class): what the CLI parses."""
    plain = {"int": int, "float": float, "bool": bool, "str": str}
    return {name: plain.get(t) or _ENUMS[t] for name, t in _field_types().items()}


def _field_types() -> dict[str, str]:
    return {f.name: f.type if isinstance(f.type, str) else f.type.__name__ for f in dataclasses.fields(Config)}


_WANTED = {"int": "an int", "float": "a number", "bool": "True or False", "str": "a str"}


def _coerce(name: str, value, typ: str):
    if value is None:  # Config(prefetch=None): a mistake, not "the default" (leaving the field out is)
        default = next(f.default for f in dataclasses.fields(Config) if f.name == name)
        shown = default.value if isinstance(default, enum.Enum) else default
        wanted = _WANTED.get(typ) or "one of " + ", ".join(m.value for m in _ENUMS[typ])
        raise ConfigError(f"{name}: got None; give {wanted} or leave {name} out "
                          f"for its default ({shown!r})")
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
    except (ValueError, TypeError):  # TypeError: int([1]), float({}): not a number at all
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
ENV_NOT_CONFIG = frozenset({"STRATA_DEBUG"})  # read by the CLI (strata/cli/main.py), not a Config field


def from_env(environ: Mapping[str, str] | None = None, base: Config | None = None) -> Config:
    """Apply `STRATA_<FIELD>` variables. An unknown `STRATA_*` name is an error, not ignored,
    so a misspelt A/B switch cannot silently measure the default; either error names the variable."""
    environ = os.environ if environ is None else environ
    types = _field_types()
    values = {}
    for key, value in sorted(environ.items()):
        if not key.startswith(ENV_PREFIX) or key in ENV_NOT_CONFIG:
            continue
        name = key[len(ENV_PREFIX):].lower()
        if name not in types:
            close = difflib.get_close_matches(name, types, n=1)
            hint = f"did you mean {ENV_PREFIX}{close[0].upper()}?" if close else "STRATA_<FIELD> sets a Config field"
            raise ConfigError(f"environment variable {key}: unknown config key {name!r} (unset it; {hint})")
        try:
            values[name] = _coerce(name, value, types[name])
        except ConfigError as e:
            raise ConfigError(f"environment variable {key}: {e}") from None
    try:
        return from_mapping(values, base=base)
    except ConfigError as e:
        raise ConfigError(f"environment (STRATA_* variables): {e}") from None


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
