"""Parameter counts of a Hugging Face config, by part, without reading a weight.

Families strata runs (Qwen3-MoE, Qwen2-MoE, OLMoE, Mixtral) are counted through strata's own
definitions: the converter's `ModelConfig` and `dense_tensor_shapes`, so the doctor and the
converter cannot disagree. Families strata does not run yet are counted from their published
structure so they still get a byte budget:

- DeepSeek-V3 (and Kimi-K2 / GLM-style MLA configs): MLA attention (q_a/q_b, kv_a/kv_b, o),
  `first_k_dense_replace` dense-MLP layers, `n_shared_experts` shared experts per MoE layer.
- gpt-oss: attention with biases and sinks, router with bias, experts with biases.
- Qwen3.5 / Qwen3-Next: gated DeltaNet ("linear_attention") layers and gated full-attention
  layers every `full_attention_interval`, a shared expert per layer; config nested under
  `text_config` for the multimodal checkpoints.

Every count is in weights; `PartCounts.per_token` is what one decoded token reads (the
embedding table contributes one row).
"""

from __future__ import annotations

from dataclasses import dataclass, field

from strata.errors import ConfigError, StrataError

__all__ = ["PartCounts", "count_hf", "count_strata", "text_config"]


@dataclass(frozen=True)
class PartCounts:
    """Weights of one model by part. `dense` maps a part name ("attention", "dense_ffn",
    "shared_expert", "router", "norms", "head") to its weights over all layers."""

    family: str
    model_type: str
    supported: bool
    why_not: str  # "" when supported
    hidden: int
    vocab: int
    n_layers: int
    moe_layers: int
    n_experts: int
    top_k: int
    expert_ffn: int
    expert_weights: int  # one expert: gate + up + down (+ biases)
    embedding: int  # vocab x hidden (one row read per token)
    dense: dict[str, int] = field(default_factory=dict)
    kv_per_position: int = 0  # K and V values cached per position, all attention layers
    linear_state: int = 0  # recurrent state values (DeltaNet), all layers
    tie_embeddings: bool = False
    model_config: object = None  # strata's ModelConfig where the family is supported
    # PLE (Qwen4-Exp): the n-gram tables are the row store's, not dense weights; a token reads
    # one row per n-gram head of every PLE layer
    ple_table_values: int = 0  # every table's values
    ple_rows_per_token: int = 0
    ple_row_width: int = 0

    @property
    def dense_weights(self) -> int:
        return self.embedding + sum(self.dense.values())

    @property
    def total_experts(self) -> int:
        return self.moe_layers * self.n_experts

    @property
    def total_weights(self) -> int:
        return self.dense_weights + self.total_experts * self.expert_weights

    @property
    def active_weights(self) -> int:
        """Weights one token uses: dense (embedding one row) + k experts per MoE layer."""
        return self.hidden + sum(self.dense.values()) + self.moe_layers * self.top_k * self.expert_weights


def text_config(raw: dict) -> dict:
    """The language model's config: multimodal checkpoints nest it under `text_config`."""
    inner = raw.get("text_config")
    if isinstance(inner, dict):
        merged = {k: v for k, v in raw.items() if k != "text_config"}
        merged.update(inner)
        merged["model_type"] = raw.get("model_type", inner.get("model_type"))
        return merged
    return raw


def _get(c: dict, *keys, default=None):
    for k in keys:
        if c.get(k) is not None:
            return c[k]
    if default is None:
        raise ConfigError(f"config.json: missing key {' / '.join(repr(k) for k in keys)}")
    return default


def count_hf(raw: dict, path: str = "config.json") -> PartCounts:
    """Count a config.json (already parsed). Supported families go through strata's converter;
    the others through their own counter; an unknown MoE config through the generic one."""
    c = text_config(raw)
    t = c.get("model_type") or ""
    supported = _supported(raw, path)
    if supported is not None:
        return supported
    counter = _UNSUPPORTED.get(t)
    if counter is None:
        for prefix, fn in _UNSUPPORTED.items():
            if t.startswith(prefix):
                counter = fn
                break
    if counter is None:
        counter = _generic
    return counter(c, t)


