"""Grouped-query attention with RoPE (optionally partial, optionally YaRN-scaled), optional q/k
RMSNorm, an optional sigmoid output gate, and an explicit KV cache (pure numpy).

gpt-oss adds three options: attention sinks (a learned logit per head that joins every query's
softmax and takes its share of the probability mass, its value dropped: `softmax_with_sinks`),
an output-projection bias, and sliding-window layers (`Mixer.SLIDING_ATTENTION`: query i sees
keys i - sliding_window < j <= i). A sliding layer's KV cache keeps every position, like a full
layer's, so `trim(n)` restores any n; the window is the mask's business.
"""

from __future__ import annotations

import enum
from dataclasses import dataclass

import numpy as np

from strata.formats.dense_weights import as_dense_weights
from strata.model_config import Mixer, ModelConfig, QKNorm, RopeScaling, TensorNames
from strata.reference.rope_scaling import scaled_rope


def rms_norm(x: np.ndarray, weight: np.ndarray, eps: float) -> np.ndarray:
    """x / sqrt(mean(x^2) + eps) * weight over the last axis, in float32."""
    x = np.asarray(x, dtype=np.float32)
    inv = np.float32(1.0) / np.sqrt(np.mean(x * x, axis=-1, keepdims=True) + np.float32(eps))
    return x * inv * weight


def rope(x: np.ndarray, positions: np.ndarray, theta: float) -> np.ndarray:
    """Rotary embedding in the "rotate half" form (the first and second halves of each head are
    the pair), as Qwen, OLMoE and Mixtral use it.

    Shapes:
        x: [H, T, hd]; positions: [T] -> [H, T, hd]
    """
    hd = x.shape[-1]
    inv_freq = 1.0 / (theta ** (np.arange(0, hd, 2, dtype=np.float64) / hd))  # [hd/2]
    angles = positions.astype(np.float64)[:, None] * inv_freq[None, :]  # [T, hd/2]
    cos = np.cos(np.concatenate([angles, angles], axis=-1)).astype(np.float32)  # [T, hd]
    sin = np.sin(np.concatenate([angles, angles], axis=-1)).astype(np.float32)
    half = hd // 2
    rotated = np.concatenate([-x[..., half:], x[..., :half]], axis=-1)
    return x * cos + rotated * sin


def partial_rope(x: np.ndarray, positions: np.ndarray, theta: float, dim: int) -> np.ndarray:
    """RoPE on the first `dim` dims of each head, the rest passed through (Qwen3-Next and
    Qwen3.5 rotate a quarter of the head; the frequencies are those of a `dim`-wide head).

    Shapes:
        x: [H, T, hd]; positions: [T] -> [H, T, hd]
    """
    if dim == x.shape[-1]:
        return rope(x, positions, theta)
    return np.concatenate([rope(x[..., :dim], positions, theta), x[..., dim:]], axis=-1)


def sigmoid(x: np.ndarray) -> np.ndarray:
    return (np.float32(1.0) / (np.float32(1.0) + np.exp(-x))).astype(np.float32)


class KVPrecision(enum.Enum):
    """How an attention layer's cache stores keys and values.

    F32: exact (the default). F16: each key (after its norm and RoPE) and each value is rounded
    once to IEEE binary16, to nearest even, as it is written; every later read sees the rounded
    value, and so does the writing step itself (its own position is read back from the cache like
    any other). Half the bytes a decoded token reads from the cache (0.4 -> 0.2 GB at context 2048
    on the seed shape); the scores and the weighted sum stay float32."""

    F32 = "f32"
    F16 = "f16"

    def store(self, a: np.ndarray) -> np.ndarray:
        """a as this precision keeps it, as float32. Shapes: any -> the same"""
        if self is KVPrecision.F32:
            return a
        return np.asarray(a, np.float32).astype(np.float16).astype(np.float32)


@dataclass(frozen=True)
class LayerKV:
    """One layer's cached keys and values. Shapes: keys, values: [n_kv_heads, T_cached, head_dim]

    precision: how they are stored (KVPrecision: exact float32 by default)."""

    keys: np.ndarray
    values: np.ndarray
    precision: KVPrecision = KVPrecision.F32

    @staticmethod
    def empty(cfg: ModelConfig, precision: KVPrecision = KVPrecision.F32) -> "LayerKV":
        z = np.zeros((cfg.n_kv_heads, 0, cfg.head_dim), np.float32)
        return LayerKV(z, z, precision)

    @property
    def length(self) -> int:
        return self.keys.shape[1]

    def trim(self, n: int) -> "LayerKV":
        """The first n positions (KV truncation: attention keeps every position, so any n works)."""
        return LayerKV(self.keys[:, :n], self.values[:, :n], self.precision)


