"""Tiny random checkpoints made with mlx-lm's own model classes and quantized by its own
`quantize_model`, saved by its own `save_model` / `save_config` (the files mlx-community ships:
config.json + model.safetensors + index), with a byte-level tokenizer.json beside them.

FAMILIES: model_type -> the tiny config (fields of that family's ModelArgs). Every float
parameter is drawn at random (seeded) before quantization, so routers, norms and selection
biases are not the constructors' zeros and ones: routing differs per token and per layer. Each
family has more experts than its smallest legal arena at read-ahead depth 2, so a prompt layer's
union of experts can exceed the arena (the cache then runs it in several passes)."""

from __future__ import annotations

import importlib
from pathlib import Path

import numpy as np

BASE = dict(hidden_size=64, num_attention_heads=4, num_key_value_heads=2, head_dim=16, vocab_size=384,
            rms_norm_eps=1e-5, rope_theta=10000.0, max_position_embeddings=512, tie_word_embeddings=False)

FAMILIES: dict[str, dict] = {
    "qwen3_moe": dict(BASE, num_hidden_layers=3, intermediate_size=128, num_experts=32, num_experts_per_tok=4,
                      decoder_sparse_step=1, mlp_only_layers=[], moe_intermediate_size=32, norm_topk_prob=True),
    "mixtral": dict(BASE, num_hidden_layers=3, intermediate_size=32, num_local_experts=16, num_experts_per_tok=2),
    "deepseek_v3": dict(BASE, num_hidden_layers=3, intermediate_size=128, moe_intermediate_size=32,
                        n_routed_experts=16, n_shared_experts=1, num_experts_per_tok=4, n_group=4, topk_group=2,
                        routed_scaling_factor=2.5, kv_lora_rank=32, q_lora_rank=48, qk_rope_head_dim=16,
                        v_head_dim=16, qk_nope_head_dim=16, first_k_dense_replace=1, moe_layer_freq=1,
                        norm_topk_prob=True, num_key_value_heads=4),
    "glm4_moe": dict(BASE, num_hidden_layers=3, intermediate_size=128, moe_intermediate_size=32, n_routed_experts=16,
                     n_shared_experts=1, num_experts_per_tok=4, n_group=1, topk_group=1, routed_scaling_factor=1.5,
                     first_k_dense_replace=1, norm_topk_prob=True, use_qk_norm=True, attention_bias=True,
                     partial_rotary_factor=0.5, rope_scaling=None),
    "gpt_oss": dict(BASE, num_hidden_layers=2, num_local_experts=16, num_experts_per_tok=2, intermediate_size=64,
                    sliding_window=8, layer_types=["sliding_attention", "full_attention"]),
    "qwen3_next": dict(BASE, num_hidden_layers=4, intermediate_size=128, num_experts=32, num_experts_per_tok=4,
                       decoder_sparse_step=1, mlp_only_layers=[], moe_intermediate_size=32,
                       shared_expert_intermediate_size=32, linear_num_value_heads=4, linear_num_key_heads=2,
                       linear_key_head_dim=16, linear_value_head_dim=16, linear_conv_kernel_dim=4,
                       partial_rotary_factor=0.5, full_attention_interval=2, norm_topk_prob=True),
    "qwen3_5_moe": dict(text_config=dict(BASE, model_type="qwen3_5_moe_text", num_hidden_layers=4,
                                         intermediate_size=128, num_experts=32, num_experts_per_tok=4,
                                         moe_intermediate_size=32, shared_expert_intermediate_size=32,
                                         linear_num_value_heads=4, linear_num_key_heads=2, linear_key_head_dim=16,
                                         linear_value_head_dim=16, linear_conv_kernel_dim=4, full_attention_interval=2,
                                         rope_parameters={"type": "default", "mrope_section": [2, 1, 1],
                                                          "rope_theta": 10000.0, "partial_rotary_factor": 0.5})),
    "minimax": dict(BASE, num_hidden_layers=3, intermediate_size=32, num_local_experts=16, num_experts_per_tok=2,
                    shared_intermediate_size=0, rotary_dim=8),
    "ernie4_5_moe": dict(BASE, num_hidden_layers=3, intermediate_size=128, use_bias=False, moe_num_experts=16, moe_k=4,
                         moe_intermediate_size=32, moe_layer_start_index=1, moe_num_shared_experts=1,
                         moe_use_aux_free=True),
    "olmoe": dict(BASE, num_hidden_layers=3, intermediate_size=32, num_experts=32, num_experts_per_tok=4),
    "qwen2_moe": dict(BASE, num_hidden_layers=3, intermediate_size=32, num_experts=32, num_experts_per_tok=4,
                      moe_intermediate_size=32, shared_expert_intermediate_size=64),
    "step3p5": dict(BASE, num_hidden_layers=3, num_attention_groups=2, intermediate_size=128, moe_num_experts=16,
                    moe_top_k=4, moe_intermediate_size=32, share_expert_dim=32, moe_layers_enum="1,2",
                    sliding_window=8, layer_types=["full_attention", "sliding_attention", "full_attention"]),
    "deepseek_v32": dict(BASE, num_hidden_layers=3, intermediate_size=128, moe_intermediate_size=32,
                         n_routed_experts=16, n_shared_experts=1, num_experts_per_tok=4, n_group=4, topk_group=2,
                         routed_scaling_factor=2.5, kv_lora_rank=32, q_lora_rank=48, qk_rope_head_dim=16,
                         v_head_dim=16, qk_nope_head_dim=16, first_k_dense_replace=1, num_key_value_heads=4,
                         index_head_dim=32, index_n_heads=2, index_topk=8),
    "glm_moe_dsa": dict(BASE, num_hidden_layers=3, intermediate_size=128, moe_intermediate_size=32,
                        n_routed_experts=16, n_shared_experts=1, num_experts_per_tok=4, n_group=1, topk_group=1,
                        routed_scaling_factor=2.5, kv_lora_rank=32, q_lora_rank=48, qk_rope_head_dim=16,
                        v_head_dim=16, qk_nope_head_dim=16, first_k_dense_replace=1, num_key_value_heads=4,
                        index_head_dim=32, index_n_heads=2, index_topk=8, topk_method="noaux_tc",
                        scoring_func="sigmoid", norm_topk_prob=True, moe_layer_freq=1, attention_bias=False,
                        rope_parameters={"rope_theta": 10000.0, "rope_type": "default"}),
    "mistral4": dict(BASE, num_hidden_layers=3, intermediate_size=128, moe_intermediate_size=32, n_shared_experts=1,
                     n_routed_experts=16, routed_scaling_factor=1.0, kv_lora_rank=32, q_lora_rank=48,
                     norm_topk_prob=True, topk_group=1, num_experts_per_tok=4, first_k_dense_replace=1, n_group=1,
                     qk_rope_head_dim=16, qk_nope_head_dim=16, v_head_dim=16, num_key_value_heads=4,
                     rope_parameters={"rope_theta": 10000.0, "rope_type": "default", "llama_4_scaling_beta": 0.1,
                                      "original_max_position_embeddings": 256}),
    "dots1": dict(BASE, num_hidden_layers=3, intermediate_size=128, first_k_dense_replace=1, moe_intermediate_size=32,
                  n_routed_experts=16, n_shared_experts=1, norm_topk_prob=True, num_experts_per_tok=4,
                  routed_scaling_factor=1.0, scoring_func="noaux_tc"),
    "hunyuan": dict(BASE, num_hidden_layers=3, intermediate_size=64, attention_bias=False, moe_topk=4,
                    num_experts=32, num_shared_expert=1, use_mixed_mlp_moe=True, use_qk_norm=True, use_cla=False,
                    cla_share_factor=2, moe_intermediate_size=32,
                    rope_scaling={"alpha": 1.0, "factor": 1.0, "type": "dynamic"}),
    "llama4": dict(text_config=dict(BASE, model_type="llama4_text", num_hidden_layers=4, attention_bias=False,
                                    attention_chunk_size=8, interleave_moe_layer_step=1, intermediate_size=32,
                                    intermediate_size_mlp=128, num_experts_per_tok=1, num_local_experts=16,
                                    rope_scaling=None, use_qk_norm=True)),
    "kimi_k25": dict(text_config=dict(
        BASE, model_type="kimi_k2", num_hidden_layers=3, intermediate_size=128, moe_intermediate_size=32,
        n_routed_experts=16, n_shared_experts=1, num_experts_per_tok=4, n_group=4, topk_group=2,
        routed_scaling_factor=2.5, kv_lora_rank=32, q_lora_rank=48, qk_rope_head_dim=16, v_head_dim=16,
        qk_nope_head_dim=16, first_k_dense_replace=1, num_key_value_heads=4)),
    "deepseek_v41": dict(BASE, num_hidden_layers=3, head_dim=32, q_lora_rank=48, qk_rope_head_dim=16, o_groups=2,
                         o_lora_rank=32, moe_intermediate_size=32, n_routed_experts=32, num_experts_per_tok=4,
                         sliding_window=8, index_n_heads=2, index_head_dim=16, index_topk=8, hc_mult=2,
                         compress_ratios=(0, 0, 0), rms_norm_eps=1e-6),
    "bailing_moe_v3": dict(BASE, num_hidden_layers=4, intermediate_size=128, moe_intermediate_size=32,
                           moe_shared_expert_intermediate_size=32, num_experts=32, num_experts_per_tok=4,
                           num_shared_experts=1, first_k_dense_replace=1, n_group=4, topk_group=2,
                           routed_scaling_factor=2.5, layer_group_size=2, q_lora_rank=48, kv_lora_rank=32,
                           qk_nope_head_dim=16, qk_rope_head_dim=16, v_head_dim=16, short_conv_kernel_size=4),
    "kimi_k3": dict(text_config=dict(BASE, model_type="kimi_linear", num_hidden_layers=4, intermediate_size=128,
                                     linear_attn_config={"kda_layers": [1, 3], "num_heads": 2, "head_dim": 16,
                                                         "short_conv_kernel_size": 4},
                                     q_lora_rank=48, kv_lora_rank=32, qk_nope_head_dim=16, qk_rope_head_dim=16,
                                     v_head_dim=16, num_experts=32, num_experts_per_token=4, num_shared_experts=1,
                                     moe_intermediate_size=32, first_k_dense_replace=1, moe_layer_freq=1,
                                     num_expert_group=1, topk_group=1, hidden_act="situ")),
    "nemotron_h": dict(BASE, num_hidden_layers=4, hybrid_override_pattern=["M", "E", "*", "E"], intermediate_size=64,
                       attention_bias=False, mamba_num_heads=4, mamba_head_dim=16, mamba_proj_bias=False,
                       ssm_state_size=16, conv_kernel=4, n_groups=2, mlp_bias=False, layer_norm_epsilon=1e-5,
                       use_bias=False, use_conv_bias=True, moe_intermediate_size=32,
                       moe_shared_expert_intermediate_size=32, n_group=1, n_routed_experts=32, n_shared_experts=1,
                       topk_group=1, num_experts_per_tok=4, norm_topk_prob=True, routed_scaling_factor=1.0,
                       time_step_limit=(0.0, float("inf")), time_step_min=0.001, time_step_max=0.1),
    "gemma4_text": dict(BASE, num_hidden_layers=3, intermediate_size=64, head_dim=16, global_head_dim=32,
                        vocab_size_per_layer_input=384, num_kv_shared_layers=0, hidden_size_per_layer_input=0,
                        sliding_window=8, sliding_window_pattern=3, enable_moe_block=True, num_experts=32,
                        top_k_experts=4, moe_intermediate_size=32, use_double_wide_mlp=False,
                        layer_types=["sliding_attention", "sliding_attention", "full_attention"]),
    "glm4_moe_lite": dict(BASE, num_hidden_layers=3, intermediate_size=128, moe_intermediate_size=32,
                          n_routed_experts=32, n_shared_experts=1, num_experts_per_tok=4, kv_lora_rank=32,
                          q_lora_rank=48, qk_rope_head_dim=16, qk_nope_head_dim=16, v_head_dim=16,
                          first_k_dense_replace=1, num_key_value_heads=4, num_nextn_predict_layers=0),
    "granitemoe": dict(BASE, num_hidden_layers=3, intermediate_size=64, logits_scaling=2.0, attention_multiplier=0.1,
                       embedding_multiplier=4.0, residual_multiplier=0.5, attention_bias=False, num_local_experts=16,
                       num_experts_per_tok=2),
    "phimoe": dict(BASE, num_hidden_layers=3, intermediate_size=32, num_local_experts=16, num_experts_per_tok=2,
                   original_max_position_embeddings=512),
    "lfm2_moe": dict(BASE, num_hidden_layers=4, intermediate_size=128, moe_intermediate_size=32, num_experts=32,
                     num_experts_per_tok=4, norm_topk_prob=True, use_expert_bias=True, num_dense_layers=1,
                     norm_eps=1e-5, conv_bias=False, conv_L_cache=3, full_attn_idxs=[1, 3]),
}

