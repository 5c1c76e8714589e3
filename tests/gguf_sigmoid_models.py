"""Tiny llama.cpp GGUFs of the sigmoid-routed families, made from checked-in Hugging Face
checkpoints the way llama.cpp's convert_hf_to_gguf.py lays them out.

`write_glm4moe_gguf` (Glm4MoeModel): the base keys (key_length = head_dim), rope.dimension_count =
head_dim * partial_rotary_factor, expert and shared counts, leading dense blocks, sigmoid gating,
weights scale and norm, no group keys (llama.cpp runs GLM-4.5 without groups), block_count counting
the multi-token-prediction layer after the model (`nextn_predict_layers`), whose `nextn.*` tensors
follow its ordinary ones; q/k rows as the checkpoint holds them (rotate-half already).

`write_minimax_m2_gguf` (MiniMaxM2Model): the base keys, expert_feed_forward_length =
intermediate_size, rope.dimension_count = rotary_dim, sigmoid gating; q/k norms [H * head_dim]
as `attn_{q,k}_norm`, the block's `e_score_correction_bias` as `exp_probs_b.bias`, w1 / w3 / w2 stacked
as gate / up / down.

`write_deepseek2_gguf` (DeepseekV2Model; DeepSeek-V3 / Kimi-K2 / GLM-4.7-Flash):
today's MLA keys (head_count_kv 1, key_length = kv_lora_rank + rope, key_length_mla = nope +
rope, value_length = kv_lora_rank, value_length_mla = v_head_dim), kv_b_proj split per head into
`attn_k_b` [H, c, nope] (transposed) and `attn_v_b` [H, v, c], the selection bias as
`exp_probs_b.bias`, sigmoid gating, expert groups, the dense leading layers as `ffn_{gate,up,down}`,
shared experts as `*_shexp`, experts stacked as `*_exps`, the multi-token-prediction layers left out,
the rope rows as the checkpoint holds them (llama.cpp's rope for deepseek2 is the interleaved one)."""

from __future__ import annotations

import json
from pathlib import Path

import numpy as np

from tests.gguf_models import add_tokenizer

MLA = {"input_layernorm.weight": "attn_norm.weight", "post_attention_layernorm.weight": "ffn_norm.weight",
       "self_attn.q_a_proj.weight": "attn_q_a.weight", "self_attn.q_a_layernorm.weight": "attn_q_a_norm.weight",
       "self_attn.q_b_proj.weight": "attn_q_b.weight", "self_attn.q_proj.weight": "attn_q.weight",
       "self_attn.kv_a_proj_with_mqa.weight": "attn_kv_a_mqa.weight",
       "self_attn.kv_a_layernorm.weight": "attn_kv_a_norm.weight", "self_attn.o_proj.weight": "attn_output.weight",
       "mlp.gate_proj.weight": "ffn_gate.weight", "mlp.up_proj.weight": "ffn_up.weight",
       "mlp.down_proj.weight": "ffn_down.weight", "mlp.gate.weight": "ffn_gate_inp.weight",
       "mlp.gate.e_score_correction_bias": "exp_probs_b.bias",
       "mlp.shared_experts.gate_proj.weight": "ffn_gate_shexp.weight",
       "mlp.shared_experts.up_proj.weight": "ffn_up_shexp.weight",
       "mlp.shared_experts.down_proj.weight": "ffn_down_shexp.weight"}


def _add(w, name: str, x: np.ndarray, qtype: str) -> None:
    import gguf

    t = getattr(gguf.GGMLQuantizationType, qtype)
    if x.shape[-1] % gguf.GGML_QUANT_SIZES[t][0]:  # rows not whole blocks: llama.cpp keeps them float
        t = gguf.GGMLQuantizationType.F32
    if t == gguf.GGMLQuantizationType.F32:
        w.add_tensor(name, np.ascontiguousarray(x, np.float32))
    elif t == gguf.GGMLQuantizationType.F16:
        w.add_tensor(name, np.ascontiguousarray(x, np.float16))
    else:
        w.add_tensor(name, gguf.quants.quantize(np.ascontiguousarray(x, np.float32), t), raw_dtype=t)


def _add_head(w, ck, dense: str, *, norm_plus_one: bool = False) -> None:
    """The embedding, the final norm (F32; `norm_plus_one`: stored as 1 + w, as llama.cpp's
    converter stores the hybrids' zero-centred norms) and the head."""
    norm = ck.read("model.norm.weight")
    _add(w, "token_embd.weight", ck.read("model.embed_tokens.weight"), dense)
    _add(w, "output_norm.weight", norm + np.float32(1.0) if norm_plus_one else norm, "F32")
    _add(w, "output.weight", ck.read("lm_head.weight"), dense)


