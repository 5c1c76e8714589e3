"""Qwen3-MoE and Qwen2-MoE (Qwen1.5-MoE, Qwen2-57B-A14B).

Both: softmax over all experts, top-k, renormalized when `norm_topk_prob` (transformers'
default for both configs is false; Qwen3 checkpoints set it true). Qwen3-MoE adds a per-head
q/k RMSNorm (one [head_dim] weight) and an explicit `head_dim`; Qwen2-MoE has q/k/v biases
(`qkv_bias`, implied by older configs) and a shared expert gated by sigmoid(w · x).
A layer with a dense MLP instead of experts (`mlp_only_layers`, `decoder_sparse_step` > 1)
is refused: every strata layer is an MoE layer.
"""

from __future__ import annotations

from strata.convert.common import Family, base_fields
from strata.convert.hf_config import HFConfig
from strata.convert.safetensors_reader import Checkpoint
from strata.errors import ConfigError
from strata.model_config import ModelConfig, QKNorm, RoutingOrder

DEFAULT_ROPE_THETA = 10000.0  # Qwen2MoeConfig / Qwen3MoeConfig default
DEFAULT_NORM_TOPK_PROB = False  # transformers' default for both configs


def _check_all_layers_sparse(hf: HFConfig) -> None:
    dense_layers = hf.get("mlp_only_layers", default=[])
    step = hf.get_int("decoder_sparse_step", default=1)
    if dense_layers or step != 1:
        raise hf.unsupported(f"dense MLP layers (mlp_only_layers={dense_layers}, decoder_sparse_step={step})",
                             "every layer an MoE layer: mlp_only_layers [] and decoder_sparse_step 1")


def _sliding_window(hf: HFConfig) -> int | None:
    """The window if any layer uses sliding-window attention, else None."""
    layer_types = hf.get("layer_types", default=[])
    sliding = hf.get_bool("use_sliding_window", default=False) or "sliding_attention" in layer_types
    return hf.get("sliding_window", default=None) if sliding else None


def _qwen_fields(hf: HFConfig, ckpt: Checkpoint) -> dict:
    _check_all_layers_sparse(hf)
    fields = base_fields(hf, ckpt)
    fields.update(
        expert_ffn_size=hf.get_int("moe_intermediate_size"),
        routing_order=RoutingOrder.SOFTMAX_TOPK,
        norm_topk_prob=hf.get_bool("norm_topk_prob", default=DEFAULT_NORM_TOPK_PROB),
        rope_theta=hf.rope_theta(DEFAULT_ROPE_THETA),
        max_context=hf.max_context(_sliding_window(hf)),
    )
    return fields


def qwen3_moe_config(hf: HFConfig, ckpt: Checkpoint) -> ModelConfig:
    fields = _qwen_fields(hf, ckpt)
    shared = hf.get_int("shared_expert_intermediate_size", default=0)
    if shared:
        raise hf.unsupported(f"shared_expert_intermediate_size = {shared}", "no shared expert (Qwen3-MoE)")
    return ModelConfig(**fields, qk_norm=QKNorm.PER_HEAD)


def qwen2_moe_config(hf: HFConfig, ckpt: Checkpoint) -> ModelConfig:
    fields = _qwen_fields(hf, ckpt)
    shared = hf.get_int("shared_expert_intermediate_size")
    if shared <= 0:
        raise ConfigError(f"{hf.path}: shared_expert_intermediate_size must be positive for Qwen2-MoE, got {shared}")
    return ModelConfig(**fields, shared_ffn_size=shared, shared_expert_gated=True, qk_norm=QKNorm.NONE)


QWEN3_MOE = Family(
    name="Qwen3-MoE", model_types=("qwen3_moe",), model_config=qwen3_moe_config,
    supported_features="per-head q/k norm, optional q/k/v bias, routed SwiGLU experts, no o_proj bias",
)
QWEN2_MOE = Family(
    name="Qwen2-MoE", model_types=("qwen2_moe",), model_config=qwen2_moe_config,
    supported_features="q/k/v bias, routed SwiGLU experts, a shared expert with a sigmoid gate, no o_proj bias",
)
