"""Qwen3-Next / Qwen3.5's multi-token-prediction (MTP) layer: the next-next token's logits.

The published checkpoints carry one extra decoder layer under `mtp.*` that predicts the token
after the next one from two inputs at each position t: the target model's last hidden state
h_t (after its final norm) and the embedding of the token at t + 1 (the token h_t predicted):

    x_t = fc([norm_e(embed(token_{t+1})) ; norm_h(h_t)])      fc: [D, 2D]
    y   = decoder_layer(x)                                    gated full attention + MoE, causal
    logits_t = head(norm(y_t))                                the target's own head (shared)

The decoder layer is the family's full-attention layer (the q projection per head [query; gate],
q/k RMSNorm, partial RoPE, a sigmoid output gate; softmax top-k routing, renormalized where
`norm_topk_prob`; a sigmoid-gated shared expert). The RMSNorms are zero-centred (x * (1 + w)),
as in the target model. This follows the published serving code (vLLM's `qwen3_next_mtp.py`,
whose decoder layer is the family's `Qwen3NextDecoderLayer`); transformers computes the target
model only and drops `mtp.*` when it loads a checkpoint.

`MtpWeights.from_checkpoint` reads the published tensor names, `MtpWeights.from_dense` the model
file's (strata/families/qwen_hybrid.py: MTP_NAMES); `mtp_logits` is the reference over a whole
sequence (its attention attends over the MTP layer's own earlier positions).
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Mapping

import numpy as np

from strata.reference.attention import partial_rope, rms_norm
from strata.reference.experts import silu

__all__ = ["MtpShape", "MtpWeights", "mtp_hidden", "mtp_logits", "MTP_PREFIX"]

MTP_PREFIX = "mtp."


def _sigmoid(x: np.ndarray) -> np.ndarray:
    return 1.0 / (1.0 + np.exp(-x))


@dataclass(frozen=True)
class MtpWeights:
    """One MTP layer's weights, float32, in the published layout except the norms, which hold the
    scale applied (1 + the checkpoint's zero-centred w).

    Shapes (D hidden, H/Hkv heads of hd, E experts of F, S shared width):
        fc [D, 2D]; norm_embedding, norm_hidden, norm, input_norm, post_attention_norm [D];
        q [H * 2 hd, D] (per head [query; gate]); k, v [Hkv * hd, D]; o [D, H * hd];
        q_norm, k_norm [hd]; router [E, D]; gate, up [E, F, D]; down [E, D, F];
        shared_gate, shared_up [S, D]; shared_down [D, S]; shared_expert_gate [D]
    """

    fc: np.ndarray
    norm_embedding: np.ndarray
    norm_hidden: np.ndarray
    norm: np.ndarray
    input_norm: np.ndarray
    post_attention_norm: np.ndarray
    q: np.ndarray
    k: np.ndarray
    v: np.ndarray
    o: np.ndarray
    q_norm: np.ndarray
    k_norm: np.ndarray
    router: np.ndarray
    gate: np.ndarray
    up: np.ndarray
    down: np.ndarray
    shared_gate: np.ndarray
    shared_up: np.ndarray
    shared_down: np.ndarray
    shared_expert_gate: np.ndarray

    @classmethod
    def from_checkpoint(cls, tensors: Mapping[str, np.ndarray], n_experts: int,
                        prefix: str = MTP_PREFIX) -> "MtpWeights":
        """The layer from a checkpoint's published names (`mtp.fc.weight`, `mtp.layers.0.*`,
        experts one tensor each; the zero-centred norms get their 1 added). A missing name is a
        one-line KeyError naming it."""

        def get(name: str) -> np.ndarray:
            key = prefix + name
            if key not in tensors:
                raise KeyError(f"the MTP layer needs tensor {key!r}; the checkpoint has no such tensor")
            w = np.asarray(tensors[key], dtype=np.float32)
            return w + np.float32(1.0) if name.endswith(_ZERO_CENTRED) else w

        layer, mlp = "layers.0.", "layers.0.mlp."
        experts = [f"{mlp}experts.{e}." for e in range(n_experts)]
        return cls(
            fc=get("fc.weight"), norm_embedding=get("pre_fc_norm_embedding.weight"),
            norm_hidden=get("pre_fc_norm_hidden.weight"), norm=get("norm.weight"),
            input_norm=get(layer + "input_layernorm.weight"),
            post_attention_norm=get(layer + "post_attention_layernorm.weight"),
            q=get(layer + "self_attn.q_proj.weight"), k=get(layer + "self_attn.k_proj.weight"),
            v=get(layer + "self_attn.v_proj.weight"), o=get(layer + "self_attn.o_proj.weight"),
            q_norm=get(layer + "self_attn.q_norm.weight"), k_norm=get(layer + "self_attn.k_norm.weight"),
            router=get(mlp + "gate.weight"),
            gate=np.stack([get(e + "gate_proj.weight") for e in experts]),
            up=np.stack([get(e + "up_proj.weight") for e in experts]),
            down=np.stack([get(e + "down_proj.weight") for e in experts]),
            shared_gate=get(mlp + "shared_expert.gate_proj.weight"), shared_up=get(mlp + "shared_expert.up_proj.weight"),
            shared_down=get(mlp + "shared_expert.down_proj.weight"),
            shared_expert_gate=get(mlp + "shared_expert_gate.weight").reshape(-1))


    @classmethod
    def from_dense(cls, dense: Mapping[str, np.ndarray], n_experts: int) -> "MtpWeights":
        """The layer from a model file's dense tensors (MTP_NAMES; norms already 1 + w)."""
        from strata.families.qwen_hybrid import MTP_NAMES, mtp_expert_name

        get = lambda name: np.asarray(dense[name], dtype=np.float32)  # noqa: E731
        experts = {p: np.stack([get(mtp_expert_name(p, e)) for e in range(n_experts)]) for p in ("gate", "up", "down")}
        return cls(**{field: get(name) for field, name in MTP_NAMES.items()}, **experts)


