"""gpt-oss: sliding-window and full attention alternating, attention sinks and an output bias,
router and expert biases, the clamped SwiGLU, YaRN rotary scaling, MXFP4 experts.

Its converter: strata/convert/gpt_oss.py (experts: convert/gpt_oss_experts.py); its pieces:
reference/attention.py (sinks, windows), reference/experts.py (CLAMPED_SWIGLU),
reference/rope_scaling.py (YaRN).
"""

from __future__ import annotations

import math
from dataclasses import dataclass
from typing import TYPE_CHECKING

from strata.errors import ConfigError
from strata.families.counts import PartCounts, common_sizes, config_value, gqa_attention_weights, published_counts
from strata.families.family import FamilyParts
from strata.layer_kinds import ExpertKind, Mixer, LayerType, RopeScaling, RoutingOrder, Ffn, MOE_LAYER

if TYPE_CHECKING:  # annotations only: model_config runs the check
    from strata.model_config import ModelConfig


@dataclass(frozen=True)
class GptOssConfig:
    """gpt-oss's own fields (`ModelConfig.gpt_oss`), at their "not gpt-oss" defaults."""

    # z = W h + b: a plain logit bias that selection and weights both see (not the sigmoid rules'
    # selection-only bias, which chooses and never weights)
    router_logit_bias: bool = False
    expert_kind: ExpertKind = ExpertKind.SWIGLU
    expert_bias: bool = False  # each expert's gate/up/down carry a bias (in its .experts record)
    swiglu_alpha: float = 1.702  # CLAMPED_SWIGLU: the sigmoid's gain
    swiglu_limit: float = 7.0  # CLAMPED_SWIGLU: the clamp on gate (above) and up (both sides)
    attention_sinks: bool = False  # one learned logit per head joins every softmax (then dropped)
    attention_output_bias: bool = False  # o_proj carries a bias
    sliding_window: int = 0  # SLIDING_ATTENTION layers see keys j with i - sliding_window < j <= i


@dataclass(frozen=True)
class YarnConfig:
    """YaRN rotary scaling (`ModelConfig.yarn`; strata/reference/rope_scaling.py), gpt-oss's and
    DeepSeek-V3 / Kimi-K2's. Off (RopeScaling.NONE) for every other family."""

    rope_scaling: RopeScaling = RopeScaling.NONE
    yarn_factor: float = 1.0
    yarn_original_context: int = 0  # the pretraining context the correction range is computed for
    yarn_beta_fast: float = 32.0
    yarn_beta_slow: float = 1.0
    yarn_truncate: bool = True  # floor/ceil the correction range (gpt-oss: false)
    yarn_attention_factor: float = 1.0  # cos and sin are multiplied by it
    # DeepSeek-V3 / Kimi-K2: the latent attention's softmax scale is multiplied by
    # (0.1 mscale_all_dim ln(yarn_factor) + 1)^2 (reference/mla.py softmax_scale); 0: not scaled
    yarn_mscale_all_dim: float = 0.0


def _positive(part: object, name: str) -> None:
    value = getattr(part, name)
    if isinstance(value, bool) or not math.isfinite(value) or value <= 0:
        raise ConfigError(f"model config: {name} must be a finite number > 0, got {value!r}")


def check_gpt_oss_fields(cfg: "ModelConfig") -> None:
    """The gpt-oss fields: a window for sliding layers, a usable clamped SwiGLU, YaRN's numbers."""
    g, yarn = cfg.gpt_oss, cfg.yarn
    if any(t.mixer is Mixer.SLIDING_ATTENTION for t in cfg.kinds) and g.sliding_window <= 0:
        raise ConfigError(f"model config: sliding-attention layers need sliding_window > 0, got {g.sliding_window}")
    if g.expert_kind is ExpertKind.CLAMPED_SWIGLU:
        _positive(g, "swiglu_alpha")
        _positive(g, "swiglu_limit")
    if yarn.rope_scaling is RopeScaling.YARN:
        for name in ("yarn_factor", "yarn_original_context", "yarn_beta_fast", "yarn_beta_slow",
                     "yarn_attention_factor"):
            _positive(yarn, name)


def count_published(c: dict, t: str) -> PartCounts:
    """Its weights by part from a published config.json (strata doctor, where strata refuses it):
    attention with biases and sinks, a router with a bias, experts with biases."""
    hidden, vocab, L, tie = common_sizes(c)
    heads, kv_heads = int(config_value(c, "num_attention_heads")), int(config_value(c, "num_key_value_heads"))
    head_dim = int(c.get("head_dim") or hidden // heads)
    ffn, n_exp = int(config_value(c, "intermediate_size")), int(config_value(c, "num_local_experts", "num_experts"))
    attn = gqa_attention_weights(hidden, heads, kv_heads, head_dim,
                                 bias=bool(c.get("attention_bias", True))) + heads  # + the sinks
    expert = 3 * hidden * ffn + 2 * ffn + hidden  # gate_up [2F, D] + bias [2F], down [D, F] + bias [D]
    dense = {"attention": L * attn, "router": L * (n_exp * hidden + n_exp), "norms": L * 2 * hidden + hidden}
    return published_counts("gpt-oss", t,
                            "MXFP4 experts, router bias, clamped SwiGLU, attention sinks and sliding windows",
                            hidden=hidden, vocab=vocab, n_layers=L, moe_layers=L, n_experts=n_exp,
                            top_k=int(config_value(c, "num_experts_per_tok", "experts_per_token")), expert_ffn=ffn,
                            expert_weights=expert, dense=dense, kv=2 * L * kv_heads * head_dim, tie=tie)


MADE_SHAPES = {
    # sliding / full attention alternating, sinks, biases everywhere, the clamped SwiGLU (limit 1,
    # not gpt-oss's 7, so that the clamp is active on these small activations), YaRN
    "gpt-oss": dict(hidden_size=64, n_layers=4, n_heads=4, n_kv_heads=2, head_dim=16, n_experts=16,
                    n_experts_per_token=4, expert_ffn_size=32, routing_order=RoutingOrder.TOPK_SOFTMAX,
                    attention_bias=True, max_context=256,
                    layer_types=(LayerType(Mixer.SLIDING_ATTENTION, Ffn.MOE), MOE_LAYER) * 2,
                    gpt_oss=GptOssConfig(sliding_window=8, router_logit_bias=True,
                                         expert_kind=ExpertKind.CLAMPED_SWIGLU, expert_bias=True, swiglu_limit=1.0,
                                         attention_sinks=True, attention_output_bias=True),
                    yarn=YarnConfig(rope_scaling=RopeScaling.YARN, yarn_factor=8.0, yarn_original_context=32,
                                    yarn_truncate=False, yarn_attention_factor=1.2079441541679836)),
}

FAMILY = FamilyParts(
    name="gpt-oss", model_types=("gpt_oss",), converter="strata.convert.gpt_oss", check=check_gpt_oss_fields,
    made_shapes=MADE_SHAPES, count_published=count_published, published_types=("gpt_oss",),
)
