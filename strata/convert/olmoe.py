"""OLMoE (allenai/OLMoE-1B-7B): RMSNorm over the whole q and k projections (all heads at once,
weights [n_heads * head_dim] and [n_kv_heads * head_dim]) before RoPE; softmax, top-k, no
renormalization by default. `clip_qkv` (clamping q/k/v) is refused: the reference does not clamp.
"""

from __future__ import annotations

from strata.convert.common import Family, base_fields
from strata.convert.hf_config import HFConfig
from strata.convert.safetensors_reader import Checkpoint
from strata.model_config import ModelConfig, QKNorm, RoutingOrder

DEFAULT_ROPE_THETA = 10000.0  # OlmoeConfig default
DEFAULT_NORM_TOPK_PROB = False  # OlmoeConfig default


def olmoe_config(hf: HFConfig, ckpt: Checkpoint) -> ModelConfig:
    clip = hf.get("clip_qkv", default=None)
    if clip is not None:
        raise hf.unsupported(f"clip_qkv = {clip}", "clip_qkv null")
    return ModelConfig(
        **base_fields(hf, ckpt),
        expert_ffn_size=hf.get_int("intermediate_size"),
        routing_order=RoutingOrder.SOFTMAX_TOPK,
        norm_topk_prob=hf.get_bool("norm_topk_prob", default=DEFAULT_NORM_TOPK_PROB),
        qk_norm=QKNorm.FULL,
        rope_theta=hf.rope_theta(DEFAULT_ROPE_THETA),
        max_context=hf.max_context(None),
    )


OLMOE = Family(
    name="OLMoE", model_types=("olmoe",), model_config=olmoe_config,
    supported_features="q/k RMSNorm over all heads, routed SwiGLU experts, no attention bias",
)
