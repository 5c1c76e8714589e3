"""A tiny llama.cpp `qwen3next` GGUF made from the checked-in Qwen3-Next checkpoint the way llama.cpp's
convert_hf_to_gguf.py (Qwen3NextModel) lays it out: the base keys plus `ssm.conv_kernel`,
`ssm.state_size` (key head dim), `ssm.group_count` (key heads), `ssm.time_step_rank` (value heads),
`ssm.inner_size`, `full_attention_interval`, rope.dimension_count = head_dim x partial rotary
factor; the zero-centred norms stored as 1 + w (not the DeltaNet's gated norm), A_log as
`ssm_a` = -exp(A_log), conv1d squeezed to [C, K], dt_bias as `ssm_dt.bias`, in_proj_qkvz regrouped
from [q, k, v, z] per key head into flat `attn_qkv` (q | k | v) and `attn_gate` (z), in_proj_ba as
`ssm_ba` unchanged, q_proj ([query; gate] per head) as `attn_q`, the post-attention norm as
`post_attention_norm`, experts stacked, the shared expert as `*_shexp`. The float32 arithmetic is
the Hugging Face converter's (w + 1, -exp), so the values are the ones it computes.

`write_qwen35moe_gguf` (Qwen3.5 / 3.6-MoE text, llama.cpp's `qwen35moe`): the same keys and
transforms over Qwen3.5's separate projections (in_proj_qkv as `attn_qkv`, in_proj_z as
`attn_gate`, in_proj_b / in_proj_a as `ssm_beta` / `ssm_alpha`) plus `rope.dimension_sections`, and,
with more value heads than key heads, llama.cpp's reorder of the value heads from grouped (by key
head) to tiled: the v rows of attn_qkv and of the conv channels, attn_gate, ssm_beta / ssm_alpha,
ssm_a, ssm_dt and ssm_out's columns."""

from __future__ import annotations

import json
from pathlib import Path

import numpy as np

from tests.gguf_models import add_tokenizer
from tests.gguf_sigmoid_models import _add, _add_head, _finish

COMMON = {"mlp.gate.weight": "ffn_gate_inp.weight", "mlp.shared_expert.gate_proj.weight": "ffn_gate_shexp.weight",
          "mlp.shared_expert.up_proj.weight": "ffn_up_shexp.weight",
          "mlp.shared_expert.down_proj.weight": "ffn_down_shexp.weight",
          "mlp.shared_expert_gate.weight": "ffn_gate_inp_shexp.weight",
          "self_attn.q_proj.weight": "attn_q.weight", "self_attn.k_proj.weight": "attn_k.weight",
          "self_attn.v_proj.weight": "attn_v.weight", "self_attn.o_proj.weight": "attn_output.weight",
          "linear_attn.in_proj_ba.weight": "ssm_ba.weight", "linear_attn.dt_bias": "ssm_dt.bias",
          "linear_attn.norm.weight": "ssm_norm.weight", "linear_attn.out_proj.weight": "ssm_out.weight"}
PLUS_ONE = {"input_layernorm.weight": "attn_norm.weight", "post_attention_layernorm.weight": "post_attention_norm.weight",
            "self_attn.q_norm.weight": "attn_q_norm.weight", "self_attn.k_norm.weight": "attn_k_norm.weight"}


def tile_value_heads(x: np.ndarray, axis: int, k_heads: int, per_k: int, head_dim: int) -> np.ndarray:
    """llama.cpp's `_reorder_v_heads`: grouped [k_heads, per_k, head_dim] -> tiled [per_k, k_heads, head_dim]."""
    x = np.moveaxis(x, axis, 0)
    rest = x.shape[1:]
    x = x.reshape(k_heads, per_k, head_dim, *rest).swapaxes(0, 1).reshape(-1, *rest)
    return np.ascontiguousarray(np.moveaxis(x, 0, axis))


def add_hybrid_keys(w, cfg: dict) -> None:
    """The keys llama.cpp's `qwen35moe` family writes for attention, routing and the DeltaNet
    (`ssm.*`), from a Hugging Face config (qwen3next, qwen35moe and qwen4exp share them)."""
    params = cfg.get("rope_parameters") or {}
    head_dim = cfg["head_dim"]
    hk, hv = cfg["linear_num_key_heads"], cfg["linear_num_value_heads"]
    dk, dv = cfg["linear_key_head_dim"], cfg["linear_value_head_dim"]
    w.add_head_count(cfg["num_attention_heads"])
    w.add_head_count_kv(cfg["num_key_value_heads"])
    w.add_rope_freq_base(params["rope_theta"])
    w.add_layer_norm_rms_eps(cfg["rms_norm_eps"])
    w.add_expert_count(cfg["num_experts"])
    w.add_expert_used_count(cfg["num_experts_per_tok"])
    w.add_key_length(head_dim)
    w.add_value_length(head_dim)
    w.add_expert_feed_forward_length(cfg["moe_intermediate_size"])
    w.add_expert_shared_feed_forward_length(cfg["shared_expert_intermediate_size"])
    w.add_ssm_conv_kernel(cfg["linear_conv_kernel_dim"])
    w.add_ssm_state_size(dk)
    w.add_ssm_group_count(hk)
    w.add_ssm_time_step_rank(hv)
    w.add_ssm_inner_size(dv * hv)


def write_qwen35moe_gguf(hf_dir: Path, path: Path, *, experts: str = "F32", dense: str = "F32") -> Path:
    return write_qwen3next_gguf(hf_dir, path, experts=experts, dense=dense, arch="qwen35moe")