def _add_mapped(w, ck, table: dict, base: str, layer: int, dense: str, *, required: bool = True) -> None:
    """Each Hugging Face tensor of `table` under `base` as `blk.{layer}.<its GGUF name>`: matrices
    in `dense`, the rest (norms, biases, the router, kept float by llama.cpp's converter) in F32.
    `required` False: a tensor the checkpoint lacks is left out."""
    for hf_suffix, g_suffix in table.items():
        if not required and base + hf_suffix not in ck:
            continue
        x = ck.read(base + hf_suffix)
        two_d = x.ndim == 2 and g_suffix != "ffn_gate_inp.weight"
        _add(w, f"blk.{layer}.{g_suffix}", x, dense if two_d else "F32")


def _finish(w, path: Path) -> Path:
    w.write_header_to_file()
    w.write_kv_data_to_file()
    w.write_tensors_to_file()
    w.close()
    return path


# llama.cpp's GLM4_MOE tensors: the norm before the MLP is post_attention_norm (ATTN_POST_NORM)
GLM = {"input_layernorm.weight": "attn_norm.weight", "post_attention_layernorm.weight": "post_attention_norm.weight",
       "self_attn.q_proj.weight": "attn_q.weight", "self_attn.k_proj.weight": "attn_k.weight",
       "self_attn.v_proj.weight": "attn_v.weight", "self_attn.q_proj.bias": "attn_q.bias",
       "self_attn.k_proj.bias": "attn_k.bias", "self_attn.v_proj.bias": "attn_v.bias",
       "self_attn.q_norm.weight": "attn_q_norm.weight", "self_attn.k_norm.weight": "attn_k_norm.weight",
       "self_attn.o_proj.weight": "attn_output.weight", **{k: v for k, v in MLA.items() if k.startswith("mlp.")}}
NEXTN = ("eh_proj", "embed_tokens", "enorm", "hnorm", "shared_head_head", "shared_head_norm")


def write_glm4moe_gguf(hf_dir: Path, path: Path, *, experts: str = "F32", dense: str = "F32") -> Path:
    """The GGUF of the GLM-4.5-layout checkpoint in `hf_dir` (routed experts as `experts`, 2-D
    dense matrices as `dense`, the rest F32), with one multi-token-prediction layer after the
    model's: the last layer's tensors again plus random `nextn.*` ones (what llama.cpp keeps)."""
    import gguf

    from strata.convert.safetensors_reader import Checkpoint

    cfg = json.loads((hf_dir / "config.json").read_text())
    n, nextn = cfg["num_hidden_layers"], cfg.get("num_nextn_predict_layers", 0)
    head_dim = cfg.get("head_dim") or cfg["hidden_size"] // cfg["num_attention_heads"]
    params = cfg.get("rope_parameters") or {}
    w = gguf.GGUFWriter(str(path), "glm4moe")
    w.add_block_count(n + nextn)
    w.add_context_length(cfg["max_position_embeddings"])
    w.add_embedding_length(cfg["hidden_size"])
    w.add_feed_forward_length(cfg["intermediate_size"])
    w.add_head_count(cfg["num_attention_heads"])
    w.add_head_count_kv(cfg["num_key_value_heads"])
    w.add_rope_freq_base(params.get("rope_theta", cfg.get("rope_theta", 10000.0)))
    w.add_layer_norm_rms_eps(cfg["rms_norm_eps"])
    w.add_expert_used_count(cfg["num_experts_per_tok"])
    w.add_key_length(head_dim)
    w.add_value_length(head_dim)
    w.add_rope_dimension_count(int(head_dim * params.get("partial_rotary_factor", cfg.get("partial_rotary_factor", 0.5))))
    w.add_expert_count(cfg["n_routed_experts"])
    w.add_expert_feed_forward_length(cfg["moe_intermediate_size"])
    w.add_expert_shared_count(cfg["n_shared_experts"])
    w.add_leading_dense_block_count(cfg["first_k_dense_replace"])
    w.add_expert_gating_func(gguf.ExpertGatingFuncType.SIGMOID)
    w.add_expert_weights_scale(cfg["routed_scaling_factor"])
    w.add_expert_weights_norm(cfg["norm_topk_prob"])
    w.add_nextn_predict_layers(nextn)
    add_tokenizer(w, hf_dir, cfg["vocab_size"])
    rng = np.random.default_rng(0)
    d, vocab = cfg["hidden_size"], cfg["vocab_size"]
    with Checkpoint(hf_dir) as ck:
        _add_head(w, ck, dense)
        for l in range(n + nextn):
            src = min(l, n - 1)  # the MTP layer: the last layer's tensors again
            base = f"model.layers.{src}."
            _add_mapped(w, ck, GLM, base, l, dense, required=False)
            if src >= cfg["first_k_dense_replace"]:
                for proj in ("gate_proj", "up_proj", "down_proj"):
                    stack = np.stack([ck.read(base + f"mlp.experts.{e}.{proj}.weight")
                                      for e in range(cfg["n_routed_experts"])])
                    _add(w, f"blk.{l}.ffn_{proj.split('_')[0]}_exps.weight", stack, experts)
            if l >= n:
                shapes = {"eh_proj": (d, 2 * d), "embed_tokens": (vocab, d), "enorm": (d,), "hnorm": (d,),
                          "shared_head_head": (vocab, d), "shared_head_norm": (d,)}
                for t in NEXTN:
                    _add(w, f"blk.{l}.nextn.{t}.weight", rng.standard_normal(shapes[t]).astype(np.float32), "F32")
    return _finish(w, path)


