"""The arena a tier-2 run gets, from the checkpoint's layout alone: one rule for the engine and
the doctor.

`checkpoint_layout(directory)` builds mlx-lm's model lazily (its config, class, sanitize and
quantization; no weight is read), finds every switch layer and locates its stacked experts in
the shards' headers: the slot geometry, the dense bytes mlx-lm will hold and the experts a
token selects. `arena_plan(layout, config)` is the runtime's budget rule
(strata.runtime.budget.plan_arena) over that geometry: `--arena`, or every expert when all fit,
else the budget's slots, refused below one window's selections plus the read-ahead depth.
The engine calls it at start (memory as it is then); `strata doctor` calls it with today's
available memory less what loading will take first.
"""

from __future__ import annotations

import json
import re
from dataclasses import dataclass
from pathlib import Path

from strata.cache.types import CacheConfig
from strata.errors import ConfigError, FormatError
from strata.runtime.budget import ArenaPlan, plan_arena

__all__ = ["CheckpointLayout", "checkpoint_layout", "arena_plan", "cache_config", "TOP_K_KEYS",
           "DEFAULT_MAX_CONTEXT", "not_runnable", "config_value"]

# where configs name the experts a token selects (the first present wins)
TOP_K_KEYS = ("num_experts_per_tok", "num_experts_per_token", "moe_topk", "moe_top_k", "moe_k", "top_k",
              "top_k_experts", "n_activated_experts")
DEFAULT_MAX_CONTEXT = 32768  # a config without max_position_embeddings: mlx-lm sets no limit either


@dataclass(eq=False)
class CheckpointLayout:
    """A checkpoint as mlx-lm builds it, weights unread. `model` is mlx-lm's Model (lazy arrays);
    `found` its switch layers by MoE layer as (path, module); `tensors` where their experts are
    (strata.tier2.expert_tensors.ExpertTensors); `dense_bytes` every other parameter's bytes."""

    directory: Path
    model_type: str
    model: object
    config: dict
    found: list
    tensors: object
    dense_bytes: int
    top_k: int

    @property
    def n_moe_layers(self) -> int:
        return self.tensors.n_layers

    @property
    def n_experts(self) -> int:
        return self.tensors.n_experts


def not_runnable(directory: Path, why: str) -> str:
    """The one-line refusal of a checkpoint directory tier 2 cannot run, with the other way in."""
    return (f"{directory}: a Hugging Face checkpoint directory that tier 2 cannot run as it is ({why}); for a "
            f"native family run `strata convert {directory} OUT`, then `strata generate OUT.gguf PROMPT`")


def config_value(config: dict, keys) -> object:
    for c in (config, config.get("text_config") or {}):
        for k in keys:
            if c.get(k) is not None:
                return c[k]
    return None


def _layer_key(path: str) -> tuple[int, ...]:
    return tuple(int(n) for n in re.findall(r"\.(\d+)(?=\.|$)", path))


def checkpoint_layout(directory: str | Path) -> CheckpointLayout:
    """mlx-lm's model of `directory`, lazily, with its experts located (module doc). Raises a
    one-line FormatError / ConfigError where tier 2 cannot run it."""
    directory = Path(directory)
    from mlx.utils import tree_flatten
    from mlx_lm.models.switch_layers import SwitchGLU, SwitchMLP
    from mlx_lm.utils import load_model

    from strata.tier2.expert_tensors import locate_experts
    try:
        config = json.loads((directory / "config.json").read_text())
    except (OSError, ValueError) as e:
        raise FormatError(f"{directory / 'config.json'}: unreadable ({e})") from None
    model_type = config.get("model_type") if isinstance(config, dict) else None
    if model_type is None:
        raise FormatError(not_runnable(directory, "its config.json names no model_type"))
    try:
        model, config = load_model(directory, lazy=True)
    except (ValueError, RuntimeError, OSError, KeyError, TypeError, AttributeError) as e:
        # mlx-lm's words for an unknown model_type, a config it cannot read, a damaged shard
        why = (str(e).splitlines() or [type(e).__name__])[0]
        raise FormatError(not_runnable(directory, f"mlx-lm cannot load it: {why}")) from None
    found = sorted(((p, m) for p, m in model.named_modules() if isinstance(m, (SwitchGLU, SwitchMLP))),
                   key=lambda t: _layer_key(t[0]))  # MoE layers in forward order
    if not found:
        raise ConfigError(f"{directory}: {model_type} has no routed experts in mlx-lm's model (no switch layer); "
                          "tier 2 streams MoE models only")
    from strata.tier2.records import use_records

    # the aligned records `strata convert DIR` wrote, where they were made from these shards
    tensors = use_records(locate_experts(directory, [(p, dict(tree_flatten(m.parameters()))) for p, m in found]))
    total = sum(a.nbytes for _, a in tree_flatten(model.parameters()))  # shapes only: nothing is read
    experts = sum(a.nbytes for _, m in found for _, a in tree_flatten(m.parameters()))
    top_k = config_value(config, TOP_K_KEYS)
    if not isinstance(top_k, int) or not 1 <= top_k <= tensors.n_experts:
        raise ConfigError(f"{directory}: config.json names no experts per token ({' / '.join(TOP_K_KEYS[:3])}, ...)")
    return CheckpointLayout(directory, str(model_type), model, config, found, tensors, total - experts, top_k)


def cache_config(n_layers: int, n_experts: int, top_k: int, config, capacity: int) -> CacheConfig:
    """The cache machine's configuration for a tier-2 run of `config` at `capacity` slots."""
    return CacheConfig(capacity=capacity, n_layers=n_layers, n_experts=n_experts, top_k=top_k, window=config.window,
                       prefetch_depth=config.prefetch, prefetch_touch=config.prefetch_touch,
                       prefetch2=config.prefetch2, split_turn=config.split_turn)


def arena_plan(*, tensors, top_k: int, dense_bytes: int, config, available: int | None = None,
               total: int | None = None) -> ArenaPlan:
    """`--arena` or the budget rule over the experts in `tensors` (a slot per expert when all
    fit). `available` / `total`: the memory figures to plan with (default: this machine now)."""
    least = cache_config(tensors.n_layers, tensors.n_experts, top_k, config, 1).min_capacity
    return plan_arena(config=config, slot_bytes=tensors.slot_bytes, total_experts=tensors.n_records,
                      min_slots=least, dense_bytes=dense_bytes, model_files=tuple(dict.fromkeys(tensors.shards + tensors.read_files)),
                      available=available,
                      total=total)
