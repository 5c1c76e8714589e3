"""A tiny llama.cpp `gpt-oss` GGUF made from a checked-in Hugging Face checkpoint the way llama.cpp's
convert_hf_to_gguf.py (GptOssModel) lays out a float one: the base keys plus
`attention.sliding_window` and expert_feed_forward_length, YaRN as `rope.scaling.*`; sinks as
`attn_sinks.weight`, the post-attention norm as `post_attention_norm`, the router as
`ffn_gate_inp` (weight and bias); the experts' fused gate_up_proj [E, D, 2F] transposed and split
into its even (gate) and odd (up) rows, down_proj [E, F, D] transposed, their biases split alike
(`ffn_{gate,up,down}_exps.bias`)."""

from __future__ import annotations

import json
from pathlib import Path

import numpy as np

from tests.gguf_models import add_tokenizer
from tests.gguf_sigmoid_models import _add, _add_head, _add_mapped, _finish

ATTENTION = {"input_layernorm.weight": "attn_norm.weight", "post_attention_layernorm.weight": "post_attention_norm.weight",
             "self_attn.q_proj.weight": "attn_q.weight", "self_attn.k_proj.weight": "attn_k.weight",
             "self_attn.v_proj.weight": "attn_v.weight", "self_attn.o_proj.weight": "attn_output.weight",
             "self_attn.q_proj.bias": "attn_q.bias", "self_attn.k_proj.bias": "attn_k.bias",
             "self_attn.v_proj.bias": "attn_v.bias", "self_attn.o_proj.bias": "attn_output.bias",
             "self_attn.sinks": "attn_sinks.weight", "mlp.router.weight": "ffn_gate_inp.weight",
             "mlp.router.bias": "ffn_gate_inp.bias"}


def write_gpt_oss_gguf(hf_dir: Path, path: Path, *, experts: str = "F32", dense: str = "F32") -> Path:
    """The GGUF of the float gpt-oss checkpoint in `hf_dir` (experts as `experts`, 2-D dense
    matrices as `dense`, norms, sinks, routers and biases F32)."""
    import gguf

    from strata.convert.safetensors_reader import Checkpoint

    cfg = json.loads((hf_dir / "config.json").read_text())
    params = cfg.get("rope_parameters") or {}
    w = gguf.GGUFWriter(str(path), "gpt-oss")
    w.add_block_count(cfg["num_hidden_layers"])
    w.add_context_length(cfg["max_position_embeddings"])
    w.add_embedding_length(cfg["hidden_size"])
    w.add_feed_forward_length(cfg["intermediate_size"])
    w.add_head_count(cfg["num_attention_heads"])
    w.add_head_count_kv(cfg["num_key_value_heads"])
    w.add_rope_freq_base(params["rope_theta"])
    w.add_layer_norm_rms_eps(cfg["rms_norm_eps"])
    w.add_expert_count(cfg["num_local_experts"])
    w.add_expert_used_count(cfg["num_experts_per_tok"])
    w.add_key_length(cfg["head_dim"])
    w.add_value_length(cfg["head_dim"])
    if params.get("rope_type") == "yarn":
        w.add_rope_scaling_type(gguf.RopeScalingType.YARN)
        w.add_rope_scaling_factor(params["factor"])
        w.add_rope_scaling_orig_ctx_len(params["original_max_position_embeddings"])
    w.add_sliding_window(cfg["sliding_window"])
    w.add_expert_feed_forward_length(cfg["intermediate_size"])
    add_tokenizer(w, hf_dir, cfg["vocab_size"])
    with Checkpoint(hf_dir) as ck:
        _add_head(w, ck, dense)
        for l in range(cfg["num_hidden_layers"]):
            base = f"model.layers.{l}."
            _add_mapped(w, ck, ATTENTION, base, l, dense)
            gate_up = ck.read(base + "mlp.experts.gate_up_proj").transpose(0, 2, 1)  # [E, 2F, D]
            gate_up_bias = ck.read(base + "mlp.experts.gate_up_proj_bias")  # [E, 2F]
            _add(w, f"blk.{l}.ffn_gate_exps.weight", gate_up[:, 0::2], experts)
            _add(w, f"blk.{l}.ffn_up_exps.weight", gate_up[:, 1::2], experts)
            _add(w, f"blk.{l}.ffn_down_exps.weight", ck.read(base + "mlp.experts.down_proj").transpose(0, 2, 1), experts)
            _add(w, f"blk.{l}.ffn_gate_exps.bias", gate_up_bias[:, 0::2], "F32")
            _add(w, f"blk.{l}.ffn_up_exps.bias", gate_up_bias[:, 1::2], "F32")
            _add(w, f"blk.{l}.ffn_down_exps.bias", ck.read(base + "mlp.experts.down_proj_bias"), "F32")
    return _finish(w, path)