MINIMAX = {"input_layernorm.weight": "attn_norm.weight", "post_attention_layernorm.weight": "ffn_norm.weight",
           "self_attn.q_proj.weight": "attn_q.weight", "self_attn.k_proj.weight": "attn_k.weight",
           "self_attn.v_proj.weight": "attn_v.weight", "self_attn.o_proj.weight": "attn_output.weight",
           "self_attn.q_norm.weight": "attn_q_norm.weight", "self_attn.k_norm.weight": "attn_k_norm.weight",
           "block_sparse_moe.gate.weight": "ffn_gate_inp.weight",
           "block_sparse_moe.e_score_correction_bias": "exp_probs_b.bias"}


def write_minimax_m2_gguf(hf_dir: Path, path: Path, *, experts: str = "F32", dense: str = "F32") -> Path:
    """The GGUF of the MiniMax-M2-layout checkpoint in `hf_dir`."""
    import gguf

    from strata.convert.safetensors_reader import Checkpoint

    cfg = json.loads((hf_dir / "config.json").read_text())
    params = cfg.get("rope_parameters") or {}
    w = gguf.GGUFWriter(str(path), "minimax-m2")
    w.add_block_count(cfg["num_hidden_layers"])
    w.add_context_length(cfg["max_position_embeddings"])
    w.add_embedding_length(cfg["hidden_size"])
    w.add_feed_forward_length(cfg["intermediate_size"])
    w.add_head_count(cfg["num_attention_heads"])
    w.add_head_count_kv(cfg["num_key_value_heads"])
    w.add_rope_freq_base(params.get("rope_theta", cfg.get("rope_theta")))
    w.add_layer_norm_rms_eps(cfg["rms_norm_eps"])
    w.add_expert_count(cfg["num_local_experts"])
    w.add_expert_used_count(cfg["num_experts_per_tok"])
    w.add_key_length(cfg["head_dim"])
    w.add_value_length(cfg["head_dim"])
    w.add_expert_gating_func(gguf.ExpertGatingFuncType.SIGMOID)
    w.add_expert_feed_forward_length(cfg["intermediate_size"])
    w.add_rope_dimension_count(cfg["rotary_dim"])
    add_tokenizer(w, hf_dir, cfg["vocab_size"])
    with Checkpoint(hf_dir) as ck:
        _add_head(w, ck, dense)
        for l in range(cfg["num_hidden_layers"]):
            base = f"model.layers.{l}."
            _add_mapped(w, ck, MINIMAX, base, l, dense)
            for proj, g in (("w1", "gate"), ("w3", "up"), ("w2", "down")):
                stack = np.stack([ck.read(base + f"block_sparse_moe.experts.{e}.{proj}.weight")
                                  for e in range(cfg["num_local_experts"])])
                _add(w, f"blk.{l}.ffn_{g}_exps.weight", stack, experts)
    return _finish(w, path)


