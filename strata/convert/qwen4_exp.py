"""Qwen4-Exp: hyper-connections, gated DeltaNet and indexed (QSA) attention, PLE n-gram embeddings.

Two `model_type`s: `qwen4_exp_text` (the text-only class) and `qwen4_exp` (the multimodal class:
the language model's config under `text_config`, its weights under `model.language_model.`, a
vision tower under `model.visual.` skipped with a note: strata runs the language model on text).
The multi-token-prediction layer (`mtp.*`) is skipped with a note (strata decodes one token).

Config keys are handled as `_TEXT_KEYS` lists (any other is refused, naming it). Tensors, from
transformers' modeling file (models/qwen4_exp), with these derivations:
- every zero-centred RMSNorm (`x * (1 + w)`: hyper-connection norms, the PLE norms, q/k norms,
  the indexer's q/k norms) gets the +1 folded in; the DeltaNet's gated RMSNorm is copied;
- attention `q_proj` [H * 2 hd, D] is per head [query; gate] (as the hybrid families');
- each PLE layer's n-gram table is saved in `split_ngram_parts` row shards
  (`ngram_embedding.shard_{i}.weight`) and concatenated (an unsharded `ngram_embedding.weight`
  is read as it is); the hash buffers saved beside it (multipliers, prime sizes, offsets) are
  checked equal to what strata derives from the config (reference/ngram_hash.py) and not stored;
- a checkpoint whose experts were pruned (fewer router rows and experts than its config's
  `num_experts`) converts as an ordinary model of that many experts (read from the router).
- the DeltaNet's output gate: `output_gate_type` (else `hidden_act`), silu or sigmoid (the
  released checkpoint's: `deltanet_sigmoid_gate`).
llama.cpp's `qwen4exp` GGUF (a GgufCheckpoint): its config keys come from gguf_checkpoint's
`_qwen4exp_config`, its stored hash constants and tensors from strata.convert.qwen4_exp_gguf.
The n-gram tables (tens of GB in the published checkpoint) do not go into the model file: the
config says `ple_row_store` and `write_row_store` streams them, shard by shard, into the row store
`<name>.ngrams` (strata.convert.ngram_tables; docs/formats.md §7), whose identity the model file
records.
"""

from __future__ import annotations

import dataclasses

import numpy as np

from strata.convert.common import ExpertTensors, Family, base_fields
from strata.convert.gguf_checkpoint import GgufCheckpoint
from strata.convert.hf_config import HFConfig
from strata.convert.qwen4_exp_gguf import gguf_hash_fields, gguf_tensor_plan
from strata.convert.qwen_hybrid import (_plus_one, _refuse_unknown, _rope, _split_q_gate, gated_hybrid_fields,
                                        layer_types_of, nested_text_config, refuse_attention_bias,
                                        refuse_dense_layers, skipped_by_prefix)
from strata.convert.safetensors_reader import Checkpoint
from strata.convert.ngram_tables import find_ngram_tables, write_ngram_tables
from strata.convert.tensor_plan import Derived, TensorPlan, source_names
from strata.formats.quant_types import QuantType
from strata.errors import ConfigError
from strata.model_config import LayerType, Mixer, ModelConfig, TensorNames
from strata.families.qwen4_exp import HC_FINAL, Qwen4Names, ngram_heads, ple_layers
from strata.reference.ple import ple_table_items
from strata.reference.ngram_hash import NgramHash

TEXT = "qwen4_exp_text"
MULTIMODAL = "qwen4_exp"
PREFIX = {MULTIMODAL: "model.language_model."}  # else "model."
DEFAULT_PARTIAL_ROTARY = 1.0  # transformers' Qwen4-Exp config sets none (Qwen3.5's default is 0.25)
SKIPPED_PREFIXES = {"mtp.": "the multi-token-prediction layer (mtp.*): strata decodes one token at a time",
                    "model.visual.": "the vision tower (model.visual.*): strata runs the language model on text"}
HASH_BUFFERS = ("layer_multipliers", "ngram_heads_vocab_sizes", "ngram_heads_offsets")
# The row store's default row type: a bfloat16 checkpoint's tables (the published one's) keep their
# size and their 7 mantissa bits in F16's 10 (values past F16's range are refused in one line)
DEFAULT_ROW_TYPE = QuantType.F16