def write_qwen3next_gguf(hf_dir: Path, path: Path, *, experts: str = "F32", dense: str = "F32",
                         legacy_ssm_in: bool = False, arch: str = "qwen3next") -> Path:
    """legacy_ssm_in: in_proj_qkvz as stored under `ssm_in` (llama.cpp's first qwen3next layout)."""
    import gguf

    from strata.convert.safetensors_reader import Checkpoint

    cfg = json.loads((hf_dir / "config.json").read_text())
    params = cfg.get("rope_parameters") or {}
    head_dim = cfg["head_dim"]
    hk, hv = cfg["linear_num_key_heads"], cfg["linear_num_value_heads"]
    dk, dv, d = cfg["linear_key_head_dim"], cfg["linear_value_head_dim"], cfg["hidden_size"]
    w = gguf.GGUFWriter(str(path), arch)
    w.add_block_count(cfg["num_hidden_layers"])
    w.add_context_length(cfg["max_position_embeddings"])
    w.add_embedding_length(d)
    w.add_feed_forward_length(cfg.get("intermediate_size", cfg["moe_intermediate_size"]))
    add_hybrid_keys(w, cfg)
    w.add_full_attention_interval(cfg.get("full_attention_interval", 4))
    w.add_rope_dimension_count(int(head_dim * params.get("partial_rotary_factor", 0.25)))
    if arch == "qwen35moe":
        w.add_rope_dimension_sections(params.get("mrope_section", [11, 11, 10]) + [0])
    add_tokenizer(w, hf_dir, cfg["vocab_size"])
    one = np.float32(1.0)
    with Checkpoint(hf_dir) as ck:
        _add_head(w, ck, dense, norm_plus_one=True)
        for l in range(cfg["num_hidden_layers"]):
            base = f"model.layers.{l}."
            for hf_suffix, g_suffix in PLUS_ONE.items():
                if base + hf_suffix in ck:
                    _add(w, f"blk.{l}.{g_suffix}", ck.read(base + hf_suffix) + one, "F32")
            for hf_suffix, g_suffix in COMMON.items():
                if arch == "qwen35moe" and hf_suffix.startswith("linear_attn."):
                    continue  # written below, value heads tiled
                if base + hf_suffix in ck:
                    x = ck.read(base + hf_suffix)
                    if g_suffix == "ffn_gate_inp_shexp.weight":
                        x = x.reshape(-1)
                    two_d = x.ndim == 2 and g_suffix not in ("ffn_gate_inp.weight", "ssm_ba.weight")
                    _add(w, f"blk.{l}.{g_suffix}", x, dense if two_d else "F32")
            a = base + "linear_attn."
            if arch == "qwen35moe" and a + "A_log" in ck:
                r = hv // hk
                tile = lambda x, axis, hd: tile_value_heads(x, axis, hk, r, hd)  # noqa: E731
                qk = 2 * hk * dk
                qkv = ck.read(a + "in_proj_qkv.weight")
                conv = ck.read(a + "conv1d.weight").squeeze(1)
                _add(w, f"blk.{l}.attn_qkv.weight", np.concatenate([qkv[:qk], tile(qkv[qk:], 0, dv)]), dense)
                _add(w, f"blk.{l}.attn_gate.weight", tile(ck.read(a + "in_proj_z.weight"), 0, dv), dense)
                _add(w, f"blk.{l}.ssm_beta.weight", tile(ck.read(a + "in_proj_b.weight"), 0, 1), "F32")
                _add(w, f"blk.{l}.ssm_alpha.weight", tile(ck.read(a + "in_proj_a.weight"), 0, 1), "F32")
                _add(w, f"blk.{l}.ssm_a", tile(-np.exp(ck.read(a + "A_log")), 0, 1), "F32")
                _add(w, f"blk.{l}.ssm_dt.bias", tile(ck.read(a + "dt_bias"), 0, 1), "F32")
                _add(w, f"blk.{l}.ssm_conv1d.weight", np.concatenate([conv[:qk], tile(conv[qk:], 0, dv)]), "F32")
                _add(w, f"blk.{l}.ssm_norm.weight", ck.read(a + "norm.weight"), "F32")
                _add(w, f"blk.{l}.ssm_out.weight", tile(ck.read(a + "out_proj.weight"), 1, dv), dense)
            elif a + "A_log" in ck:
                _add(w, f"blk.{l}.ssm_a", -np.exp(ck.read(a + "A_log")), "F32")
                _add(w, f"blk.{l}.ssm_conv1d.weight", ck.read(a + "conv1d.weight").squeeze(1), "F32")
                r = hv // hk
                if legacy_ssm_in:
                    _add(w, f"blk.{l}.ssm_in.weight", ck.read(a + "in_proj_qkvz.weight"), dense)
                else:
                    g = ck.read(a + "in_proj_qkvz.weight").reshape(hk, 2 * dk + 2 * r * dv, d)
                    q, k, v, z = np.split(g, [dk, 2 * dk, 2 * dk + r * dv], axis=1)
                    qkv = np.concatenate([q.reshape(-1, d), k.reshape(-1, d), v.reshape(-1, d)])
                    _add(w, f"blk.{l}.attn_qkv.weight", qkv, dense)
                    _add(w, f"blk.{l}.attn_gate.weight", z.reshape(-1, d), dense)
            for proj in ("gate_proj", "up_proj", "down_proj"):
                stack = np.stack([ck.read(base + f"mlp.experts.{e}.{proj}.weight") for e in range(cfg["num_experts"])])
                _add(w, f"blk.{l}.ffn_{proj.split('_')[0]}_exps.weight", stack, experts)
    return _finish(w, path)
