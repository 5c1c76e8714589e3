"""gpt-oss (openai/gpt-oss-20b, -120b): `model_type` gpt_oss.

What strata maps (transformers 5.24's modeling_gpt_oss.py is the ground truth):
- the router's logit bias (`mlp.router.bias`: z = W h + b), top-k logits then softmax over those
  k (`RoutingOrder.TOPK_SOFTMAX`);
- the experts' clamped SwiGLU (`swiglu_alpha`, `swiglu_limit`, `ExpertKind.CLAMPED_SWIGLU`) and
  their gate/up/down biases (kept in the `.experts` records); the experts themselves are read by
  `convert.gpt_oss_experts` in the float or the MXFP4 form, MXFP4 kept bit for bit;
- attention: q/k/v/o biases (`attention_bias`), per-head sinks (`self_attn.sinks`), sliding-window
  layers (`layer_types`, `sliding_window`) run with a windowed mask (not by capping the context);
- YaRN rotary scaling (`rope_parameters` v5 or `rope_scaling` + `rope_theta` v4), computed as
  transformers does, its attention factor stored.
Every config key is listed below (`_READ`, `_IGNORE`); any other is refused in one line.
"""

from __future__ import annotations

import math

from strata.convert.common import Family
from strata.convert.gguf_checkpoint import GgufCheckpoint, GgufExpertTensors
from strata.convert.gpt_oss_experts import GptOssExpertTensors
from strata.convert.hf_config import HFConfig
from strata.convert.mlx_checkpoint import MlxCheckpoint
from strata.convert.safetensors_reader import Checkpoint
from strata.convert.tensor_plan import TensorPlan
from strata.errors import ConfigError
from strata.model_config import (ExpertKind, Ffn, LayerType, Mixer, ModelConfig, QKNorm, RopeScaling, RoutingOrder,
                                 TensorNames)

DEFAULT_ROPE_THETA = 150000.0  # GptOssConfig.default_theta
DEFAULT_ALPHA, DEFAULT_LIMIT = 1.702, 7.0  # GptOssConfig defaults (older configs omit swiglu_alpha)
DEFAULT_BETA_FAST, DEFAULT_BETA_SLOW = 32.0, 1.0  # transformers' YaRN defaults
QUANT_METHOD = "mxfp4"

_READ = {"vocab_size", "hidden_size", "num_hidden_layers", "num_attention_heads", "num_key_value_heads", "head_dim",
         "num_local_experts", "num_experts", "num_experts_per_tok", "intermediate_size", "rms_norm_eps",
         "tie_word_embeddings", "max_position_embeddings", "layer_types", "sliding_window", "rope_parameters",
         "rope_scaling", "rope_theta", "swiglu_alpha", "swiglu_limit", "attention_bias", "quantization_config",
         "model_type"}
_IGNORE = {"attention_dropout", "initializer_range", "output_router_logits", "router_aux_loss_coef", "use_cache",
           "bos_token_id", "eos_token_id", "pad_token_id", "dtype", "torch_dtype", "transformers_version",
           "architectures", "_name_or_path",
           "hidden_act",  # transformers' gpt-oss experts ignore it: the clamped SwiGLU is fixed
           "experts_per_token", "initial_context_length"}  # the released configs' duplicates of read keys
_YARN_KEYS = {"rope_type", "type", "rope_theta", "factor", "original_max_position_embeddings", "beta_fast",
              "beta_slow", "truncate", "attention_factor", "mscale", "mscale_all_dim", "partial_rotary_factor"}
_LAYER_KINDS = {"sliding_attention": Mixer.SLIDING_ATTENTION, "full_attention": Mixer.ATTENTION}


def _mxfp4(hf: HFConfig) -> bool:
    """Whether the experts are stored as MXFP4 blocks (quantization_config), else float."""
    q = hf.raw.get("quantization_config")
    if q is None:
        return False
    method = q.get("quant_method") if isinstance(q, dict) else q
    if method != QUANT_METHOD:
        raise hf.unsupported(f"quantization_config.quant_method = {method!r}", f"{QUANT_METHOD!r} experts or none")
    return True


