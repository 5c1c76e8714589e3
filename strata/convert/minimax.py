"""MiniMax-M2 (`minimax_m2`): grouped-query attention with partial rotary (`rotary_dim`, or
`partial_rotary_factor`), q/k RMSNorm over the whole projection (QKNorm.FULL: one weight of
[n_heads * head_dim] and one of [n_kv_heads * head_dim]), sigmoid routing with a selection bias
and no groups, weights always renormalized and unscaled, no shared expert. The MoE block is
`block_sparse_moe` with Mixtral's expert names (w1 gate, w3 up, w2 down); its bias sits on the
block, not on the router.
"""

from __future__ import annotations

from strata.convert.common import Family
from strata.convert.hf_config import HFConfig
from strata.convert.safetensors_reader import Checkpoint
from strata.convert.sigmoid_common import rope_fields, routing_fields, sigmoid_base_fields, sigmoid_tensor_plan
from strata.model_config import ModelConfig, QKNorm, TensorNames

DEFAULT_ROPE_THETA = 5_000_000.0  # MiniMaxM2Config's default


def minimax_m2_config(hf: HFConfig, ckpt: Checkpoint) -> ModelConfig:
    fields = sigmoid_base_fields(hf, ckpt)
    for key in ("n_shared_experts", "shared_intermediate_size"):
        if hf.get_int(key, default=0):
            raise hf.unsupported(f"{key} = {hf.get(key)}", "no shared expert (MiniMax-M2)")
    # the router divides by the sum unconditionally and never scales (MiniMaxM2TopKRouter)
    fields.update(routing_fields(hf, groups=False, scaling=False))
    fields["norm_topk_prob"] = True
    fields.update(rope_fields(hf, fields["head_dim"], DEFAULT_ROPE_THETA))
    fields.update(expert_ffn_size=hf.get_int("intermediate_size"), qk_norm=QKNorm.FULL,
                  max_context=hf.max_context(None))
    return ModelConfig.from_dict(fields)


MINIMAX_M2 = Family(
    name="MiniMax-M2", model_types=("minimax_m2",), model_config=minimax_m2_config,
    tensor_plan=sigmoid_tensor_plan(((TensorNames.exp_probs_b, "{moe}.e_score_correction_bias"),),
                                    moe="block_sparse_moe", projections=("w1", "w3", "w2")),
    supported_features="partial rotary, full q/k norm, sigmoid routing with e_score_correction_bias (no groups)",
)