# name -> (model_type, quantize_model arguments)
RECIPES = {
    "qwen3_moe_a4g32": ("qwen3_moe", dict(group_size=32, bits=4)),
    "qwen3_moe_a2g32": ("qwen3_moe", dict(group_size=32, bits=2)),
    "qwen3_moe_mxfp4": ("qwen3_moe", dict(group_size=32, bits=4, mode="mxfp4")),
    "qwen3_moe_mxfp8": ("qwen3_moe", dict(group_size=32, bits=8, mode="mxfp8")),
    "qwen3_moe_nvfp4": ("qwen3_moe", dict(group_size=16, bits=4, mode="nvfp4")),
    "mixtral_a8g32": ("mixtral", dict(group_size=32, bits=8)),
    "deepseek_v3_a4g32": ("deepseek_v3", dict(group_size=32, bits=4)),
    "glm4_moe_a3g32": ("glm4_moe", dict(group_size=32, bits=3)),
    "gpt_oss_mxfp4": ("gpt_oss", dict(group_size=32, bits=4, mode="mxfp4")),
    "qwen3_next_a6g32": ("qwen3_next", dict(group_size=32, bits=6)),
    "qwen3_5_moe_a4g32": ("qwen3_5_moe", dict(group_size=32, bits=4)),
    "minimax_a5g32": ("minimax", dict(group_size=32, bits=5)),
    "ernie4_5_moe_a4g32": ("ernie4_5_moe", dict(group_size=32, bits=4)),
    "olmoe_a8g32": ("olmoe", dict(group_size=32, bits=8)),
    "qwen2_moe_a4g32": ("qwen2_moe", dict(group_size=32, bits=4)),
    "step3p5_a4g32": ("step3p5", dict(group_size=32, bits=4)),
    "deepseek_v32_a4g32": ("deepseek_v32", dict(group_size=32, bits=4)),
    "glm_moe_dsa_a4g32": ("glm_moe_dsa", dict(group_size=32, bits=4)),
    "mistral4_a4g32": ("mistral4", dict(group_size=32, bits=4)),
    "dots1_a4g32": ("dots1", dict(group_size=32, bits=4)),
    "hunyuan_a4g32": ("hunyuan", dict(group_size=32, bits=4)),
    "llama4_a4g32": ("llama4", dict(group_size=32, bits=4)),
    "kimi_k25_a4g32": ("kimi_k25", dict(group_size=32, bits=4)),
    "deepseek_v41_a4g32": ("deepseek_v41", dict(group_size=32, bits=4)),
    "bailing_moe_v3_a4g32": ("bailing_moe_v3", dict(group_size=32, bits=4)),
    "kimi_k3_a4g32": ("kimi_k3", dict(group_size=32, bits=4)),
    "nemotron_h_a4g32": ("nemotron_h", dict(group_size=32, bits=4)),
    "gemma4_text_a4g32": ("gemma4_text", dict(group_size=32, bits=4)),
    "glm4_moe_lite_a4g32": ("glm4_moe_lite", dict(group_size=32, bits=4)),
    "granitemoe_a4g32": ("granitemoe", dict(group_size=32, bits=4)),
    "phimoe_a4g32": ("phimoe", dict(group_size=32, bits=4)),
    "lfm2_moe_a4g32": ("lfm2_moe", dict(group_size=32, bits=4)),
    # mlx-lm convert's mixed per-module recipes (`--quant-predicate`): the experts' down projection
    # in more bits in some layers than in others (its rule picks layers by index)
    "qwen3_moe_mixed_3_6": ("qwen3_moe", dict(group_size=32, bits=4, recipe="mixed_3_6")),
    "qwen3_next_mixed_4_6": ("qwen3_next", dict(group_size=32, bits=4, recipe="mixed_4_6")),
    "deepseek_v3_mixed_2_6": ("deepseek_v3", dict(group_size=32, bits=4, recipe="mixed_2_6")),
}


