"""A made Qwen3-MoE-kind model (strata.testing.models.make_model) written as a llama.cpp GGUF:
architecture `qwen3moe`, its `{arch}.*` keys, llama.cpp's tensor names, the routed experts stacked
as `blk.L.ffn_{gate,up,down}_exps` [E, rows, blocks] with every block copied bit for bit from the
`.experts` file, the byte-level tokenizer as `tokenizer.ggml.*` (gpt2 model and pre-tokenizer,
no merges). Benchmarks run llama.cpp and strata on the one file this writes (`strata convert`
keeps the blocks as stored), so both compute on the same weights; tensors stream to disk one at a
time, so a model larger than memory can be written."""

from __future__ import annotations

from pathlib import Path

import numpy as np

from strata.formats.quant_types import QuantType
from strata.model_config import QKNorm
from strata.reference.quants import to_blocks

__all__ = ["export_qwen3moe_gguf"]

ARCH = "qwen3moe"
_EXPERT_TENSORS = (("gate", "ffn_gate_exps"), ("up", "ffn_up_exps"), ("down", "ffn_down_exps"))


def _check_exportable(cfg) -> None:
    """Qwen3-MoE's layer, nothing else: what llama.cpp's qwen3moe graph computes."""
    wrong = [what for what, bad in (
        ("a shared expert", cfg.shared_ffn_size > 0), ("per-head q/k norms", cfg.qk_norm is not QKNorm.PER_HEAD),
        ("every layer MoE", cfg.dense_ffn_size > 0), ("attention only", bool(cfg.layer_types)),
        ("untied head", cfg.tie_embeddings)) if bad]
    if wrong:
        raise ValueError(f"export_qwen3moe_gguf: the model is not Qwen3-MoE's kind (needs {', '.join(wrong)}); "
                         "make it with shared_ffn_size=0 and the tiny/demo shape's attention")


def export_qwen3moe_gguf(model_path: str | Path, out: str | Path, *, progress: bool = False) -> Path:
    """Write `out` (a llama.cpp GGUF) from the strata model at `model_path` (`x.gguf` + `x.experts`).

    Shapes: each stacked expert tensor is [E, rows, row_bytes] uint8 of the experts' own ggml type
    (Q8_0 or Q4_0: ggml's blocks), dense tensors as the strata file stores them (ggml types)."""
    import gguf

    import strata
    from strata.formats.gguf_file import open_gguf

    model = strata.load(model_path)
    cfg, experts = model.cfg, model.experts_file
    qtype = QuantType(experts.header.qtype)
    try:
        _check_exportable(cfg)
        if qtype not in (QuantType.Q8_0, QuantType.Q4_0, QuantType.F32, QuantType.F16):
            raise ValueError(f"export_qwen3moe_gguf: {qtype.name} experts have no ggml type (Q8_0, Q4_0, F16, F32 do)")
    except ValueError:
        model.close()
        raise
    dense = open_gguf(model.model_path)
    w = gguf.GGUFWriter(str(out), ARCH)
    w.add_block_count(cfg.n_layers)
    w.add_context_length(cfg.max_context)
    w.add_embedding_length(cfg.hidden_size)
    w.add_feed_forward_length(cfg.expert_ffn_size)
    w.add_expert_feed_forward_length(cfg.expert_ffn_size)
    w.add_head_count(cfg.n_heads)
    w.add_head_count_kv(cfg.n_kv_heads)
    w.add_key_length(cfg.head_dim)
    w.add_value_length(cfg.head_dim)
    w.add_rope_freq_base(cfg.rope_theta)
    w.add_layer_norm_rms_eps(cfg.rms_norm_eps)
    w.add_expert_count(cfg.n_experts)
    w.add_expert_used_count(cfg.n_experts_per_token)
    _add_tokenizer(w, model.tokenizer, cfg.vocab_size)

    plan: list[tuple[str, object]] = []  # (name, source) in file order
    for name, t in dense.tensors.items():
        plan.append((name, ("dense", t)))
    for layer in range(cfg.n_layers):
        for proj, g in _EXPERT_TENSORS:
            plan.append((f"blk.{layer}.{g}.weight", ("experts", layer, proj)))

    def stacked(layer: int, proj: str) -> np.ndarray:
        return np.stack([to_blocks(experts.expert(layer, e).projection(proj)) for e in range(cfg.n_experts)])

    def data(source) -> tuple[np.ndarray, int]:
        if source[0] == "dense":
            t = source[1]
            return np.asarray(dense.raw(t)), int(t.ggml_type)
        return stacked(source[1], source[2]), int(qtype)

    # tensor infos first (shapes from one expert's blocks), then the data, one tensor at a time
    for name, source in plan:
        if source[0] == "dense":
            t = source[1]
            raw = np.asarray(dense.raw(t))
            w.add_tensor_info(name, raw.shape, raw.dtype, raw.nbytes, raw_dtype=gguf.GGMLQuantizationType(int(t.ggml_type)))
        else:
            one = to_blocks(experts.expert(source[1], 0).projection(source[2]))
            shape = (cfg.n_experts, *one.shape)
            w.add_tensor_info(name, shape, one.dtype, one.nbytes * cfg.n_experts,
                              raw_dtype=gguf.GGMLQuantizationType(int(qtype)))
    w.write_header_to_file()
    w.write_kv_data_to_file()
    w.write_ti_data_to_file()
    for i, (name, source) in enumerate(plan):
        w.write_tensor_data(data(source)[0])
        if progress and source[0] == "experts" and source[2] == "down":
            print(f"\r  exported layer {source[1] + 1}/{cfg.n_layers}", end="", flush=True)
    if progress:
        print()
    w.close()
    dense.close()
    model.close()
    return Path(out)


def _add_tokenizer(w, tokenizer, n_vocab: int) -> None:
    """The byte-level tokenizer as llama.cpp reads a BPE one: every token in id order, the special
    ones as control tokens, end-of-text as eos, no BOS added. Both llama.cpp and gguf's writer want
    at least one merge, so the embedding's ids past the tokenizer's (a made model may have more
    rows than its 257 tokens) become merged byte pairs: "Ġ" + "t" -> "Ġt", and so on."""
    hf = tokenizer.hf
    vocab = hf.get_vocab(with_added_tokens=True)
    tokens = [t for t, _ in sorted(vocab.items(), key=lambda kv: kv[1])]
    special = {t.content for t in hf.get_added_tokens_decoder().values() if t.special}
    chars = [t for t in tokens if len(t) == 1]
    pairs = ((a, b) for a in chars for b in chars)
    merges = [next(pairs) for _ in range(n_vocab - len(tokens))]
    if not merges:
        raise ValueError(f"export_qwen3moe_gguf: a vocabulary of {n_vocab} leaves no id for a merge; "
                         f"make the model with vocab_size > {len(tokens)}")
    types = [3 if t in special else 1 for t in tokens] + [1] * len(merges)
    w.add_tokenizer_model("gpt2")
    w.add_tokenizer_pre("gpt-2")  # llama.cpp's name for GPT-2's pre-tokenizer
    w.add_token_list(tokens + [a + b for a, b in merges])
    w.add_token_types(types)
    w.add_token_merges([f"{a} {b}" for a, b in merges])
    w.add_eos_token_id(min(tokenizer.eos_ids))
    w.add_add_bos_token(False)