def _kv_per_position(cfg) -> int:
    """Cached floats per position: K and V of every attention layer (a recurrent layer's state is
    fixed; a latent-attention layer caches its latent and rope key)."""
    from strata.model_config import Mixer

    per = {Mixer.ATTENTION: 2 * cfg.n_kv_heads * cfg.head_dim, Mixer.MLA: cfg.kv_lora_rank + cfg.qk_rope_head_dim}
    return sum(per.get(k.mixer, 0) for k in cfg.kinds)


def _supported(raw: dict, path: str) -> PartCounts | None:
    """Counts through strata's converter, or None where the family is not one strata runs (or the
    config uses a feature it does not run: the reason is kept for the report)."""
    from pathlib import Path

    from strata.convert.architectures import BY_MODEL_TYPE
    from strata.convert.hf_config import HFConfig

    family = BY_MODEL_TYPE.get(raw.get("model_type"))
    if family is None:
        return None
    hf = HFConfig(Path(path), raw, family.name)
    try:
        cfg = family.model_config(hf, frozenset())  # no checkpoint: tensors are not consulted
    except StrataError as e:  # a feature strata does not run: count the family's structure itself
        t = raw.get("model_type") or ""
        counts = _UNSUPPORTED.get(t, _generic)(text_config(raw), t)
        return _replace(counts, family=family.name, why_not=str(e).split(": ", 1)[-1])
    return count_strata(cfg, family.name)


def count_strata(cfg, family: str = "strata") -> PartCounts:
    """Counts of a model strata runs, from its ModelConfig and `dense_tensor_shapes`."""
    from strata.model_config import dense_tensor_shapes

    from strata.ple_store import table_shapes
    from strata.families.qwen4_exp import Qwen4Names, ple_layers

    parts: dict[str, int] = {}
    for name, shape in dense_tensor_shapes(cfg).items():
        n = 1
        for d in shape:
            n *= d
        if name.endswith(Qwen4Names.ple_ngram):  # a made model's table among the dense: the row store's part
            continue
        part = _strata_part(name)
        parts[part] = parts.get(part, 0) + n
    embedding = parts.pop("embedding")
    return PartCounts(
        family=family, model_type=cfg.architecture, supported=True, why_not="", hidden=cfg.hidden_size,
        vocab=cfg.vocab_size, n_layers=cfg.n_layers, moe_layers=cfg.n_moe_layers, n_experts=cfg.n_experts,
        top_k=cfg.n_experts_per_token, expert_ffn=cfg.expert_ffn_size,
        expert_weights=3 * cfg.hidden_size * cfg.expert_ffn_size, embedding=embedding, dense=parts,
        kv_per_position=_kv_per_position(cfg), tie_embeddings=cfg.tie_embeddings,
        model_config=cfg, **_ple_counts(cfg, ple_layers, table_shapes))