def _layer_types(hf: HFConfig, n_layers: int) -> tuple[LayerType, ...]:
    names = hf.get("layer_types", default=None)
    if names is None:  # transformers' default: sliding first, then alternating
        names = ["sliding_attention" if (i + 1) % 2 else "full_attention" for i in range(n_layers)]
    if not isinstance(names, list) or len(names) != n_layers:
        raise ConfigError(f"{hf.path}: layer_types must list {n_layers} layer types, got {names!r}")
    bad = [t for t in names if t not in _LAYER_KINDS]
    if bad:
        raise hf.unsupported(f"layer type {bad[0]!r}", f"{sorted(_LAYER_KINDS)}")
    return tuple(LayerType(_LAYER_KINDS[t], Ffn.MOE) for t in names)


def _yarn_attention_factor(d: dict, factor: float) -> float:
    """transformers' `attention_factor`: given, or from mscale / mscale_all_dim, or 0.1 ln(factor) + 1."""
    if d.get("attention_factor") is not None:
        return float(d["attention_factor"])

    def get_mscale(scale: float, mscale: float = 1.0) -> float:
        return 1.0 if scale <= 1 else 0.1 * mscale * math.log(scale) + 1.0

    mscale, mscale_all_dim = d.get("mscale"), d.get("mscale_all_dim")
    if mscale and mscale_all_dim:
        return get_mscale(factor, mscale) / get_mscale(factor, mscale_all_dim)
    return get_mscale(factor)


def _rope(hf: HFConfig, max_positions: int, default_theta: float = DEFAULT_ROPE_THETA) -> dict:
    """The rope fields: rope_theta, and YaRN's when `rope_type` is yarn (else plain RoPE).
    DeepSeek-V3's converter reads the same keys (`yarn_rope_fields`, with its own default theta)."""
    d = hf.raw.get("rope_parameters") or hf.raw.get("rope_scaling")
    if d is None:
        return dict(rope_theta=hf.get_float("rope_theta", default=default_theta))
    if not isinstance(d, dict):
        raise ConfigError(f"{hf.path}: rope_parameters must be an object, got {d!r}")
    extra = sorted(set(d) - _YARN_KEYS)
    if extra:
        raise hf.unsupported(f"rope_parameters key {extra[0]!r}", f"{sorted(_YARN_KEYS)}")
    if d.get("partial_rotary_factor", 1.0) != 1.0:
        raise hf.unsupported(f"partial_rotary_factor = {d['partial_rotary_factor']}", "rotary over the whole head")
    theta = float(d.get("rope_theta") or hf.get_float("rope_theta", default=default_theta))
    kind = d.get("rope_type", d.get("type", "default"))
    if kind == "default":
        return dict(rope_theta=theta)
    if kind != "yarn":
        raise hf.unsupported(f"rope_type = {kind!r}", "'yarn' or 'default'")
    original = d.get("original_max_position_embeddings")
    if isinstance(original, bool) or not isinstance(original, int) or original <= 0:
        raise ConfigError(f"{hf.path}: yarn needs a positive original_max_position_embeddings, got {original!r}")
    factor = float(d["factor"]) if d.get("factor") is not None else max_positions / original
    return dict(rope_theta=theta, rope_scaling=RopeScaling.YARN, yarn_factor=factor, yarn_original_context=original,
                yarn_beta_fast=float(d.get("beta_fast") or DEFAULT_BETA_FAST),
                yarn_beta_slow=float(d.get("beta_slow") or DEFAULT_BETA_SLOW),
                yarn_truncate=bool(d.get("truncate", True)), yarn_attention_factor=_yarn_attention_factor(d, factor))


yarn_rope_fields = _rope


