"""Mixtral (mistralai/Mixtral-8x7B, 8x22B): top-k router logits, then softmax over those k.

Experts are `block_sparse_moe.experts.{e}.w1/w3/w2` (gate, up, down) on the Hub;
transformers 5 renames the block to `mlp` in memory, and both are read. The sliding window
(null in the released configs) is honoured by capping the context at the window.
"""

from __future__ import annotations

from strata.convert.common import Family, base_fields
from strata.convert.hf_config import HFConfig
from strata.convert.safetensors_reader import Checkpoint
from strata.model_config import ModelConfig, RoutingOrder

DEFAULT_ROPE_THETA = 1e6  # MixtralConfig default


def mixtral_config(hf: HFConfig, ckpt: Checkpoint) -> ModelConfig:
    return ModelConfig(
        **base_fields(hf, ckpt),
        expert_ffn_size=hf.get_int("intermediate_size"),
        routing_order=RoutingOrder.TOPK_SOFTMAX,
        # top-k then softmax already sums to one; the flag is recorded for completeness
        norm_topk_prob=True,
        rope_theta=hf.rope_theta(DEFAULT_ROPE_THETA),
        max_context=hf.max_context(hf.get("sliding_window", default=None)),
    )


MIXTRAL = Family(
    name="Mixtral", model_types=("mixtral",), model_config=mixtral_config,
    moe_blocks=("block_sparse_moe", "mlp"), expert_projections=("w1", "w3", "w2"),
    supported_features="routed SwiGLU experts (w1/w3/w2), no attention bias",
)