SELECTION_BIASES = ("e_score_correction_bias", "expert_bias", "router_bias")


def _randomize(model, seed: int) -> None:
    """Every float parameter drawn at random: N(0, 0.5) / sqrt(fan-in) for matrices, 1 + N(0, 0.1)
    for vectors that scale (norms), N(0, 0.01) for selection biases, N(0, 0.1) for other vectors
    (biases)."""
    import mlx.core as mx
    from mlx.utils import tree_flatten, tree_unflatten

    rng = np.random.default_rng(seed)
    new = []
    for name, a in tree_flatten(model.parameters()):
        if not mx.issubdtype(a.dtype, mx.floating):
            continue
        shape = tuple(a.shape)
        if len(shape) >= 2:
            v = rng.normal(0, 0.5 / np.sqrt(shape[-1]), shape)
        elif "norm" in name:
            v = 1 + rng.normal(0, 0.1, shape)
        elif name.endswith(SELECTION_BIASES):  # small beside the scores, as trained ones are: routing follows the token
            v = rng.normal(0, 0.01, shape)
        else:
            v = rng.normal(0, 0.1, shape)
        new.append((name, mx.array(v.astype(np.float32)).astype(a.dtype)))
    model.update(tree_unflatten(new))


def make_checkpoint(recipe: str, out: Path, *, seed: int = 0, quant_predicate=None) -> Path:
    """A tiny checkpoint of `recipe` in `out` (created); -> out. quant_predicate: mlx-lm's
    per-module override (path, module) -> bool or quantization parameters; a recipe naming one of
    mlx-lm convert's mixed recipes gets convert's own predicate for it."""
    import mlx.core as mx
    from mlx_lm.convert import mixed_quant_predicate_builder
    from mlx_lm.utils import quantize_model, save_config, save_model

    from strata.tokenizer import byte_level_tokenizer_json

    model_type, quant = RECIPES[recipe]
    config = {"model_type": model_type, **FAMILIES[model_type]}
    module = importlib.import_module(f"mlx_lm.models.{model_type}")
    model = module.Model(module.ModelArgs.from_dict(config))
    _randomize(model, seed)
    model.update(tree_map_floats(model.parameters(), mx.bfloat16))
    if "recipe" in quant:
        quant_predicate = mixed_quant_predicate_builder(quant["recipe"], model, quant["group_size"])
    model, config = quantize_model(model, config, quant["group_size"], quant["bits"], mode=quant.get("mode", "affine"),
                                   quant_predicate=quant_predicate)
    save_model(out, model)
    save_config(config, out / "config.json")
    (out / "tokenizer.json").write_text(byte_level_tokenizer_json())
    return out