_READ = {"vocab_size", "hidden_size", "num_hidden_layers", "num_attention_heads", "num_key_value_heads", "head_dim",
         "num_experts", "num_experts_per_tok", "moe_intermediate_size", "shared_expert_intermediate_size",
         "rms_norm_eps", "tie_word_embeddings", "max_position_embeddings", "layer_types", "full_attention_interval",
         "linear_conv_kernel_dim", "linear_key_head_dim", "linear_value_head_dim", "linear_num_key_heads",
         "linear_num_value_heads", "rope_parameters", "rope_theta", "rope_scaling", "partial_rotary_factor",
         "norm_topk_prob", "hidden_act", "model_type", "hc_count", "hc_lowrank", "ple_layer_ids", "ple_embed_dim",
         "ple_conv_kernel_size", "ngram_size", "heads_per_ngram", "ngram_vocab_size_base",
         "make_ngram_vocab_size_divisible_by", "seed", "indexer_n_heads", "indexer_head_dim", "indexer_budget",
         "indexer_compress_ratio", "eos_token_id"}
_CHECK = {"attention_bias", "output_gate_type", "indexer_kv_heads", "quantization_config", "mlp_only_layers",
          "decoder_sparse_step"}
_IGNORE = {"attention_dropout", "initializer_range", "output_router_logits", "router_aux_loss_coef", "use_cache",
           "bos_token_id", "pad_token_id", "dtype", "torch_dtype", "transformers_version", "architectures",
           "number_of_conv_states",  # transformers' cache bookkeeping
           "split_ngram_parts",  # how the tables were sharded on disk: read from the tensors
           "mtp_num_hidden_layers", "mtp_use_dedicated_embeddings", "_name_or_path"}
_TEXT_KEYS = _READ | _CHECK | _IGNORE


def text_config(hf: HFConfig) -> HFConfig:
    """The language model's config: `text_config` of the multimodal class, else the config itself."""
    return nested_text_config(hf, MULTIMODAL)


def _layer_types(hf: HFConfig, n_layers: int) -> tuple[LayerType, ...]:
    # the published config says full_attention for the layers that carry an indexer
    kinds = {"linear_attention": Mixer.DELTANET, "indexed_attention": Mixer.INDEXED_ATTENTION,
             "full_attention": Mixer.INDEXED_ATTENTION}
    return layer_types_of(hf, n_layers, kinds, "indexed_attention")


OUTPUT_GATES = ("silu", "sigmoid")  # the DeltaNet's gated RMSNorm (reference/deltanet.py output_gate)


def _output_gate(hf: HFConfig) -> str:
    """The DeltaNet's output gate: output_gate_type, else hidden_act (transformers' rule)."""
    gate = hf.get("output_gate_type", default=None) or hf.get("hidden_act", default="silu")
    if gate not in OUTPUT_GATES:
        raise hf.unsupported(f"output_gate_type = {gate!r}", " or ".join(repr(g) for g in OUTPUT_GATES))
    return gate


def _check_values(hf: HFConfig) -> None:
    """The _CHECK keys: only what strata computes."""
    refuse_attention_bias(hf)
    _output_gate(hf)
    if hf.get_int("indexer_kv_heads", default=1) != 1:
        raise hf.unsupported(f"indexer_kv_heads = {hf.get('indexer_kv_heads')}", "one indexer key head")
    refuse_dense_layers(hf)


def _eos(hf: HFConfig) -> int:
    eos = hf.get("eos_token_id", default=None)
    eos = eos[0] if isinstance(eos, list) and eos else eos  # transformers hashes with the first
    if not isinstance(eos, int):
        raise ConfigError(f"{hf.path}: PLE layers need an integer eos_token_id (the n-gram shifts stop there), "
                          f"got {eos!r}")
    return eos


def _full_rotary_default(hf: HFConfig) -> HFConfig:
    """Qwen4-Exp rotates the whole head unless told otherwise (transformers' default rope reads
    partial_rotary_factor with a default of 1.0 here; the Qwen3.5 configs default to 0.25)."""
    params = hf.raw.get("rope_parameters")
    if "partial_rotary_factor" in hf.raw or (isinstance(params, dict) and "partial_rotary_factor" in params):
        return hf
    return dataclasses.replace(hf, raw={**hf.raw, "partial_rotary_factor": DEFAULT_PARTIAL_ROTARY})


