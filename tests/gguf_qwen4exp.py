"""A tiny llama.cpp `qwen4exp` (Qwen3.8-Flash-Next) GGUF made from a Qwen4-Exp checkpoint of the
released form (tests/hf_qwen4_released.py) the way llama.cpp's converter (conversion/qwen4exp.py,
over its Qwen3.5 one) lays it out:

- keys: the `qwen35moe` ones (ssm.*, full_attention_interval, rope.dimension_count / sections),
  `hyper_connection.count` / `low_rank`, `attention.indexer.head_count` / `key_length` / `top_k`,
  `attention.compress_ratios` (the indexer's block on every `full_attention` layer, 0 elsewhere
  and on the MTP block), `ple.layers` (0-based, one), `ple.ngram_size`, `ple.heads_per_ngram`,
  `ple.conv_kernel`, `ple.eos_token_id`, `embedding_length_per_layer_input` (one head's row width),
  and the hash constants read from the checkpoint's buffers as UINT64 arrays
  (`ple.layer_multipliers`, `ple.head_offsets`, `ple.head_vocab_sizes`); `nextn_predict_layers`
  with block_count counting the MTP block;
- tensors: no output_norm but `output_hc_{norm,down,up}`; per layer `hc_{attn,ffn}_{norm,down,up,inject}`;
  on attention layers `attn_q` ([query; gate] per head), `attn_k`, `attn_v`, `attn_output`, the q/k
  norms and `indexer.{q_proj,k_proj}` (index_qk_proj split at Hi di rows), `indexer.{q,k}_norm`;
  on DeltaNet layers the `qwen35moe` tensors (value heads tiled); on the PLE layer `ple_key`,
  `ple_value`, `ple_norm_{key,query,conv}`, `ple_conv1d` squeezed to [S, K]; the MoE tensors as
  `qwen35moe`'s; the n-gram table's row shards joined into one `per_layer_token_embd.weight`;
  every zero-centred gamma (hc, q/k, indexer and PLE norms) stored as 1 + w (the DeltaNet's gated
  norm as it is);
- a trailing MTP block (`mtp=True`): the last layer's tensors again plus random `nextn.*` ones
  (llama.cpp exports the checkpoint's draft head there unless told --no-nextn).
The float32 arithmetic is the Hugging Face converter's (w + 1, -exp), so the values are the ones
it computes.
"""

from __future__ import annotations

import json
from pathlib import Path

import numpy as np

from tests.gguf_models import K_QUANTIZERS, add_tokenizer
from tests.gguf_qwen3next import add_hybrid_keys, tile_value_heads
from tests.gguf_sigmoid_models import _add, _finish

ARCH = "qwen4exp"
# Hugging Face suffix -> GGUF suffix, as stored; and those stored as 1 + w
MOE = {"mlp.gate.weight": "ffn_gate_inp.weight", "mlp.shared_expert.gate_proj.weight": "ffn_gate_shexp.weight",
       "mlp.shared_expert.up_proj.weight": "ffn_up_shexp.weight",
       "mlp.shared_expert.down_proj.weight": "ffn_down_shexp.weight"}
HC = {"input_mix_weight_down.weight": "down.weight", "input_mix_weight_up.weight": "up.weight",
      "block_inject_weight.weight": "inject.weight"}
ATTENTION = {"self_attn.q_proj.weight": "attn_q.weight", "self_attn.k_proj.weight": "attn_k.weight",
             "self_attn.v_proj.weight": "attn_v.weight", "self_attn.o_proj.weight": "attn_output.weight"}
PLUS_ONE = {"self_attn.q_norm.weight": "attn_q_norm.weight", "self_attn.k_norm.weight": "attn_k_norm.weight",
            "self_attn.indexer.q_layernorm.weight": "indexer.q_norm.weight",
            "self_attn.indexer.k_layernorm.weight": "indexer.k_norm.weight",
            "ple.norm_key.weight": "ple_norm_key.weight", "ple.norm_query.weight": "ple_norm_query.weight",
            "ple.norm_conv.weight": "ple_norm_conv.weight"}
PLE = {"ple.key_proj.weight": "ple_key.weight", "ple.value_proj.weight": "ple_value.weight"}
TABLE = "ple.ple_embedding.ngram_embedding."
HASH = {"layer_multipliers": "layer_multipliers", "ngram_heads_offsets": "head_offsets",
        "ngram_heads_vocab_sizes": "head_vocab_sizes"}


def _interval(layer_types: list[str]) -> int:
    """full_attention_interval of a layer pattern that has one (the released one does)."""
    every = layer_types.index("full_attention") + 1
    assert all((t == "full_attention") == ((i + 1) % every == 0) for i, t in enumerate(layer_types))
    return every


def _table(ck, base: str) -> np.ndarray:
    """The PLE layer's n-gram table, its row shards joined in index order."""
    shards, i = [], 0
    while f"{base}{TABLE}shard_{i}.weight" in ck:
        shards.append(ck.read(f"{base}{TABLE}shard_{i}.weight"))
        i += 1
    return np.concatenate(shards) if shards else ck.read(f"{base}{TABLE}weight")