def write_deepseek2_gguf(hf_dir: Path, path: Path, *, experts: str = "F32", dense: str = "F32",
                         first_generation: bool = False) -> Path:
    """The GGUF of the DeepSeek-V3-layout checkpoint in `hf_dir`: routed experts as ggml type
    `experts`, 2-D dense matrices as `dense` (k_b / v_b too), norms, routers and biases F32.
    first_generation: llama.cpp's first deepseek2 layout (head_count_kv = heads, key_length =
    nope + rope, value_length = v, no *_mla keys, kv_b_proj whole as `attn_kv_b`)."""
    import gguf

    from strata.convert.safetensors_reader import Checkpoint

    cfg = json.loads((hf_dir / "config.json").read_text())
    heads, c, rope = cfg["num_attention_heads"], cfg["kv_lora_rank"], cfg["qk_rope_head_dim"]
    nope, v = cfg["qk_nope_head_dim"], cfg["v_head_dim"]
    w = gguf.GGUFWriter(str(path), "deepseek2")
    w.add_block_count(cfg["num_hidden_layers"])
    w.add_context_length(cfg["max_position_embeddings"])
    w.add_embedding_length(cfg["hidden_size"])
    w.add_feed_forward_length(cfg["intermediate_size"])
    w.add_head_count(heads)
    w.add_head_count_kv(heads if first_generation else 1)
    params = cfg.get("rope_parameters") or {}
    w.add_rope_freq_base(params.get("rope_theta", cfg.get("rope_theta", 10000.0)))
    w.add_layer_norm_rms_eps(cfg["rms_norm_eps"])
    w.add_vocab_size(cfg["vocab_size"])
    if cfg.get("q_lora_rank"):
        w.add_q_lora_rank(cfg["q_lora_rank"])
    w.add_kv_lora_rank(c)
    if first_generation:
        w.add_key_length(nope + rope)
        w.add_value_length(v)
    else:
        w.add_key_length(c + rope)
        w.add_value_length(c)
        w.add_key_length_mla(nope + rope)
        w.add_value_length_mla(v)
    w.add_rope_dimension_count(rope)
    w.add_leading_dense_block_count(cfg["first_k_dense_replace"])
    w.add_expert_feed_forward_length(cfg["moe_intermediate_size"])
    w.add_expert_count(cfg["n_routed_experts"])
    w.add_expert_used_count(cfg["num_experts_per_tok"])
    w.add_expert_shared_count(cfg["n_shared_experts"])
    w.add_expert_weights_scale(cfg["routed_scaling_factor"])
    w.add_expert_weights_norm(cfg["norm_topk_prob"])
    w.add_expert_gating_func(gguf.ExpertGatingFuncType.SIGMOID)
    w.add_expert_group_count(cfg["n_group"])
    w.add_expert_group_used_count(cfg["topk_group"])
    if params.get("rope_type") == "yarn":
        w.add_rope_scaling_type(gguf.RopeScalingType.YARN)
        w.add_rope_scaling_factor(params["factor"])
        w.add_rope_scaling_orig_ctx_len(params["original_max_position_embeddings"])
        w.add_rope_scaling_yarn_log_mul(0.1 * params["mscale_all_dim"])
    add_tokenizer(w, hf_dir, cfg["vocab_size"])

    add = lambda name, x, qtype: _add(w, name, x, qtype)  # noqa: E731

    with Checkpoint(hf_dir) as ck:
        _add_head(w, ck, dense)
        for l in range(cfg["num_hidden_layers"]):  # MTP layers (l >= num_hidden_layers) left out
            base = f"model.layers.{l}."
            _add_mapped(w, ck, MLA, base, l, dense, required=False)
            kv_b = ck.read(base + "self_attn.kv_b_proj.weight")
            if first_generation:
                add(f"blk.{l}.attn_kv_b.weight", kv_b, dense)
            else:
                kv_b = kv_b.reshape(heads, nope + v, c)
                add(f"blk.{l}.attn_k_b.weight", kv_b[:, :nope].transpose(0, 2, 1), dense)  # [H, c, nope]
                add(f"blk.{l}.attn_v_b.weight", kv_b[:, nope:], dense)  # [H, v, c]
            if l < cfg["first_k_dense_replace"]:
                continue
            for proj in ("gate_proj", "up_proj", "down_proj"):
                stack = np.stack([ck.read(base + f"mlp.experts.{e}.{proj}.weight")
                                  for e in range(cfg["n_routed_experts"])])
                add(f"blk.{l}.ffn_{proj.split('_')[0]}_exps.weight", stack, experts)
    return _finish(w, path)