def _router_rows(ckpt: Checkpoint, prefix: str, configured: int) -> int:
    """The experts the checkpoint holds: its layer-0 router's rows (a pruned checkpoint has fewer
    than its config's num_experts)."""
    name = prefix + "layers.0.mlp.gate.weight"
    return int(ckpt.shape(name)[0]) if name in ckpt else configured


def qwen4_config(hf: HFConfig, ckpt: Checkpoint) -> ModelConfig:
    text = text_config(hf)
    _refuse_unknown(text, _TEXT_KEYS, " in text_config" if text is not hf else "")
    _check_values(text)
    fields = base_fields(text, ckpt)
    rope = _rope(_full_rotary_default(text), fields["head_dim"])
    fields["n_experts"] = _router_rows(ckpt, PREFIX.get(hf.model_type, "model."), fields["n_experts"])
    ple = text.get("ple_layer_ids", default=None) or []
    if not isinstance(ple, list) or not all(isinstance(i, int) for i in ple):
        raise ConfigError(f"{hf.path}: ple_layer_ids must be a list of layer ids, got {ple!r}")
    hidden = fields["hidden_size"]
    fields.update(gated_hybrid_fields(hf, text, fields, rope=rope, layer_types=_layer_types(text, fields["n_layers"])))
    fields.update(
        shared_ffn_size=text.get_int("shared_expert_intermediate_size"),
        hc_count=text.get_int("hc_count", default=4), hc_lowrank=text.get_int("hc_lowrank", default=320),
        indexer_heads=text.get_int("indexer_n_heads", default=0),
        indexer_head_dim=text.get_int("indexer_head_dim", default=0),
        indexer_budget=text.get_int("indexer_budget", default=0),
        indexer_block=text.get_int("indexer_compress_ratio", default=0),
        deltanet_sigmoid_gate=_output_gate(text) == "sigmoid",
        # transformers numbers PLE layers from 1; strata's layers are 0-based
        ple_layer_ids=",".join(str(i - 1) for i in sorted(set(ple))),
    )
    if ple:
        fields.update(
            ple_embed_dim=text.get_int("ple_embed_dim", default=hidden),
            ple_conv_kernel=text.get_int("ple_conv_kernel_size", default=4),
            ngram_size=text.get_int("ngram_size", default=3), ngram_heads_per_order=text.get_int("heads_per_ngram",
                                                                                                 default=8),
            ngram_vocab_base=text.get_int("ngram_vocab_size_base", default=20_000_000),
            ngram_vocab_divisor=text.get_int("make_ngram_vocab_size_divisible_by", default=128),
            ngram_seed=text.get_int("seed", default=1234), ngram_eos_token=_eos(text),
            ple_row_store=True,  # the tables go to <name>.ngrams (write_row_store), not the model file
        )
        if isinstance(ckpt, GgufCheckpoint):
            fields.update(gguf_hash_fields(ckpt, fields))
    return ModelConfig.from_dict(fields)


# ---------------------------------------------------------------- tensors


def _hc_sources(cfg: ModelConfig, src: str, dst: str, *, inject: bool = True) -> dict[str, str | Derived]:
    q, s = Qwen4Names, cfg.qwen4.hc_count * cfg.hidden_size
    out: dict[str, str | Derived] = {q.hc(dst, q.hc_norm): _plus_one(src + "hc_norm.weight", (s,)),
                                     q.hc(dst, q.hc_down): src + "input_mix_weight_down.weight",
                                     q.hc(dst, q.hc_up): src + "input_mix_weight_up.weight"}
    if inject:
        out[q.hc(dst, q.hc_inject)] = src + "block_inject_weight.weight"
    return out


def _ngram_table(ckpt: Checkpoint, emb: str, rows: int, width: int) -> str | Derived:
    """The layer's table: the unsharded tensor, or its row shards in order, concatenated."""
    if emb + "weight" in ckpt:
        return emb + "weight"
    shards, i = [], 0
    while f"{emb}shard_{i}.weight" in ckpt:
        shards.append((f"{emb}shard_{i}.weight", tuple(ckpt.shape(f"{emb}shard_{i}.weight"))))
        i += 1
    if not shards or sum(s[0] for _, s in shards) != rows or any(s[1:] != (width,) for _, s in shards):
        found = [list(s) for _, s in shards]
        raise ConfigError(f"{ckpt.directory}: {emb}weight: the n-gram table's shards {found} do not make "
                          f"[{rows}, {width}] rows")
    return Derived(tuple(shards), lambda *parts: np.concatenate(parts, axis=0), f"{len(shards)} row shards")


