"""Reading a checkpoint's `config.json`: both spellings transformers writes, and clear refusals.

transformers has renamed keys over the years, and checkpoints on the Hub carry every vintage:
`num_experts` / `num_local_experts`, a top-level `rope_theta` + `rope_scaling` (v4) or one
`rope_parameters` dict (v5), a null `head_dim` meaning hidden / heads. `HFConfig.get` takes the
first spelling present; the rope helper reads both forms. A feature strata's reference forward
does not compute (rope scaling, q/k/v clipping, dense-MLP layers, a non-SiLU activation) is
refused with `unsupported()`, which names what is supported, never silently dropped.
"""

from __future__ import annotations

import json
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from strata.errors import ConfigError

CONFIG_NAME = "config.json"
SUPPORTED_ACTIVATION = "silu"  # SwiGLU: the reference experts compute silu(gate) * up
_MISSING = object()


@dataclass(frozen=True)
class HFConfig:
    """A parsed config.json; `family` is the human name of its architecture, for messages."""

    path: Path
    raw: dict
    family: str = ""

    @classmethod
    def read(cls, directory: str | Path) -> "HFConfig":
        path = Path(directory) / CONFIG_NAME
        try:
            raw = json.loads(path.read_text())
        except FileNotFoundError:
            raise ConfigError(f"{directory}: no {CONFIG_NAME} (is this a Hugging Face checkpoint directory?)") from None
        except (OSError, UnicodeDecodeError, json.JSONDecodeError) as e:
            raise ConfigError(f"{path}: unreadable ({type(e).__name__}: {' '.join(str(e).split())})") from None
        if not isinstance(raw, dict):
            raise ConfigError(f"{path}: not a JSON object")
        return cls(path, raw)

    @property
    def model_type(self) -> str | None:
        return self.raw.get("model_type")

    def get(self, *keys: str, default: Any = _MISSING) -> Any:
        """The value of the first of `keys` present and not null; `default` if none is (an error
        naming the keys if no default is given)."""
        for k in keys:
            if self.raw.get(k) is not None:
                return self.raw[k]
        if default is _MISSING:
            raise ConfigError(f"{self.path}: missing key {' / '.join(repr(k) for k in keys)}")
        return default

    def get_int(self, *keys: str, default: Any = _MISSING) -> int:
        v = self.get(*keys, default=default)
        if isinstance(v, bool) or not isinstance(v, int):
            raise ConfigError(f"{self.path}: {keys[0]!r} must be an integer, got {v!r}")
        return v

    def get_float(self, *keys: str, default: Any = _MISSING) -> float:
        v = self.get(*keys, default=default)
        if isinstance(v, bool) or not isinstance(v, (int, float)):
            raise ConfigError(f"{self.path}: {keys[0]!r} must be a number, got {v!r}")
        return float(v)

    def get_bool(self, *keys: str, default: Any = _MISSING) -> bool:
        v = self.get(*keys, default=default)
        if not isinstance(v, bool):
            raise ConfigError(f"{self.path}: {keys[0]!r} must be true or false, got {v!r}")
        return v

    def unsupported(self, feature: str, supported: str) -> ConfigError:
        """The error for a feature strata cannot run: what it is, and what would be accepted."""
        return ConfigError(f"{self.path}: unsupported {self.family or self.model_type} feature: {feature} "
                           f"(supported: {supported})")

    # ------------------------------------------------------------ shared readings

    def head_dim(self) -> int:
        hidden, heads = self.get_int("hidden_size"), self.get_int("num_attention_heads")
        hd = self.get("head_dim", default=None)
        if hd is None:
            if hidden % heads:
                raise ConfigError(f"{self.path}: hidden_size {hidden} is not a multiple of num_attention_heads {heads}")
            return hidden // heads
        return self.get_int("head_dim")

    def rope_theta(self, default: float) -> float:
        """The RoPE base, from `rope_parameters` (v5) or `rope_theta` + `rope_scaling` (v4).
        Only plain RoPE is supported: any scaling type other than "default" is refused."""
        params = self.raw.get("rope_parameters")
        scaling = self.raw.get("rope_scaling")
        for name, d in (("rope_parameters", params), ("rope_scaling", scaling)):
            if d is None:
                continue
            if not isinstance(d, dict):
                raise ConfigError(f"{self.path}: {name!r} must be an object, got {d!r}")
            kind = d.get("rope_type", d.get("type", "default"))
            if kind != "default":
                raise self.unsupported(f"{name}.rope_type = {kind!r}", "plain RoPE (rope_type 'default' or no scaling)")
            extra = sorted(set(d) - {"rope_type", "type", "rope_theta", "partial_rotary_factor"})
            if extra:
                raise self.unsupported(f"{name} keys {extra}", "plain RoPE with only 'rope_theta'")
        partial = (params or {}).get("partial_rotary_factor", self.get("partial_rotary_factor", default=1.0))
        if partial != 1.0:
            raise self.unsupported(f"partial_rotary_factor = {partial}", "rotary embedding over the whole head (1.0)")
        if params is not None and params.get("rope_theta") is not None:
            return float(params["rope_theta"])
        return self.get_float("rope_theta", default=default)

    def check_activation(self) -> None:
        act = self.get("hidden_act", "hidden_activation", default=SUPPORTED_ACTIVATION)
        if act != SUPPORTED_ACTIVATION:
            raise self.unsupported(f"hidden_act = {act!r}", f"{SUPPORTED_ACTIVATION!r} (SwiGLU experts)")

    def check_not_quantized(self) -> None:
        q = self.raw.get("quantization_config")
        if q is not None:
            method = q.get("quant_method", "?") if isinstance(q, dict) else q
            raise self.unsupported(f"a pre-quantized checkpoint (quantization_config: {method})",
                                   "float checkpoints in F32, F16 or BF16, block-wise FP8 (quant_method fp8), "
                                   "mlx-lm's quantized ones")

    def max_context(self, sliding_window: int | None) -> int:
        """max_position_embeddings, capped at the sliding window when one is in use.

        Sliding-window attention over a window W is full causal attention for sequences of at
        most W positions (every key is within W of every query), so capping the context at W
        runs a sliding-window model exactly, without a windowed attention in the reference."""
        n = self.get_int("max_position_embeddings")
        if sliding_window is not None:
            if isinstance(sliding_window, bool) or not isinstance(sliding_window, int) or sliding_window <= 0:
                raise ConfigError(f"{self.path}: sliding_window must be a positive integer, got {sliding_window!r}")
            n = min(n, sliding_window)
        return n