def gpt_oss_config(hf: HFConfig, ckpt: Checkpoint) -> ModelConfig:
    unknown = sorted(set(hf.raw) - _READ - _IGNORE)
    if unknown:
        raise hf.unsupported(f"config key {unknown[0]!r}", "the keys docs/models.md lists for gpt-oss")
    _mxfp4(hf)
    n_layers, n_heads = hf.get_int("num_hidden_layers"), hf.get_int("num_attention_heads")
    types = _layer_types(hf, n_layers)
    window = hf.get("sliding_window", default=0) if any(t.mixer is Mixer.SLIDING_ATTENTION for t in types) else 0
    if isinstance(window, bool) or not isinstance(window, int) or (window <= 0 and any(
            t.mixer is Mixer.SLIDING_ATTENTION for t in types)):
        raise ConfigError(f"{hf.path}: sliding_window must be a positive integer for sliding layers, got {window!r}")
    bias = hf.get_bool("attention_bias", default=True)
    max_positions = hf.get_int("max_position_embeddings")
    return ModelConfig.from_dict(dict(
        architecture=hf.model_type, vocab_size=hf.get_int("vocab_size"), hidden_size=hf.get_int("hidden_size"),
        n_layers=n_layers, n_heads=n_heads, n_kv_heads=hf.get_int("num_key_value_heads", default=n_heads),
        head_dim=hf.head_dim(), n_experts=hf.get_int("num_local_experts", "num_experts"),
        n_experts_per_token=hf.get_int("num_experts_per_tok"), expert_ffn_size=hf.get_int("intermediate_size"),
        routing_order=RoutingOrder.TOPK_SOFTMAX, norm_topk_prob=True, qk_norm=QKNorm.NONE, attention_bias=bias,
        rms_norm_eps=hf.get_float("rms_norm_eps"), max_context=max_positions,
        tie_embeddings=hf.get_bool("tie_word_embeddings", default=False), layer_types=types, sliding_window=window,
        router_logit_bias=True, expert_kind=ExpertKind.CLAMPED_SWIGLU, expert_bias=True,
        swiglu_alpha=hf.get_float("swiglu_alpha", default=DEFAULT_ALPHA),
        swiglu_limit=hf.get_float("swiglu_limit", default=DEFAULT_LIMIT),
        attention_sinks=True, attention_output_bias=bias, **_rope(hf, max_positions),
    ))


def tensor_plan(cfg: ModelConfig, ckpt: Checkpoint) -> TensorPlan:
    if isinstance(ckpt, MlxCheckpoint):  # mlx-lm renames and re-stacks the experts (switch_mlp with biases)
        raise ConfigError(f"{ckpt.directory}: an MLX-quantized gpt-oss checkpoint is not supported; convert the "
                          "Hugging Face checkpoint instead (its MXFP4 experts are kept bit for bit)")
    n = TensorNames
    sources: dict[str, str] = {n.token_embd: "model.embed_tokens.weight", n.output_norm: "model.norm.weight"}
    if not cfg.tie_embeddings:
        sources[n.output] = "lm_head.weight"
    per_layer = {n.attn_norm: "input_layernorm.weight", n.ffn_norm: "post_attention_layernorm.weight",
                 n.attn_q: "self_attn.q_proj.weight", n.attn_k: "self_attn.k_proj.weight",
                 n.attn_v: "self_attn.v_proj.weight", n.attn_output: "self_attn.o_proj.weight",
                 n.attn_sinks: "self_attn.sinks", n.router: "mlp.router.weight", n.router_logit_bias: "mlp.router.bias"}
    if cfg.attention_bias:
        per_layer.update({n.attn_q_bias: "self_attn.q_proj.bias", n.attn_k_bias: "self_attn.k_proj.bias",
                          n.attn_v_bias: "self_attn.v_proj.bias", n.attn_output_bias: "self_attn.o_proj.bias"})
    for layer in range(cfg.n_layers):
        sources.update({n.block(layer, k): f"model.layers.{layer}.{v}" for k, v in per_layer.items()})
    if isinstance(ckpt, GgufCheckpoint):  # llama.cpp's stacked *_exps and their biases, kept as stored
        return TensorPlan(GgufExpertTensors(ckpt, cfg), sources)
    mxfp4 = "model.layers.0.mlp.experts.gate_up_proj_blocks" in ckpt
    return TensorPlan(GptOssExpertTensors(ckpt, cfg, mxfp4), sources)


GPT_OSS = Family(
    name="gpt-oss", model_types=("gpt_oss",), model_config=gpt_oss_config, tensor_plan=tensor_plan,
    supported_features="router bias, clamped SwiGLU experts with biases (float or MXFP4 blocks), attention sinks, "
                       "q/k/v/o biases, sliding / full attention layers, YaRN",
)