def _check_hash_buffers(ckpt: Checkpoint, emb: str, h: NgramHash) -> list[str]:
    """The hash buffers transformers saved equal strata's derivation (else the ids would differ)."""
    want = {"layer_multipliers": h.multipliers, "ngram_heads_vocab_sizes": h.head_sizes,
            "ngram_heads_offsets": h.head_offsets}
    names = []
    for buf in HASH_BUFFERS:
        name = emb.rsplit("ngram_embedding.", 1)[0] + buf
        if name not in ckpt:
            continue
        found = ckpt.read_raw(name, np.dtype("<i8")) if ckpt.info(name).dtype == "I64" else None
        if found is None or not np.array_equal(found, want[buf]):
            raise ConfigError(f"{ckpt.directory}: {name} differs from the hash strata derives from the config "
                              "(ngram_vocab_size_base, seed, vocab_size)")
        names.append(name)
    return names


def _layer_sources(cfg: ModelConfig, ckpt: Checkpoint, layer: int, prefix: str):
    """(strata suffix -> source, checked hash buffers) for one decoder layer."""
    n, q = TensorNames, Qwen4Names
    lp = f"{prefix}layers.{layer}."
    out: dict[str, str | Derived] = {
        n.router: lp + "mlp.gate.weight",
        n.shexp_gate: lp + "mlp.shared_expert.gate_proj.weight", n.shexp_up: lp + "mlp.shared_expert.up_proj.weight",
        n.shexp_down: lp + "mlp.shared_expert.down_proj.weight", n.shexp_gate_inp: lp + "mlp.shared_expert_gate.weight",
    }
    out.update(_hc_sources(cfg, lp + "attn_hyper_connection.", "hc_attn"))
    out.update(_hc_sources(cfg, lp + "mlp_hyper_connection.", "hc_ffn"))
    buffers: list[str] = []
    if cfg.kinds[layer].mixer is Mixer.INDEXED_ATTENTION:
        a = lp + "self_attn."
        di = cfg.qwen4.indexer_head_dim
        out.update({n.attn_q: _split_q_gate(cfg, a + "q_proj.weight", 0),
                    n.attn_gate: _split_q_gate(cfg, a + "q_proj.weight", 1),
                    n.attn_k: a + "k_proj.weight", n.attn_v: a + "v_proj.weight", n.attn_output: a + "o_proj.weight",
                    n.attn_q_norm: _plus_one(a + "q_norm.weight", (cfg.head_dim,)),
                    n.attn_k_norm: _plus_one(a + "k_norm.weight", (cfg.head_dim,)),
                    q.idx_qk: a + "indexer.index_qk_proj.weight",
                    q.idx_q_norm: _plus_one(a + "indexer.q_layernorm.weight", (di,)),
                    q.idx_k_norm: _plus_one(a + "indexer.k_layernorm.weight", (di,))})
        return out, buffers
    a = lp + "linear_attn."
    hv = cfg.deltanet.linear_v_heads
    out.update({n.ssm_qkv: a + "in_proj_qkv.weight", n.ssm_z: a + "in_proj_z.weight",
                n.ssm_beta: a + "in_proj_b.weight", n.ssm_alpha: a + "in_proj_a.weight",
                n.ssm_conv: a + "conv1d.weight",  # [C, 1, K] -> [C, K]: a unit axis
                n.ssm_a: Derived(((a + "A_log", (hv,)),), lambda w: -np.exp(w), "-exp"),
                n.ssm_dt_bias: a + "dt_bias", n.ssm_norm: a + "norm.weight", n.ssm_out: a + "out_proj.weight"})
    if layer in ple_layers(cfg):
        p, s = lp + "ple.", cfg.qwen4.hc_count * cfg.hidden_size
        h = NgramHash.of(cfg, ple_layers(cfg).index(layer))
        emb = p + "ple_embedding.ngram_embedding."
        out.update({q.ple_key: p + "key_proj.weight", q.ple_value: p + "value_proj.weight",
                    q.ple_key_norm: _plus_one(p + "norm_key.weight", (s,)),
                    q.ple_query_norm: _plus_one(p + "norm_query.weight", (s,)),
                    q.ple_conv_norm: _plus_one(p + "norm_conv.weight", (s,)),
                    q.ple_conv: p + "conv1d.weight"})  # [S, 1, K] -> [S, K]
        table = _ngram_table(ckpt, emb, h.table_rows, cfg.qwen4.ple_embed_dim // ngram_heads(cfg))  # shapes checked
        if cfg.qwen4.ple_row_store:  # written by write_row_store: the model file has no place for it
            buffers = list(source_names({"table": table}))
        else:
            out[q.ple_ngram] = table
        buffers += _check_hash_buffers(ckpt, emb, h)
    return out, buffers


def tensor_plan(cfg: ModelConfig, ckpt: Checkpoint) -> TensorPlan:
    """Where every strata tensor of a Qwen4-Exp checkpoint comes from (see the module doc)."""
    if isinstance(ckpt, GgufCheckpoint):
        return gguf_tensor_plan(cfg, ckpt)
    n = TensorNames
    prefix = PREFIX.get(cfg.architecture, "model.")
    sources: dict[str, str | Derived] = {n.token_embd: prefix + "embed_tokens.weight"}
    sources.update(_hc_sources(cfg, prefix + "hyper_connection_mixer.", HC_FINAL, inject=False))
    if not cfg.tie_embeddings:
        sources[n.output] = "lm_head.weight"
    skipped: list[str] = []
    for layer in range(cfg.n_layers):
        layer_sources, buffers = _layer_sources(cfg, ckpt, layer, prefix)
        sources.update({n.block(layer, k): v for k, v in layer_sources.items()})
        skipped += buffers
    experts = ExpertTensors(ckpt, cfg, "mlp", ("gate_proj", "up_proj", "down_proj"),
                            layer_prefix=prefix + "layers.{}.")
    notes = []
    hashes = [t for t in skipped if t.rsplit(".", 1)[-1] in HASH_BUFFERS]
    if hashes:
        notes.append(f"checked {len(hashes)} n-gram hash buffers against the config's hash (not stored)")
    names, skip_notes = skipped_by_prefix(ckpt, SKIPPED_PREFIXES)
    return TensorPlan(experts, sources, tuple(skipped + names), tuple(notes + skip_notes))


def ckpt_table_shape(cfg: ModelConfig, layer: int) -> tuple[int, int]:
    """A PLE layer's table [rows, width] (the config's hash decides the rows)."""
    return NgramHash.of(cfg, ple_layers(cfg).index(layer)).table_rows, cfg.qwen4.ple_embed_dim // ngram_heads(cfg)


def ngram_tables(cfg: ModelConfig, dense):
    """(PLE index, table [rows, width]) per PLE layer, in order, of a model whose tables are
    among its dense weights (`ple_row_store` False: the made test models)."""
    return ple_table_items(cfg, dense)


def write_row_store(cfg: ModelConfig, ckpt: Checkpoint, path, *, qtype: QuantType = DEFAULT_ROW_TYPE,
                    progress: bool = False):
    """The checkpoint's n-gram tables into the row store at `path` (atomically), streamed a row
    range at a time (strata.convert.ngram_tables), keyed by PLE index; -> the open NgramRowsFile."""
    prefix = "model." if isinstance(ckpt, GgufCheckpoint) else PREFIX.get(cfg.architecture, "model.")
    tables = find_ngram_tables(ckpt, prefix=prefix)
    want = {layer: ckpt_table_shape(cfg, layer) for layer in ple_layers(cfg)}
    found = {layer: (t.rows, t.width) for layer, t in tables.items()}
    if found != want:
        raise ConfigError(f"{ckpt.directory}: ple_layer_ids: the checkpoint's n-gram tables {found} are not the "
                          f"config's {want} (layer: rows, width)")
    return write_ngram_tables(ckpt, path, tables, qtype=qtype, progress=progress)


_FEATURES = ("hyper-connections, gated DeltaNet and indexed (QSA) attention layers, PLE n-gram embeddings "
             "(sharded tables), partial rotary, zero-centred norms, routed SwiGLU experts (per expert or fused, "
             "pruned or not), a gated shared expert")
QWEN4_EXP = Family(name="Qwen4-Exp", model_types=(TEXT, MULTIMODAL), model_config=qwen4_config,
                   supported_features=_FEATURES, tensor_plan=tensor_plan, row_store=write_row_store)
