"""DeepSeek-V3 / Kimi-K2 (`deepseek_v3`) and GLM-4.7-Flash (`glm4_moe_lite`): latent attention
(Mixer.MLA, reference/mla.py), sigmoid routing with a selection bias in expert groups, shared
experts (`n_shared_experts` of width `moe_intermediate_size` each: one SwiGLU of their summed
width), dense first layers (`first_k_dense_replace`, or `mlp_layer_types`).

RoPE: these checkpoints lay the rope dims of q and of the shared rope key out interleaved
(`rope_interleave`, true by default): pairs (x0, x1), (x2, x3), ... The converter permutes those
rows of q_b_proj (or q_proj) and kv_a_proj_with_mqa to [evens, odds], where the interleaved
rotation is exactly the "rotate half" one strata computes; q and k move alike, so every score
is the checkpoint's.

YaRN (DeepSeek-V3's and Kimi-K2's released configs: `rope_scaling` type yarn with factor, mscale,
mscale_all_dim, original_max_position_embeddings) is read as gpt-oss's is (reference/rope_scaling.py
over the qk_rope_head_dim rope dims, cos and sin times the attention factor
mscale(factor, mscale) / mscale(factor, mscale_all_dim)), and the softmax scale is multiplied by
mscale(factor, mscale_all_dim)^2 (`yarn_mscale_all_dim`). Refused: other rope scaling types,
partial rotary factors, an attention bias, other scoring functions.

The multi-token-prediction ("nextn") layer (`num_nextn_predict_layers`: model.layers.{n}.* with
enorm, hnorm, eh_proj, shared_head.{norm, head} and one MLA + MoE decoder layer) is kept where the
checkpoint has one (`nextn_layers` = 1; convert/sigmoid_common.py nextn_sources, its rope rows
de-interleaved as the model's): the MTP drafter (strata/speculative/mtp.py, over
strata/reference/nextn.py) runs it. Its copy of the embedding is skipped (the model's own is read); more than one such layer is refused.
"""

from __future__ import annotations

import numpy as np

from strata.convert.common import Family
from strata.convert.gpt_oss import yarn_rope_fields
from strata.convert.hf_config import HFConfig
from strata.convert.safetensors_reader import Checkpoint
from strata.convert.sigmoid_common import (layer_kinds, nextn_layers, routing_fields, sigmoid_base_fields,
                                           sigmoid_tensor_plan)
from strata.families.deepseek import NEXTN_PREFIX
from strata.model_config import Mixer, ModelConfig, RopeScaling, TensorNames

DEFAULT_ROPE_THETA = 10000.0  # DeepseekV3Config's default

# strata per-layer suffix -> checkpoint suffix (MLA, the shared experts, dense FFN layers, the bias)
LAYER_SOURCES = (
    (TensorNames.attn_q_a, "self_attn.q_a_proj.weight"), (TensorNames.attn_q_a_norm, "self_attn.q_a_layernorm.weight"),
    (TensorNames.attn_q_b, "self_attn.q_b_proj.weight"),
    (TensorNames.attn_kv_a_mqa, "self_attn.kv_a_proj_with_mqa.weight"),
    (TensorNames.attn_kv_a_norm, "self_attn.kv_a_layernorm.weight"), (TensorNames.attn_kv_b, "self_attn.kv_b_proj.weight"),
    (TensorNames.exp_probs_b, "{moe}.gate.e_score_correction_bias"),
    (TensorNames.shexp_gate, "{moe}.shared_experts.gate_proj.weight"),
    (TensorNames.shexp_up, "{moe}.shared_experts.up_proj.weight"),
    (TensorNames.shexp_down, "{moe}.shared_experts.down_proj.weight"),
    (TensorNames.ffn_gate, "mlp.gate_proj.weight"), (TensorNames.ffn_up, "mlp.up_proj.weight"),
    (TensorNames.ffn_down, "mlp.down_proj.weight"),
)