# the published names of the zero-centred RMSNorms (x * (1 + w)): every one ending in these
_ZERO_CENTRED = ("norm.weight", "norm_embedding.weight", "norm_hidden.weight")


@dataclass(frozen=True)
class MtpShape:
    """What the layer needs from the model config beside its weights."""

    n_heads: int
    n_kv_heads: int
    head_dim: int
    rotary_dim: int
    rope_theta: float
    top_k: int
    norm_topk_prob: bool
    eps: float

    @classmethod
    def of(cls, cfg) -> "MtpShape":
        """The shape a model config (strata.model_config.ModelConfig) gives its MTP layer."""
        return cls(n_heads=cfg.n_heads, n_kv_heads=cfg.n_kv_heads, head_dim=cfg.head_dim, rotary_dim=cfg.rope_dim,
                   rope_theta=cfg.rope_theta, top_k=cfg.n_experts_per_token, norm_topk_prob=cfg.norm_topk_prob,
                   eps=cfg.rms_norm_eps)


def _norm(x: np.ndarray, scale: np.ndarray, eps: float) -> np.ndarray:
    return rms_norm(x, scale, eps)


def _attention(w: MtpWeights, s: MtpShape, x: np.ndarray, positions: np.ndarray) -> np.ndarray:
    """Gated causal attention over the sequence. Shapes: x [T, D], positions [T] -> [T, D]."""
    T, H, Hkv, hd = len(x), s.n_heads, s.n_kv_heads, s.head_dim
    qg = (x @ w.q.T).reshape(T, H, 2 * hd)
    q, g = qg[..., :hd], qg[..., hd:].reshape(T, H * hd)
    k = (x @ w.k.T).reshape(T, Hkv, hd)
    v = (x @ w.v.T).reshape(T, Hkv, hd)
    q = partial_rope(_norm(q, w.q_norm, s.eps).transpose(1, 0, 2), positions, s.rope_theta, s.rotary_dim)
    k = partial_rope(_norm(k, w.k_norm, s.eps).transpose(1, 0, 2), positions, s.rope_theta, s.rotary_dim)
    rep = H // Hkv
    k, v = np.repeat(k, rep, axis=0), np.repeat(v.transpose(1, 0, 2), rep, axis=0)  # [H, T, hd]
    scores = q @ k.transpose(0, 2, 1) / np.sqrt(np.float32(hd))  # [H, T, T]
    scores = np.where(np.tril(np.ones((T, T), bool)), scores, -np.inf)
    p = np.exp(scores - scores.max(-1, keepdims=True))
    p /= p.sum(-1, keepdims=True)
    out = (p @ v).transpose(1, 0, 2).reshape(T, H * hd)
    return (out * _sigmoid(g)) @ w.o.T


def _moe(w: MtpWeights, s: MtpShape, x: np.ndarray) -> np.ndarray:
    """Softmax top-k experts plus the sigmoid-gated shared expert. Shapes: x [T, D] -> [T, D]."""
    z = x @ w.router.T  # [T, E]
    p = np.exp(z - z.max(-1, keepdims=True))
    p /= p.sum(-1, keepdims=True)
    out = np.zeros_like(x)
    for t in range(len(x)):
        top = np.argsort(-p[t], kind="stable")[:s.top_k]
        weights = p[t, top] / p[t, top].sum() if s.norm_topk_prob else p[t, top]
        for e, c in zip(top, weights):
            out[t] += c * (w.down[e] @ (silu(w.gate[e] @ x[t]) * (w.up[e] @ x[t])))
    shared = (silu(x @ w.shared_gate.T) * (x @ w.shared_up.T)) @ w.shared_down.T
    return out + _sigmoid(x @ w.shared_expert_gate)[:, None] * shared


def mtp_hidden(w: MtpWeights, s: MtpShape, hidden: np.ndarray, next_embeddings: np.ndarray,
               positions: np.ndarray) -> np.ndarray:
    """The MTP layer's normed output at every position, before the head.

    Shapes: hidden [T, D] (the target's last hidden states, after its final norm);
    next_embeddings [T, D] (embed(token at t + 1)); positions [T] -> [T, D]"""
    hidden = np.asarray(hidden, np.float32)
    x = np.concatenate([_norm(next_embeddings, w.norm_embedding, s.eps), _norm(hidden, w.norm_hidden, s.eps)], -1)
    x = x @ w.fc.T
    x = x + _attention(w, s, _norm(x, w.input_norm, s.eps), np.asarray(positions))
    x = x + _moe(w, s, _norm(x, w.post_attention_norm, s.eps))
    return _norm(x, w.norm, s.eps)


def mtp_logits(w: MtpWeights, s: MtpShape, hidden: np.ndarray, next_tokens: np.ndarray, embedding: np.ndarray,
               head: np.ndarray, positions: np.ndarray) -> np.ndarray:
    """Logits for the token after next at every position (the target's embedding and head).

    Shapes: hidden [T, D]; next_tokens [T] (token t + 1); embedding, head [V, D]; positions [T]
    -> [T, V]"""
    y = mtp_hidden(w, s, hidden, np.asarray(embedding, np.float32)[np.asarray(next_tokens)], positions)
    return y @ np.asarray(head, np.float32).T
