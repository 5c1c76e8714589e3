"""Tiny llama.cpp GGUF files made from tests/hf_models.py's checkpoints the way llama.cpp's
convert_hf_to_gguf.py lays them out: its architecture names and `{arch}.*` metadata, its tensor
names, experts stacked as `blk.L.ffn_{gate,up,down}_exps` [E, ...], Q/K rows permuted for the
`llama` architecture (Mixtral), the tokenizer as `tokenizer.ggml.*` (byte-level BPE), tensors
quantized with the `gguf` package's own quantizers. No torch: what transformers computes on
their dequantized weights is checked in under tests/fixtures/gguf/ (tests/hf_fixtures.py)."""

from __future__ import annotations

import json
from pathlib import Path

import numpy as np

from tests.ggml_kquants import quantize_iq4_nl, quantize_q4_k, quantize_q6_k  # noqa: E402

K_QUANTIZERS = {"Q4_K": quantize_q4_k, "Q6_K": quantize_q6_k, "IQ4_NL": quantize_iq4_nl}

# (architecture, ggml expert type, ggml dense type, strata type the experts must end up as;
# None: converted with --experts q8_0, requantized with the KLD printed)
CASES = [
    ("qwen3_moe", "Q8_0", "F16", "Q8_0"),
    ("qwen2_moe", "Q4_0", "Q8_0", "Q4_0"),
    ("olmoe", "F16", "Q4_0", "F16"),
    ("mixtral", "Q8_0", "F32", "Q8_0"),
    ("qwen3_moe", "MXFP4", "F16", "GGML_MXFP4"),  # ggml's MXFP4, kept as stored
    ("qwen3_moe", "MXFP4", "F16", None),  # the same file requantized on request (--experts q8_0)
]
# the K-quant case: a wider checkpoint (build_wide_checkpoint), Q4_K experts, Q6_K dense weights
WIDE_CASE = ("qwen3_moe_wide", "Q4_K", "Q6_K")
# an unsloth-UD-like mix on a wide checkpoint, (gate, up, down) per layer, Q6_K dense; the last
# layer mixes a whole-block type, strata's split Q8_0 planes and raw BF16 in one record
UD_MIX = (("Q4_K", "Q4_K", "Q5_1"), ("IQ4_NL", "IQ4_NL", "IQ4_NL"), ("MXFP4", "MXFP4", "MXFP4"),
          ("Q6_K", "Q8_0", "BF16"))


def case_id(case: tuple) -> str:
    """The name of a case's fixture (tests/fixtures/gguf/<id>.npz) and test id."""
    return "-".join(case[:3])

# transformers model_type -> (llama.cpp architecture, MoE block, per-expert projection names)
ARCH = {"qwen3_moe": ("qwen3moe", "mlp", ("gate_proj", "up_proj", "down_proj")),
        "qwen2_moe": ("qwen2moe", "mlp", ("gate_proj", "up_proj", "down_proj")),
        "olmoe": ("olmoe", "mlp", ("gate_proj", "up_proj", "down_proj")),
        "mixtral": ("llama", "block_sparse_moe", ("w1", "w3", "w2"))}
PER_LAYER = {"input_layernorm.weight": "attn_norm.weight", "self_attn.q_proj.weight": "attn_q.weight",
             "self_attn.k_proj.weight": "attn_k.weight", "self_attn.v_proj.weight": "attn_v.weight",
             "self_attn.o_proj.weight": "attn_output.weight", "self_attn.q_proj.bias": "attn_q.bias",
             "self_attn.k_proj.bias": "attn_k.bias", "self_attn.v_proj.bias": "attn_v.bias",
             "self_attn.q_norm.weight": "attn_q_norm.weight", "self_attn.k_norm.weight": "attn_k_norm.weight",
             "post_attention_layernorm.weight": "ffn_norm.weight", "{moe}.gate.weight": "ffn_gate_inp.weight",
             "{moe}.shared_expert.gate_proj.weight": "ffn_gate_shexp.weight",
             "{moe}.shared_expert.up_proj.weight": "ffn_up_shexp.weight",
             "{moe}.shared_expert.down_proj.weight": "ffn_down_shexp.weight",
             "{moe}.shared_expert_gate.weight": "ffn_gate_inp_shexp.weight"}