def write_qwen4exp_gguf(hf_dir: Path, path: Path, *, experts: str = "F32", dense: str = "F32",
                        table: str = "F32", mtp: bool = True, compress_ratios: list[int] | None = None,
                        recurrent_layers: bool = False) -> Path:
    """The GGUF of the single-PLE-layer Qwen4-Exp checkpoint in `hf_dir` (text class): routed experts
    as ggml type `experts`, 2-D dense matrices as `dense`, the n-gram table as `table`, the rest F32.
    compress_ratios: written instead of the converter's (for the refusals). recurrent_layers: the
    layer pattern as `attention.recurrent_layers` (a bool per block), which llama.cpp's loader reads
    before `full_attention_interval`, beside an interval of 2 that would mean another pattern."""
    import gguf

    from strata.convert.safetensors_reader import Checkpoint

    cfg = json.loads((hf_dir / "config.json").read_text())
    params = cfg["rope_parameters"]
    n, d, head_dim = cfg["num_hidden_layers"], cfg["hidden_size"], cfg["head_dim"]
    hk, hv = cfg["linear_num_key_heads"], cfg["linear_num_value_heads"]
    dk, dv = cfg["linear_key_head_dim"], cfg["linear_value_head_dim"]
    hi, di = cfg["indexer_n_heads"], cfg["indexer_head_dim"]
    (ple,) = [i - 1 for i in cfg["ple_layer_ids"]]  # llama.cpp's converter writes the one PLE layer 0-based
    heads = (cfg["ngram_size"] - 1) * cfg["heads_per_ngram"]
    blocks = n + (1 if mtp else 0)
    w = gguf.GGUFWriter(str(path), ARCH)
    u32 = lambda key, value: w.add_uint32(f"{ARCH}.{key}", int(value))  # noqa: E731
    arr = lambda key, values, kind: w.add_key_value(f"{ARCH}.{key}", [int(v) for v in values],  # noqa: E731
                                                    gguf.GGUFValueType.ARRAY, sub_type=kind)
    U32, U64 = gguf.GGUFValueType.UINT32, gguf.GGUFValueType.UINT64
    w.add_block_count(blocks)
    w.add_context_length(cfg["max_position_embeddings"])
    w.add_embedding_length(d)
    add_hybrid_keys(w, cfg)
    if recurrent_layers:
        linear = [t == "linear_attention" for t in cfg["layer_types"]] + [False] * (blocks - n)
        w.add_key_value(f"{ARCH}.attention.recurrent_layers", linear, gguf.GGUFValueType.ARRAY,
                        sub_type=gguf.GGUFValueType.BOOL)
        w.add_full_attention_interval(2)
    else:
        w.add_full_attention_interval(_interval(cfg["layer_types"]))
    w.add_rope_dimension_count(int(head_dim * params["partial_rotary_factor"]))
    w.add_rope_dimension_sections(list(params["mrope_section"]) + [0])
    if mtp:
        w.add_nextn_predict_layers(1)
    u32("hyper_connection.count", cfg["hc_count"])
    u32("hyper_connection.low_rank", cfg["hc_lowrank"])
    u32("attention.indexer.head_count", hi)
    u32("attention.indexer.key_length", di)
    u32("attention.indexer.top_k", cfg["indexer_budget"])
    ratios = [cfg["indexer_compress_ratio"] if t == "full_attention" else 0 for t in cfg["layer_types"]]
    arr("attention.compress_ratios", compress_ratios or ratios + [0] * (blocks - n), U32)
    arr("ple.layers", [ple], U32)
    u32("ple.ngram_size", cfg["ngram_size"])
    u32("ple.heads_per_ngram", cfg["heads_per_ngram"])
    u32("ple.conv_kernel", cfg["ple_conv_kernel_size"])
    u32("ple.eos_token_id", cfg["eos_token_id"])
    u32("embedding_length_per_layer_input", cfg["ple_embed_dim"] // heads)
    add_tokenizer(w, hf_dir, cfg["vocab_size"])
    one = np.float32(1.0)
    with Checkpoint(hf_dir) as ck:
        for buf, key in HASH.items():  # int64 in the checkpoint, UINT64 metadata in the file
            arr(f"ple.{key}", ck.read_raw(f"model.layers.{ple}.ple.ple_embedding.{buf}", np.dtype("<i8")), U64)
        _add(w, "token_embd.weight", ck.read("model.embed_tokens.weight"), dense)
        _add(w, "output.weight", ck.read("lm_head.weight"), dense)
        mixer = "model.hyper_connection_mixer."
        _add(w, "output_hc_norm.weight", ck.read(mixer + "hc_norm.weight") + one, "F32")
        _add(w, "output_hc_down.weight", ck.read(mixer + "input_mix_weight_down.weight"), dense)
        _add(w, "output_hc_up.weight", ck.read(mixer + "input_mix_weight_up.weight"), dense)
        rows = _table(ck, f"model.layers.{ple}.")
        if table in K_QUANTIZERS:  # gguf has no quantizer for these (IQ4_NL: a UD file's table type)
            w.add_tensor("per_layer_token_embd.weight", K_QUANTIZERS[table](rows),
                         raw_dtype=getattr(gguf.GGMLQuantizationType, table))
        else:
            _add(w, "per_layer_token_embd.weight", rows, table)
        for l in range(blocks):
            base = f"model.layers.{min(l, n - 1)}."  # the MTP block: the last layer's tensors again
            for hf_hc, g_hc in (("attn_hyper_connection.", "hc_attn_"), ("mlp_hyper_connection.", "hc_ffn_")):
                _add(w, f"blk.{l}.{g_hc}norm.weight", ck.read(base + hf_hc + "hc_norm.weight") + one, "F32")
                for hf_suffix, g_suffix in HC.items():
                    _add(w, f"blk.{l}.{g_hc}{g_suffix}", ck.read(base + hf_hc + hf_suffix), dense)
            for hf_suffix, g_suffix in MOE.items():
                x = ck.read(base + hf_suffix)
                _add(w, f"blk.{l}.{g_suffix}", x, "F32" if g_suffix == "ffn_gate_inp.weight" else dense)
            _add(w, f"blk.{l}.ffn_gate_inp_shexp.weight", ck.read(base + "mlp.shared_expert_gate.weight").reshape(-1),
                 "F32")
            for hf_suffix, g_suffix in PLUS_ONE.items():
                if base + hf_suffix in ck and (l < n or not hf_suffix.startswith("ple.")):
                    _add(w, f"blk.{l}.{g_suffix}", ck.read(base + hf_suffix) + one, "F32")
            if base + "self_attn.q_proj.weight" in ck:
                for hf_suffix, g_suffix in ATTENTION.items():
                    _add(w, f"blk.{l}.{g_suffix}", ck.read(base + hf_suffix), dense)
                qk = ck.read(base + "self_attn.indexer.index_qk_proj.weight")
                _add(w, f"blk.{l}.indexer.q_proj.weight", qk[:hi * di], dense)
                _add(w, f"blk.{l}.indexer.k_proj.weight", qk[hi * di:], dense)
            else:  # Qwen3.5's DeltaNet, value heads tiled where there are more than key heads
                a = base + "linear_attn."
                tile = lambda x, axis, hd: tile_value_heads(x, axis, hk, hv // hk, hd)  # noqa: E731
                qkv, conv = ck.read(a + "in_proj_qkv.weight"), ck.read(a + "conv1d.weight").squeeze(1)
                _add(w, f"blk.{l}.attn_qkv.weight", np.concatenate([qkv[:2 * hk * dk], tile(qkv[2 * hk * dk:], 0, dv)]),
                     dense)
                _add(w, f"blk.{l}.attn_gate.weight", tile(ck.read(a + "in_proj_z.weight"), 0, dv), dense)
                _add(w, f"blk.{l}.ssm_beta.weight", tile(ck.read(a + "in_proj_b.weight"), 0, 1), "F32")
                _add(w, f"blk.{l}.ssm_alpha.weight", tile(ck.read(a + "in_proj_a.weight"), 0, 1), "F32")
                _add(w, f"blk.{l}.ssm_a", tile(-np.exp(ck.read(a + "A_log")), 0, 1), "F32")
                _add(w, f"blk.{l}.ssm_dt.bias", tile(ck.read(a + "dt_bias"), 0, 1), "F32")
                _add(w, f"blk.{l}.ssm_conv1d.weight", np.concatenate([conv[:2 * hk * dk], tile(conv[2 * hk * dk:], 0, dv)]),
                     "F32")
                _add(w, f"blk.{l}.ssm_norm.weight", ck.read(a + "norm.weight"), "F32")
                _add(w, f"blk.{l}.ssm_out.weight", tile(ck.read(a + "out_proj.weight"), 1, dv), dense)
            if l == ple:
                for hf_suffix, g_suffix in PLE.items():
                    _add(w, f"blk.{l}.{g_suffix}", ck.read(base + hf_suffix), dense)
                _add(w, f"blk.{l}.ple_conv1d.weight", ck.read(base + "ple.conv1d.weight").squeeze(1), "F32")
            for proj in ("gate_proj", "up_proj", "down_proj"):
                stack = np.stack([ck.read(base + f"mlp.experts.{e}.{proj}.weight") for e in range(cfg["num_experts"])])
                _add(w, f"blk.{l}.ffn_{proj.split('_')[0]}_exps.weight", stack, experts)
            if l >= n:  # the draft head's own tensors (random: strata skips the block)
                rng = np.random.default_rng(l)
                for t, shape in (("eh_proj", (d, 2 * d)), ("enorm", (d,)), ("hnorm", (cfg["hc_count"] * d,))):
                    _add(w, f"blk.{l}.nextn.{t}.weight", rng.standard_normal(shape).astype(np.float32), "F32")
    return _finish(w, path)
