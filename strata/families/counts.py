"""Parameter counts of a model by part, as `strata doctor` reads them, and the helpers a family's own
counter of a published config uses.

A config strata runs is counted through its own definitions (doctor/families.py `count_strata`:
the converter's ModelConfig and `dense_tensor_shapes`); a config it refuses (a feature it does not
run) is counted by its family's `count_published` (strata/families/<family>.py), else by
`count_generic` here. Every count is in weights; `PartCounts.per_token` is what one decoded token
reads (the embedding table contributes one row).
"""

from __future__ import annotations

from dataclasses import dataclass, field

from strata.errors import ConfigError

__all__ = ["PartCounts", "text_config", "config_value", "common_sizes", "gqa_attention_weights", "published_counts",
           "count_generic"]


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
    ple_row_type: str = ""  # the rows' type where they are read as stored (a llama.cpp GGUF's table, run in
    #                         place); "": the row store's own (what `strata convert` writes)

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


def config_value(c: dict, *keys, default=None):
    """The first of `keys` the config sets, else `default`, else a ConfigError naming them."""
    for k in keys:
        if c.get(k) is not None:
            return c[k]
    if default is None:
        raise ConfigError(f"config.json: missing key {' / '.join(repr(k) for k in keys)}")
    return default


def common_sizes(c: dict) -> tuple[int, int, int, bool]:
    """(hidden, vocab, layers, tied embeddings)"""
    return (int(config_value(c, "hidden_size")), int(config_value(c, "vocab_size")),
            int(config_value(c, "num_hidden_layers")),
            bool(c.get("tie_word_embeddings", False)))


def gqa_attention_weights(hidden: int, heads: int, kv_heads: int, head_dim: int, *, bias: bool = False,
                   out_gate: bool = False) -> int:
    q = heads * head_dim * (2 if out_gate else 1)  # a gated attention's q_proj also emits the gate
    kv = 2 * kv_heads * head_dim
    weights = hidden * (q + kv) + heads * head_dim * hidden
    if bias:
        weights += q + kv + hidden
    return weights


def published_counts(family, t, why, *, hidden, vocab, n_layers, moe_layers, n_experts, top_k, expert_ffn,
                     expert_weights, dense, kv, tie, linear_state=0) -> PartCounts:
    dense = {k: v for k, v in dense.items() if v}
    if not tie:
        dense["head"] = vocab * hidden
    return PartCounts(family=family, model_type=t, supported=False, why_not=why, hidden=hidden, vocab=vocab,
                      n_layers=n_layers, moe_layers=moe_layers, n_experts=n_experts, top_k=top_k,
                      expert_ffn=expert_ffn, expert_weights=expert_weights, embedding=vocab * hidden, dense=dense,
                      kv_per_position=kv, linear_state=linear_state, tie_embeddings=tie)


def count_generic(c: dict, t: str) -> PartCounts:
    """Any other MoE config with the common keys: GQA attention, every layer MoE."""
    hidden, vocab, L, tie = common_sizes(c)
    heads = int(config_value(c, "num_attention_heads"))
    kv_heads = int(c.get("num_key_value_heads") or heads)
    head_dim = int(c.get("head_dim") or hidden // heads)
    n_exp = c.get("num_experts") or c.get("num_local_experts") or c.get("n_routed_experts")
    if not n_exp:
        raise ConfigError(f"{t or 'this'} config has no experts (num_experts / num_local_experts / "
                          f"n_routed_experts): not a Mixture-of-Experts model")
    n_exp = int(n_exp)
    moe_ffn = int(config_value(c, "moe_intermediate_size", "intermediate_size"))
    shared_ffn = int(c.get("shared_expert_intermediate_size") or 0)
    dense = {"attention": L * gqa_attention_weights(hidden, heads, kv_heads, head_dim,
                                             bias=bool(c.get("attention_bias", False))),
             "shared_expert": L * 3 * hidden * shared_ffn, "router": L * n_exp * hidden,
             "norms": L * 2 * hidden + hidden}
    return published_counts(t or "unknown", t, f"model_type {t!r} is not a family strata runs", hidden=hidden,
                            vocab=vocab, n_layers=L, moe_layers=L, n_experts=n_exp,
                            top_k=int(config_value(c, "num_experts_per_tok", "experts_per_token", "moe_k")),
                            expert_ffn=moe_ffn, expert_weights=3 * hidden * moe_ffn, dense=dense,
                            kv=2 * L * kv_heads * head_dim, tie=tie)