def _permute(w: np.ndarray, heads: int) -> np.ndarray:
    """llama.cpp's LlamaModel.permute: each head's rows [half, 2] -> [2, half] (its rotary order)."""
    rows, cols = w.shape
    return w.reshape(heads, 2, rows // heads // 2, cols).swapaxes(1, 2).reshape(rows, cols)


def build_wide_checkpoint(directory: Path, seed: int = 0, layers: int = 2) -> Path:
    """A random (untrained) tiny Qwen3-MoE whose every matrix row is a multiple of 256 weights,
    so its tensors can be K-quants (QK_K = 256): hidden 256, head_dim 64, expert ffn 256. Written
    by numpy (hf_models.write_synthetic_checkpoint, seeded), so it is the same file everywhere and
    the logits checked in for it stay valid. Weights N(0, INIT_STD) as the trained ones start
    from: with 0.05, router scores are close enough that f16 rounding of the Q4_K experts flips
    a selection (seen: max |Δlogit| 17% of the scale at one seed)."""
    from tests import hf_models

    hf_models.write_synthetic_checkpoint(directory, layers=layers, experts=hf_models.EXPERTS, hidden=256, ffn=256,
                                         shards=1, seed=seed, std=hf_models.INIT_STD)
    return directory


def add_tokenizer(w, hf_dir: Path, n_vocab: int) -> None:
    """The checkpoint's tokenizer as llama.cpp writes a byte-level BPE: `tokenizer.ggml.*` (model
    gpt2, pre gpt2, the vocab padded to the embedding, specials as control tokens, eos <|im_end|>)."""
    tok = json.loads((hf_dir / "tokenizer.json").read_text())
    vocab = {**tok["model"]["vocab"], **{t["content"]: t["id"] for t in tok["added_tokens"]}}
    tokens = [t for t, _ in sorted(vocab.items(), key=lambda kv: kv[1])]
    special = {t["content"] for t in tok["added_tokens"] if t.get("special")}
    pad = [f"[PAD{i}]" for i in range(len(tokens), n_vocab)]  # llama.cpp pads the vocab to the embedding
    w.add_tokenizer_model("gpt2")
    w.add_tokenizer_pre("gpt2")
    w.add_token_list(tokens + pad)
    w.add_token_types([3 if t in special else 1 for t in tokens] + [5] * len(pad))
    w.add_token_merges([m if isinstance(m, str) else " ".join(m) for m in tok["model"]["merges"]])
    w.add_eos_token_id(vocab["<|im_end|>"])
    tcfg = json.loads((hf_dir / "tokenizer_config.json").read_text())
    if tcfg.get("chat_template"):
        w.add_chat_template(tcfg["chat_template"])


def write_gguf(hf_dir: Path, path: Path, *, experts="Q8_0", dense: str = "F16", alignment: int | None = None,
               split_max_tensors: int = 0, fuse_gate_up: bool = False) -> Path:
    """A llama.cpp-style GGUF of the checkpoint in `hf_dir`; routed experts quantized to the ggml
    type named `experts` (or per layer: a sequence of (gate, up, down) type names, as unsloth's
    dynamic quants mix them), 2-D dense weights to `dense` (norms, routers and biases stay F32);
    `alignment`: a `general.alignment` other than the default 32. split_max_tensors: split into
    parts of at most that many tensors, as llama.cpp's gguf-split does (`path`'s stem with
    -00001-of-0000N; the first part's path is returned). fuse_gate_up: gate and up stacked as one
    `ffn_gate_up_exps` [E, 2F, D] (per expert the gate rows, then the up rows), as llama.cpp's
    converter writes them with --fuse-gate-up-exps."""
    import gguf

    from strata.convert.safetensors_reader import Checkpoint

    cfg = json.loads((hf_dir / "config.json").read_text())
    arch, moe, projections = ARCH[cfg["model_type"]]
    w = gguf.GGUFWriter(str(path), arch, split_max_tensors=split_max_tensors)
    if alignment is not None:
        w.add_custom_alignment(alignment)
    n_exp = cfg.get("num_experts") or cfg["num_local_experts"]
    ffn = cfg.get("moe_intermediate_size") or cfg["intermediate_size"]
    heads, kv = cfg["num_attention_heads"], cfg["num_key_value_heads"]
    w.add_block_count(cfg["num_hidden_layers"])
    w.add_context_length(cfg["max_position_embeddings"])
    w.add_embedding_length(cfg["hidden_size"])
    w.add_feed_forward_length(cfg["intermediate_size"])
    w.add_expert_feed_forward_length(ffn)
    w.add_head_count(heads)
    w.add_head_count_kv(kv)
    w.add_key_length(cfg.get("head_dim") or cfg["hidden_size"] // heads)
    w.add_value_length(cfg.get("head_dim") or cfg["hidden_size"] // heads)
    w.add_rope_freq_base(cfg["rope_parameters"]["rope_theta"] if "rope_parameters" in cfg else cfg["rope_theta"])
    w.add_layer_norm_rms_eps(cfg["rms_norm_eps"])
    w.add_expert_count(n_exp)
    w.add_expert_used_count(cfg["num_experts_per_tok"])
    if cfg.get("shared_expert_intermediate_size"):
        w.add_expert_shared_feed_forward_length(cfg["shared_expert_intermediate_size"])
    add_tokenizer(w, hf_dir, cfg["vocab_size"])

    def add(name: str, x: np.ndarray, qtype: str) -> None:
        t = getattr(gguf.GGMLQuantizationType, qtype)
        if t == gguf.GGMLQuantizationType.F32:
            w.add_tensor(name, x.astype(np.float32))
        elif t == gguf.GGMLQuantizationType.F16:
            w.add_tensor(name, x.astype(np.float16))
        elif qtype in K_QUANTIZERS:  # gguf has no K-quant quantizer: tests/ggml_kquants.py
            w.add_tensor(name, K_QUANTIZERS[qtype](x), raw_dtype=t)
        else:
            w.add_tensor(name, gguf.quants.quantize(x.astype(np.float32), t), raw_dtype=t)

    with Checkpoint(hf_dir) as ck:
        add("token_embd.weight", ck.read("model.embed_tokens.weight"), dense)
        add("output_norm.weight", ck.read("model.norm.weight"), "F32")
        if "lm_head.weight" in ck and not cfg.get("tie_word_embeddings"):
            add("output.weight", ck.read("lm_head.weight"), dense)
        for l in range(cfg["num_hidden_layers"]):
            base = f"model.layers.{l}."
            for hf_suffix, g_suffix in PER_LAYER.items():
                name = base + hf_suffix.format(moe=moe)
                if name not in ck:
                    continue
                x = ck.read(name)
                if arch == "llama" and g_suffix in ("attn_q.weight", "attn_k.weight"):
                    x = _permute(x, heads if g_suffix == "attn_q.weight" else kv)
                if g_suffix == "ffn_gate_inp_shexp.weight":
                    x = x.reshape(-1)
                two_d = x.ndim == 2 and not g_suffix.startswith("ffn_gate_inp")
                add(f"blk.{l}.{g_suffix}", x, dense if two_d else "F32")
            layer_types = (experts,) * 3 if isinstance(experts, str) else experts[l]
            stacks = [np.stack([ck.read(base + f"{moe}.experts.{e}.{proj}.weight") for e in range(n_exp)])
                      for proj in projections]
            if fuse_gate_up:
                add(f"blk.{l}.ffn_gate_up_exps.weight", np.concatenate(stacks[:2], axis=1), layer_types[0])
                add(f"blk.{l}.ffn_down_exps.weight", stacks[2], layer_types[2])
                continue
            for stack, g, qtype in zip(stacks, ("ffn_gate_exps", "ffn_up_exps", "ffn_down_exps"), layer_types):
                add(f"blk.{l}.{g}.weight", stack, qtype)
    w.write_header_to_file()
    w.write_kv_data_to_file()
    w.write_tensors_to_file()
    w.close()
    parts = w.format_shard_names(path)
    return parts[0]


def dequantized_checkpoint(gguf_path: Path, hf_dir: Path, out: Path) -> Path:
    """The Hugging Face checkpoint the GGUF's values stand for: every tensor dequantized by gguf,
    under its transformers name (experts split per expert, Q/K rows un-permuted), beside a copy
    of `hf_dir`'s config and tokenizer: what transformers' forward on "the dequantized weights" reads."""
    import shutil

    import gguf
    from safetensors.numpy import save_file

    cfg = json.loads((hf_dir / "config.json").read_text())
    arch, moe, projections = ARCH[cfg["model_type"]]
    heads, kv = cfg["num_attention_heads"], cfg["num_key_value_heads"]
    inverse = {g: h for h, g in PER_LAYER.items()}
    glob = {"token_embd.weight": "model.embed_tokens.weight", "output_norm.weight": "model.norm.weight",
            "output.weight": "lm_head.weight"}
    experts = dict(zip(("ffn_gate_exps.weight", "ffn_up_exps.weight", "ffn_down_exps.weight"), projections))
    tensors = {}
    for t in gguf.GGUFReader(gguf_path).tensors:
        x = gguf.quants.dequantize(np.asarray(t.data), t.tensor_type).astype(np.float32)
        x = x.reshape([int(n) for n in reversed(t.shape)])
        if t.name in glob:
            tensors[glob[t.name]] = x
            continue
        _, layer, suffix = t.name.split(".", 2)
        base = f"model.layers.{layer}."
        if suffix in experts:
            for e in range(x.shape[0]):
                tensors[base + f"{moe}.experts.{e}.{experts[suffix]}.weight"] = np.ascontiguousarray(x[e])
            continue
        if arch == "llama" and suffix in ("attn_q.weight", "attn_k.weight"):
            h = heads if suffix == "attn_q.weight" else kv
            rows, cols = x.shape
            x = x.reshape(h, rows // h // 2, 2, cols).swapaxes(1, 2).reshape(rows, cols)
        if suffix == "ffn_gate_inp_shexp.weight":
            x = x.reshape(1, -1)
        tensors[base + inverse[suffix].format(moe=moe)] = np.ascontiguousarray(x)
    out.mkdir(parents=True)
    for f in ("config.json", "tokenizer.json", "tokenizer_config.json"):
        shutil.copy(hf_dir / f, out / f)
    save_file(tensors, str(out / "model.safetensors"), metadata={"format": "pt"})
    return out


def weights_digest(checkpoint_dir: Path) -> str:
    """sha256 of every tensor (name, dtype, shape, bytes; sorted by name) in a checkpoint's
    safetensors: names the weights a fixture's logits were computed from."""
    import hashlib

    from safetensors.numpy import load_file

    h = hashlib.sha256()
    for f in sorted(checkpoint_dir.glob("*.safetensors")):
        tensors = load_file(str(f))
        for name in sorted(tensors):
            x = np.ascontiguousarray(tensors[name])
            h.update(f"{name} {x.dtype.str} {x.shape}".encode())
            h.update(x.tobytes())
    return h.hexdigest()