def tree_map_floats(params, dtype):
    import mlx.core as mx
    from mlx.utils import tree_map

    return tree_map(lambda a: a.astype(dtype) if mx.issubdtype(a.dtype, mx.floating) else a, params)


def mlx_lm_model(directory: Path):
    """mlx-lm's own model of the checkpoint, every expert resident (its `load`)."""
    from mlx_lm.utils import load_model

    return load_model(Path(directory))[0]


def mlx_lm_generate(directory: Path, prompt: list[int], steps: int) -> list[int]:
    """mlx-lm's own greedy generate (generate_step, argmax sampler) on the checkpoint."""
    import mlx.core as mx
    from mlx_lm.generate import generate_step

    model = mlx_lm_model(directory)
    return [int(t) for t, _ in generate_step(mx.array(prompt), model, max_tokens=steps)]


def mlx_lm_schedule_logits(directory: Path, prompt: list[int], continuation: list[int]) -> np.ndarray:
    """mlx-lm's all-resident log-probabilities (generate_step's: logits - logsumexp) under
    generate_step's schedule (every prompt position but the last as one chunk, then one position
    per call): the last prompt position's, then each continuation token's.
    -> float32 [1 + len(continuation), V]"""
    import mlx.core as mx
    from mlx_lm.models.cache import make_prompt_cache

    model = mlx_lm_model(directory)
    cache = make_prompt_cache(model)
    if len(prompt) > 1:
        model(mx.array(prompt[:-1])[None], cache=cache)
        mx.eval([c.state for c in cache])
    rows = []
    for t in [prompt[-1], *continuation]:
        logits = model(mx.array([t])[None], cache=cache)[:, -1, :]
        logprobs = logits - mx.logsumexp(logits, keepdims=True)  # generate_step's, as its sampler sees them
        rows.append(np.array(logprobs[0].astype(mx.float32)))
    return np.stack(rows)