def softmax_with_sinks(scores: np.ndarray, sinks: np.ndarray | None) -> np.ndarray:
    """Softmax over the last axis with, per head, one more logit (the sink) whose probability is
    dropped: the rows then sum to 1 - p_sink. sinks None: a plain softmax.

    Shapes:
        scores [H, T, S] (-inf where masked); sinks [H] or None -> [H, T, S]
    """
    top = scores.max(axis=-1, keepdims=True)  # [H, T, 1]
    if sinks is None:
        probs = np.exp(scores - top)
        return probs / probs.sum(axis=-1, keepdims=True)
    sink = np.asarray(sinks, np.float32)[:, None, None]  # [H, 1, 1]
    top = np.maximum(top, sink)
    probs = np.exp(scores - top)
    return probs / (probs.sum(axis=-1, keepdims=True) + np.exp(sink - top))


def window_of(cfg: ModelConfig, layer: int) -> int:
    """How many latest positions a query of this layer sees (0: all of them)."""
    return cfg.gpt_oss.sliding_window if cfg.kinds[layer].mixer is Mixer.SLIDING_ATTENTION else 0


def attention(
    cfg: ModelConfig, dense: dict, layer: int, kv: LayerKV, x: np.ndarray, *, keep: np.ndarray | None = None
) -> tuple[np.ndarray, LayerKV]:
    """Causal self-attention of the new positions over the cache and themselves.

    keep: which keys each query may see besides causality (Qwen4-Exp's indexer selection).

    Shapes:
        x: [T, D] (already normed), keep: bool [T, S] (S = cached + T) -> ([T, D], LayerKV with T more positions)
    """
    n = TensorNames
    dense = as_dense_weights(dense)  # a plain dict of float32 arrays (tests) is wrapped
    w = lambda s: dense[n.block(layer, s)]  # noqa: E731
    proj = lambda s, a: dense.linear(n.block(layer, s), a)  # noqa: E731  a W^T
    t = x.shape[0]
    q = proj(n.attn_q, x)  # [T, H*hd]
    k = proj(n.attn_k, x)  # [T, KV*hd]
    v = proj(n.attn_v, x)
    if cfg.attention_bias:
        q, k, v = q + w(n.attn_q_bias), k + w(n.attn_k_bias), v + w(n.attn_v_bias)
    if cfg.qk_norm is QKNorm.FULL:
        q = rms_norm(q, w(n.attn_q_norm), cfg.rms_norm_eps)
        k = rms_norm(k, w(n.attn_k_norm), cfg.rms_norm_eps)
    q = q.reshape(t, cfg.n_heads, cfg.head_dim).transpose(1, 0, 2)  # [H, T, hd]
    k = k.reshape(t, cfg.n_kv_heads, cfg.head_dim).transpose(1, 0, 2)  # [KV, T, hd]
    v = v.reshape(t, cfg.n_kv_heads, cfg.head_dim).transpose(1, 0, 2)
    if cfg.qk_norm is QKNorm.PER_HEAD:
        q = rms_norm(q, w(n.attn_q_norm), cfg.rms_norm_eps)
        k = rms_norm(k, w(n.attn_k_norm), cfg.rms_norm_eps)
    positions = np.arange(kv.length, kv.length + t)
    if cfg.yarn.rope_scaling is RopeScaling.NONE:
        q = partial_rope(q, positions, cfg.rope_theta, cfg.rope_dim)
        k = partial_rope(k, positions, cfg.rope_theta, cfg.rope_dim)
    else:
        q, k = scaled_rope(q, positions, cfg), scaled_rope(k, positions, cfg)
    keys = np.concatenate([kv.keys, kv.precision.store(k)], axis=1)  # [KV, S, hd]
    values = np.concatenate([kv.values, kv.precision.store(v)], axis=1)
    group = cfg.n_heads // cfg.n_kv_heads
    keys_h = np.repeat(keys, group, axis=0)  # [H, S, hd]
    values_h = np.repeat(values, group, axis=0)
    scores = (q @ keys_h.transpose(0, 2, 1)) / np.float32(np.sqrt(cfg.head_dim))  # [H, T, S]
    s = keys.shape[1]
    causal = np.arange(s)[None, :] <= positions[:, None]  # [T, S]
    if window_of(cfg, layer):
        causal &= np.arange(s)[None, :] > positions[:, None] - window_of(cfg, layer)
    if keep is not None:
        causal &= keep
    scores = np.where(causal[None], scores, np.float32(-np.inf))
    probs = softmax_with_sinks(scores, w(n.attn_sinks) if cfg.gpt_oss.attention_sinks else None)
    out = (probs @ values_h).transpose(1, 0, 2).reshape(t, cfg.n_heads * cfg.head_dim)  # [T, H*hd]
    if cfg.attention_output_gate:  # Qwen3-Next / Qwen3.5: each head's output gated by sigmoid(x · W_gate)
        out = out * sigmoid(proj(n.attn_gate, x))
    out = proj(n.attn_output, out)
    if cfg.gpt_oss.attention_output_bias:
        out = out + w(n.attn_output_bias)
    return out.astype(np.float32), LayerKV(keys, values, kv.precision)
