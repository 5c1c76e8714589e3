"""llama.cpp's `qwen4exp` GGUF (Qwen3.8-Flash-Next) as strata's Qwen4-Exp: the stored n-gram hash
(`gguf_hash_fields`: the config's stored constants and table rows) and where every strata tensor
comes from (`gguf_tensor_plan`). The config keys are read by gguf_checkpoint's `_qwen4exp_config`
as the Hugging Face config keys strata.convert.qwen4_exp reads; docs/convert.md gives the mapping.
"""

from __future__ import annotations

import numpy as np

from strata.convert.gguf_checkpoint import GgufCheckpoint, GgufExpertTensors, qwen4exp_hash_constants
from strata.convert.qwen_hybrid import _qwen35_gguf_deltanet, _split_q_gate
from strata.convert.tensor_plan import Derived, TensorPlan
from strata.errors import ConfigError
from strata.families.qwen4_exp import HC_FINAL, Qwen4Names, hash_constant_fields, ple_layers
from strata.model_config import Mixer, ModelConfig, TensorNames


def gguf_hash_fields(ckpt: GgufCheckpoint, fields: dict) -> dict:
    """A llama.cpp qwen4exp file's n-gram hash as it stores it: its constants (no seed, no prime
    base, no divisor: none is in the file, nor needed) and its one table's rows as stored."""
    heads = (fields["ngram_size"] - 1) * fields["ngram_heads_per_order"]
    if ckpt.ple_table is None:
        raise ConfigError(f"{ckpt.path}: ple.layers names a PLE layer, but the file has no per_layer_token_embd.weight "
                          "(the n-gram table)")
    constants = qwen4exp_hash_constants(ckpt, fields["ngram_size"], heads)
    return {**hash_constant_fields([constants]), "ngram_table_rows": ckpt.shape(ckpt.ple_table)[0],
            "ngram_seed": 0, "ngram_vocab_base": 0, "ngram_vocab_divisor": 1}


def gguf_tensor_plan(cfg: ModelConfig, ckpt: GgufCheckpoint) -> TensorPlan:
    """Where every strata tensor of llama.cpp's `qwen4exp` GGUF comes from. Its converter already
    made most of them what strata computes with: every zero-centred norm (hyper-connection, q/k,
    indexer and PLE norms) holds 1 + w, and the DeltaNet tensors are qwen35moe's (value heads tiled:
    put back grouped by qwen_hybrid's plan); what is left: `attn_q` holds each head's [query; gate]
    (split as from Hugging Face), the indexer's `indexer.q_proj` / `indexer.k_proj` are the
    checkpoint's index_qk_proj split at Hi di rows (joined again), `ple_conv1d` is [S, K]. The one
    n-gram table goes to the row store (write_row_store), the trailing MTP block
    (`nextn_predict_layers`) is skipped with a note."""
    n, q, d = TensorNames, Qwen4Names, cfg.hidden_size
    key = ckpt.key  # the name ckpt.tensors lists a GGUF tensor under
    sources: dict[str, str | Derived] = {n.token_embd: key("token_embd.weight"),
                                         q.hc(HC_FINAL, q.hc_norm): key("output_hc_norm.weight"),
                                         q.hc(HC_FINAL, q.hc_down): key("output_hc_down.weight"),
                                         q.hc(HC_FINAL, q.hc_up): key("output_hc_up.weight")}
    if not cfg.tie_embeddings:
        sources[n.output] = key("output.weight")
    hi, di = cfg.qwen4.indexer_heads, cfg.qwen4.indexer_head_dim
    for layer in range(cfg.n_layers):
        b = f"blk.{layer}."
        out: dict[str, str | Derived] = {
            n.router: key(b + "ffn_gate_inp.weight"), n.shexp_gate: key(b + "ffn_gate_shexp.weight"),
            n.shexp_up: key(b + "ffn_up_shexp.weight"), n.shexp_down: key(b + "ffn_down_shexp.weight"),
            n.shexp_gate_inp: key(b + "ffn_gate_inp_shexp.weight"),
        }
        for hc in ("hc_attn", "hc_ffn"):
            for part in (q.hc_norm, q.hc_down, q.hc_up, q.hc_inject):
                out[q.hc(hc, part)] = key(f"{b}{hc}_{part}.weight")
        if cfg.kinds[layer].mixer is Mixer.INDEXED_ATTENTION:
            wq = key(b + "attn_q.weight")
            idx = ((key(b + "indexer.q_proj.weight"), (hi * di, d)), (key(b + "indexer.k_proj.weight"), (di, d)))
            out.update({n.attn_q: _split_q_gate(cfg, wq, 0), n.attn_gate: _split_q_gate(cfg, wq, 1),
                        n.attn_k: key(b + "attn_k.weight"), n.attn_v: key(b + "attn_v.weight"),
                        n.attn_output: key(b + "attn_output.weight"), n.attn_q_norm: key(b + "attn_q_norm.weight"),
                        n.attn_k_norm: key(b + "attn_k_norm.weight"),
                        q.idx_qk: Derived(idx, lambda wq_, wk_: np.concatenate([wq_, wk_]), "indexer q | k rows"),
                        q.idx_q_norm: key(b + "indexer.q_norm.weight"), q.idx_k_norm: key(b + "indexer.k_norm.weight")})
        else:
            out.update(_qwen35_gguf_deltanet(cfg, ckpt, b))
        if layer in ple_layers(cfg):
            out.update({q.ple_key: key(b + "ple_key.weight"), q.ple_value: key(b + "ple_value.weight"),
                        q.ple_key_norm: key(b + "ple_norm_key.weight"),
                        q.ple_query_norm: key(b + "ple_norm_query.weight"),
                        q.ple_conv_norm: key(b + "ple_norm_conv.weight"), q.ple_conv: key(b + "ple_conv1d.weight")})
        sources.update({n.block(layer, k): v for k, v in out.items()})
    skipped = [ckpt.ple_table] if ckpt.ple_table is not None else []  # into the row store
    mtp = tuple(f"{p}{cfg.n_layers}." for p in ("blk.", "model.layers."))  # the trailing MTP block
    dropped = [t for t in ckpt.tensors if t.startswith(mtp)]
    notes = ([f"skipped the multi-token-prediction block (blk.{cfg.n_layers}.*): {len(dropped)} tensors"]
             if dropped else [])
    if cfg.qwen4.ngram_multipliers:
        notes.append("n-gram hash: the file's stored constants (ple.layer_multipliers, head_vocab_sizes, head_offsets)")
    return TensorPlan(GgufExpertTensors(ckpt, cfg), sources, tuple(skipped + dropped), tuple(notes))
