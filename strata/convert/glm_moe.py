"""GLM-4.5 / 4.6 / 4.7 (`glm4_moe`): grouped-query attention with partial rotary
(`partial_rotary_factor`, 0.5 in the released configs: RoPE on the first half of each head),
optional per-head q/k RMSNorm (`use_qk_norm`), q/k/v biases (`attention_bias`; o_proj has none),
sigmoid routing with a selection bias in expert groups, `routed_scaling_factor`, shared experts
and dense first layers (`first_k_dense_replace`). The multi-token-prediction ("nextn") layer is
kept as DeepSeek-V3's is (convert/sigmoid_common.py nextn_sources; its decoder layer an attention
+ MoE layer like the model's).
"""

from __future__ import annotations

from strata.convert.common import Family
from strata.convert.deepseek import LAYER_SOURCES
from strata.convert.hf_config import HFConfig
from strata.convert.safetensors_reader import Checkpoint
from strata.convert.sigmoid_common import (layer_kinds, nextn_layers, rope_fields, routing_fields,
                                           sigmoid_base_fields, sigmoid_tensor_plan)
from strata.model_config import Mixer, ModelConfig, QKNorm

DEFAULT_ROPE_THETA = 10000.0  # Glm4MoeConfig's default


def glm4_moe_config(hf: HFConfig, ckpt: Checkpoint) -> ModelConfig:
    fields = sigmoid_base_fields(hf, ckpt)
    moe_ffn = hf.get_int("moe_intermediate_size")
    fields.update(routing_fields(hf))
    fields.update(rope_fields(hf, fields["head_dim"], DEFAULT_ROPE_THETA))
    fields.update(
        expert_ffn_size=moe_ffn, shared_ffn_size=hf.get_int("n_shared_experts", default=0) * moe_ffn,
        layer_types=layer_kinds(hf, Mixer.ATTENTION), dense_ffn_size=hf.get_int("intermediate_size"),
        qk_norm=QKNorm.PER_HEAD if hf.get_bool("use_qk_norm", default=False) else QKNorm.NONE,
        max_context=hf.max_context(None), nextn_layers=nextn_layers(hf, ckpt, fields["n_layers"]),
    )
    return ModelConfig.from_dict(fields)


GLM4_MOE = Family(
    name="GLM-4.5", model_types=("glm4_moe",), model_config=glm4_moe_config,
    tensor_plan=sigmoid_tensor_plan(LAYER_SOURCES),
    supported_features="partial rotary, per-head q/k norm, q/k/v bias, sigmoid routing with e_score_correction_bias "
                       "and expert groups, routed_scaling_factor, shared experts, dense first layers",
)