def deepseek_config(hf: HFConfig, ckpt: Checkpoint) -> ModelConfig:
    fields = sigmoid_base_fields(hf, ckpt)
    nope, rope = hf.get_int("qk_nope_head_dim"), hf.get_int("qk_rope_head_dim")
    moe_ffn = hf.get_int("moe_intermediate_size")
    fields.update(routing_fields(hf))
    fields.update(
        head_dim=nope + rope, n_kv_heads=fields["n_heads"], expert_ffn_size=moe_ffn,
        shared_ffn_size=hf.get_int("n_shared_experts", default=0) * moe_ffn,
        layer_types=layer_kinds(hf, Mixer.MLA), dense_ffn_size=hf.get_int("intermediate_size"),
        max_context=hf.max_context(None), **deepseek_rope(hf),
        q_lora_rank=hf.get_int("q_lora_rank", default=0), kv_lora_rank=hf.get_int("kv_lora_rank"),
        qk_rope_head_dim=rope, qk_nope_head_dim=nope, v_head_dim=hf.get_int("v_head_dim"),
        nextn_layers=nextn_layers(hf, ckpt, fields["n_layers"]),
    )
    if not hf.get_bool("rope_interleave", default=True):
        raise hf.unsupported("rope_interleave = false", "the released (interleaved) rope layout")
    return ModelConfig.from_dict(fields)


def deepseek_rope(hf: HFConfig) -> dict:
    """rope_theta, and YaRN's fields (gpt-oss's reading of the same keys) with DeepSeek's softmax
    mscale: `mscale_all_dim` (transformers' yarn_apply_mscale multiplies the attention's scale by
    (0.1 mscale_all_dim ln factor + 1)^2; reference/mla.py softmax_scale)."""
    fields = yarn_rope_fields(hf, hf.get_int("max_position_embeddings"), DEFAULT_ROPE_THETA)
    if fields.get("rope_scaling") is RopeScaling.YARN:
        d = hf.raw.get("rope_parameters") or hf.raw.get("rope_scaling")
        fields["yarn_mscale_all_dim"] = float(d.get("mscale_all_dim") or 0.0)
    return fields


def deinterleave(rows: np.ndarray) -> np.ndarray:
    """Rows (x0, x1, x2, x3, ...) -> (x0, x2, ..., x1, x3, ...). Shapes: [.., r, in] along axis -2"""
    r = rows.shape[-2]
    return rows[..., np.r_[0:r:2, 1:r:2], :]


def rope_rows(cfg: ModelConfig, name: str):
    """The de-interleave of the rope rows of an MLA layer's query projection (per head) or of
    its shared rope key, as a function of the checkpoint tensor; None for any other tensor."""
    n = TensorNames
    name = name.removeprefix(NEXTN_PREFIX)  # the nextn layer's decoder layer: an MLA layer 0's names
    if not name.startswith("blk.") or cfg.kinds[int(name.split(".")[1])].mixer is not Mixer.MLA:
        return None
    suffix = name.split(".", 2)[-1]
    nope, rope = cfg.mla.qk_nope_head_dim, cfg.mla.qk_rope_head_dim
    if suffix in (n.attn_q_b, n.attn_q):
        def query(x: np.ndarray) -> np.ndarray:
            heads = x.reshape(cfg.n_heads, nope + rope, x.shape[-1]).copy()  # [H, n + r, in]
            heads[:, nope:] = deinterleave(heads[:, nope:])
            return heads.reshape(x.shape)
        return query
    if suffix == n.attn_kv_a_mqa:
        def shared_key(x: np.ndarray) -> np.ndarray:
            out = x.copy()  # [c + r, D]
            out[cfg.mla.kv_lora_rank:] = deinterleave(x[cfg.mla.kv_lora_rank:])
            return out
        return shared_key
    return None


_FEATURES = ("latent attention (q_lora_rank, kv_lora_rank, rope/nope split, v_head_dim), sigmoid routing with "
             "e_score_correction_bias and expert groups, routed_scaling_factor, shared experts, dense first layers")

_TENSORS = sigmoid_tensor_plan(LAYER_SOURCES, rewrite=rope_rows, what="rope rows de-interleaved")

DEEPSEEK_V3 = Family(
    name="DeepSeek-V3", model_types=("deepseek_v3", "kimi_k2"), model_config=deepseek_config,
    supported_features=_FEATURES, tensor_plan=_TENSORS,
)
GLM4_MOE_LITE = Family(
    name="GLM-4.7-Flash", model_types=("glm4_moe_lite",), model_config=deepseek_config,
    supported_features=_FEATURES, tensor_plan=_TENSORS,
)