def _ple_counts(cfg, ple_layers, table_shapes) -> dict:
    if not ple_layers(cfg):
        return {}
    shapes = table_shapes(cfg)
    width = next(iter(shapes.values()))[1]
    return dict(ple_table_values=sum(r * w for r, w in shapes.values()), ple_row_width=width,
                ple_rows_per_token=cfg.ple_embed_dim // width * len(shapes))


def _strata_part(name: str) -> str:
    from strata.model_config import TensorNames as n

    if name == n.token_embd:
        return "embedding"
    if name == n.output:
        return "head"
    if name.endswith(n.router):
        return "router"
    if "_shexp" in name:
        return "shared_expert"
    if name.endswith("norm.weight"):
        return "norms"
    return "attention"


def _replace(counts: PartCounts, **changes) -> PartCounts:
    import dataclasses

    return dataclasses.replace(counts, supported=False, **changes)


def _common(c: dict) -> tuple[int, int, int, bool]:
    return (int(_get(c, "hidden_size")), int(_get(c, "vocab_size")), int(_get(c, "num_hidden_layers")),
            bool(c.get("tie_word_embeddings", False)))


def _gqa_attention(hidden: int, heads: int, kv_heads: int, head_dim: int, *, bias: bool = False,
                   out_gate: bool = False) -> int:
    q = heads * head_dim * (2 if out_gate else 1)  # a gated attention's q_proj also emits the gate
    kv = 2 * kv_heads * head_dim
    weights = hidden * (q + kv) + heads * head_dim * hidden
    if bias:
        weights += q + kv + hidden
    return weights


def _finish(family, t, why, *, hidden, vocab, n_layers, moe_layers, n_experts, top_k, expert_ffn, expert_weights,
            dense, kv, tie, linear_state=0) -> PartCounts:
    dense = {k: v for k, v in dense.items() if v}
    if not tie:
        dense["head"] = vocab * hidden
    return PartCounts(family=family, model_type=t, supported=False, why_not=why, hidden=hidden, vocab=vocab,
                      n_layers=n_layers, moe_layers=moe_layers, n_experts=n_experts, top_k=top_k,
                      expert_ffn=expert_ffn, expert_weights=expert_weights, embedding=vocab * hidden, dense=dense,
                      kv_per_position=kv, linear_state=linear_state, tie_embeddings=tie)


def _deepseek_v3(c: dict, t: str) -> PartCounts:
    hidden, vocab, L, tie = _common(c)
    heads = int(_get(c, "num_attention_heads"))
    q_rank = c.get("q_lora_rank")
    kv_rank, nope, rope, v_dim = (int(_get(c, k)) for k in ("kv_lora_rank", "qk_nope_head_dim", "qk_rope_head_dim",
                                                             "v_head_dim"))
    q_head = nope + rope
    q = hidden * heads * q_head if not q_rank else hidden * q_rank + q_rank + q_rank * heads * q_head
    attn = q + hidden * (kv_rank + rope) + kv_rank + kv_rank * heads * (nope + v_dim) + heads * v_dim * hidden
    dense_layers = int(c.get("first_k_dense_replace", 0))
    freq = int(c.get("moe_layer_freq", 1))
    moe_layers = sum(1 for l in range(dense_layers, L) if l % freq == 0)
    ffn, moe_ffn = int(_get(c, "intermediate_size")), int(_get(c, "moe_intermediate_size"))
    n_exp, shared = int(_get(c, "n_routed_experts")), int(c.get("n_shared_experts") or 0)
    dense = {"attention": L * attn, "dense_ffn": (L - moe_layers) * 3 * hidden * ffn,
             "shared_expert": moe_layers * shared * 3 * hidden * moe_ffn,
             "router": moe_layers * (n_exp * hidden + n_exp), "norms": L * 2 * hidden + hidden}
    return _finish("DeepSeek-V3", t, "MLA attention, sigmoid routing with expert groups and dense first layers",
                   hidden=hidden, vocab=vocab, n_layers=L, moe_layers=moe_layers, n_experts=n_exp,
                   top_k=int(_get(c, "num_experts_per_tok")), expert_ffn=moe_ffn, expert_weights=3 * hidden * moe_ffn,
                   dense=dense, kv=L * (kv_rank + rope), tie=tie)  # MLA caches the latent + the rope key


def _gpt_oss(c: dict, t: str) -> PartCounts:
    hidden, vocab, L, tie = _common(c)
    heads, kv_heads = int(_get(c, "num_attention_heads")), int(_get(c, "num_key_value_heads"))
    head_dim = int(c.get("head_dim") or hidden // heads)
    ffn, n_exp = int(_get(c, "intermediate_size")), int(_get(c, "num_local_experts", "num_experts"))
    attn = _gqa_attention(hidden, heads, kv_heads, head_dim, bias=bool(c.get("attention_bias", True))) + heads  # sinks
    expert = 3 * hidden * ffn + 2 * ffn + hidden  # gate_up [2F, D] + bias [2F], down [D, F] + bias [D]
    dense = {"attention": L * attn, "router": L * (n_exp * hidden + n_exp), "norms": L * 2 * hidden + hidden}
    return _finish("gpt-oss", t, "MXFP4 experts, router bias, clamped SwiGLU, attention sinks and sliding windows",
                   hidden=hidden, vocab=vocab, n_layers=L, moe_layers=L, n_experts=n_exp,
                   top_k=int(_get(c, "num_experts_per_tok", "experts_per_token")), expert_ffn=ffn,
                   expert_weights=expert, dense=dense, kv=2 * L * kv_heads * head_dim, tie=tie)


def _qwen_hybrid(c: dict, t: str) -> PartCounts:
    hidden, vocab, L, tie = _common(c)
    heads, kv_heads = int(_get(c, "num_attention_heads")), int(_get(c, "num_key_value_heads"))
    head_dim = int(c.get("head_dim") or hidden // heads)
    types = c.get("layer_types")
    if not types:
        every = int(c.get("full_attention_interval", 4))
        types = ["full_attention" if (l + 1) % every == 0 else "linear_attention" for l in range(L)]
    n_full = sum(1 for x in types if x == "full_attention")
    n_lin = L - n_full
    kh, vh = int(_get(c, "linear_num_key_heads")), int(_get(c, "linear_num_value_heads"))
    kd, vd = int(_get(c, "linear_key_head_dim")), int(_get(c, "linear_value_head_dim"))
    conv = int(c.get("linear_conv_kernel_dim", 4))
    k_dim, v_dim = kh * kd, vh * vd
    conv_dim = 2 * k_dim + v_dim
    # in_proj_qkvz [2K + 2V, D], in_proj_ba [2 Hv, D], conv1d [C, kernel], dt_bias + A_log [Hv], norm [Vd], out [D, V]
    deltanet = hidden * (2 * k_dim + 2 * v_dim) + hidden * 2 * vh + conv_dim * conv + 2 * vh + vd + v_dim * hidden
    full = _gqa_attention(hidden, heads, kv_heads, head_dim, out_gate=bool(c.get("attn_output_gate", True))) \
        + 2 * head_dim  # q/k norms
    moe_ffn, n_exp = int(_get(c, "moe_intermediate_size")), int(_get(c, "num_experts"))
    shared_ffn = int(c.get("shared_expert_intermediate_size") or 0)
    dense = {"attention": n_full * full + n_lin * deltanet,
             "shared_expert": L * (3 * hidden * shared_ffn + (hidden if shared_ffn else 0)),
             "router": L * n_exp * hidden, "norms": L * 2 * hidden + hidden}
    family = "Qwen3.5" if t.startswith("qwen3_5") else "Qwen3-Next"
    return _finish(family, t, "gated DeltaNet + gated attention hybrid layers", hidden=hidden, vocab=vocab,
                   n_layers=L, moe_layers=L, n_experts=n_exp, top_k=int(_get(c, "num_experts_per_tok")),
                   expert_ffn=moe_ffn, expert_weights=3 * hidden * moe_ffn, dense=dense,
                   kv=2 * n_full * kv_heads * head_dim, tie=tie, linear_state=n_lin * vh * kd * vd)


def _generic(c: dict, t: str) -> PartCounts:
    """Any other MoE config with the common keys: GQA attention, every layer MoE."""
    hidden, vocab, L, tie = _common(c)
    heads = int(_get(c, "num_attention_heads"))
    kv_heads = int(c.get("num_key_value_heads") or heads)
    head_dim = int(c.get("head_dim") or hidden // heads)
    n_exp = c.get("num_experts") or c.get("num_local_experts") or c.get("n_routed_experts")
    if not n_exp:
        raise ConfigError(f"{t or 'this'} config has no experts (num_experts / num_local_experts / "
                          f"n_routed_experts): not a Mixture-of-Experts model")
    n_exp = int(n_exp)
    moe_ffn = int(_get(c, "moe_intermediate_size", "intermediate_size"))
    shared_ffn = int(c.get("shared_expert_intermediate_size") or 0)
    dense = {"attention": L * _gqa_attention(hidden, heads, kv_heads, head_dim,
                                             bias=bool(c.get("attention_bias", False))),
             "shared_expert": L * 3 * hidden * shared_ffn, "router": L * n_exp * hidden,
             "norms": L * 2 * hidden + hidden}
    return _finish(t or "unknown", t, f"model_type {t!r} is not a family strata runs", hidden=hidden, vocab=vocab,
                   n_layers=L, moe_layers=L, n_experts=n_exp,
                   top_k=int(_get(c, "num_experts_per_tok", "experts_per_token", "moe_k")), expert_ffn=moe_ffn,
                   expert_weights=3 * hidden * moe_ffn, dense=dense, kv=2 * L * kv_heads * head_dim, tie=tie)


_UNSUPPORTED = {"deepseek_v3": _deepseek_v3, "deepseek_v2": _deepseek_v3, "kimi_k2": _deepseek_v3,
                "gpt_oss": _gpt_oss, "qwen3_5": _qwen_hybrid, "qwen3_next": _qwen_hybrid}
