"""Multi-head latent attention (DeepSeek-V2/V3, Kimi-K2, GLM-4.7-Flash), pure numpy, with a
latent cache.

Per position, with c = kv_lora_rank, n = qk_nope_head_dim, r = qk_rope_head_dim, v = v_head_dim:

    q       = W_qb · rms_norm(W_qa · x)            (or W_q · x without a q low-rank path)  [H, n + r]
    [l; kr] = W_kva · x;  l = rms_norm(l)          the latent [c] and one rope key [r] shared by all heads
    k_h     = [W_uk,h · l ; rope(kr)],  v_h = W_uv,h · l     (W_kvb per head: n key rows, then v value rows)
    o       = W_o · concat_h softmax(q_h · k_h / sqrt(n + r)) v_h

The cache holds what a position contributes before the per-head expansion: l and rope(kr),
(c + r) floats a position instead of 2·H·(n + v) for full keys and values (DeepSeek-V3: 576
against 32768). Two ways to attend over it, equal up to float32 reordering:

- **expanded**: rebuild every cached position's k_h, v_h with W_kvb, then plain attention;
- **absorbed**: fold W_uk into the query (q_lat,h = W_uk,hᵀ q_nope,h, [c]) and W_uv after the
  softmax, so the scores are q_lat · l + q_rope · kr and nothing per position is expanded.

Which is cheaper (`absorbed_is_cheaper`): expanding costs S·H·c·(n + v) for S cached positions
plus T·S·H·(n + r + v) to attend; absorbing costs T·H·c·(n + v) plus T·S·H·(2c + r). A decoded
token (T = 1) therefore absorbs as soon as S > 1 (DeepSeek-V3: 16.8 M multiply-adds a cached
position expanded against 0.13 M absorbed); a long prompt chunk (T ≈ S) expands, its scores
running over n + r = 192 dims instead of c + r = 576.

RoPE here is the "rotate half" form over the r rope dims; DeepSeek's checkpoints lay those dims
out interleaved, and the converter permutes the rope rows of W_qb and W_kva to this layout (q and
k alike, so every score is unchanged).
"""

from __future__ import annotations

import math
from dataclasses import dataclass

import numpy as np

from strata.formats.dense_weights import as_dense_weights
from strata.model_config import ModelConfig, RopeScaling, TensorNames
from strata.reference.attention import rms_norm
from strata.reference.rope_scaling import rope_frequencies

__all__ = ["LatentKV", "mla", "absorbed_is_cheaper", "MLA_NORM_EPS", "rope_cos_sin", "softmax_scale", "yarn_mscale"]

# transformers builds q_a_layernorm and kv_a_layernorm with the RMSNorm default, not
# config.rms_norm_eps (DeepseekV3Attention, Glm4MoeLiteAttention)
MLA_NORM_EPS = 1e-6


@dataclass(frozen=True)
class LatentKV:
    """One latent-attention layer's cache. Shapes: latent [T, kv_lora_rank] (normed),
    rope_key [T, qk_rope_head_dim] (roped)."""

    latent: np.ndarray
    rope_key: np.ndarray

    @staticmethod
    def empty(cfg: ModelConfig) -> "LatentKV":
        return LatentKV(np.zeros((0, cfg.mla.kv_lora_rank), np.float32),
                        np.zeros((0, cfg.mla.qk_rope_head_dim), np.float32))

    @property
    def length(self) -> int:
        return self.latent.shape[0]

    def trim(self, n: int) -> "LatentKV":
        """The first n positions (every position is kept, so any n works)."""
        return LatentKV(self.latent[:n], self.rope_key[:n])


def yarn_mscale(factor: float, mscale: float) -> float:
    """DeepSeek's YaRN magnitude factor: 0.1 mscale ln(factor) + 1 (1 when not scaled up)."""
    return 1.0 if factor <= 1 else 0.1 * mscale * math.log(factor) + 1.0


def softmax_scale(cfg: ModelConfig) -> float:
    """What the scores are multiplied by: (n + r)^-1/2, times yarn_mscale(factor, mscale_all_dim)^2
    under YaRN with mscale_all_dim (DeepSeek-V3, Kimi-K2: the attention's temperature follows the
    context extension; transformers' `yarn_apply_mscale`)."""
    scale = 1.0 / math.sqrt(cfg.mla.qk_nope_head_dim + cfg.mla.qk_rope_head_dim)
    if cfg.yarn.rope_scaling is RopeScaling.YARN and cfg.yarn.yarn_mscale_all_dim:
        scale *= yarn_mscale(cfg.yarn.yarn_factor, cfg.yarn.yarn_mscale_all_dim) ** 2
    return scale


def rope_cos_sin(cfg: ModelConfig, positions: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
    """cos and sin of the rope dims' angles (float64, rounded once; YaRN's frequencies, times its
    attention factor, where the config scales), for the r = qk_rope_head_dim rotated dims.

    Shapes: positions [T] -> cos, sin float32 [T, r / 2]
    """
    inv_freq, factor = rope_frequencies(cfg, cfg.mla.qk_rope_head_dim)  # [r / 2]
    angles = np.asarray(positions, np.float64)[:, None] * inv_freq[None, :]
    return (np.cos(angles) * factor).astype(np.float32), (np.sin(angles) * factor).astype(np.float32)


def _rope(x: np.ndarray, cos: np.ndarray, sin: np.ndarray) -> np.ndarray:
    """Rotate half over the last axis. x [..., T, r]; cos, sin [T, r / 2] -> [..., T, r]"""
    half = x.shape[-1] // 2
    cos, sin = np.concatenate([cos, cos], axis=-1), np.concatenate([sin, sin], axis=-1)
    return x * cos + np.concatenate([-x[..., half:], x[..., :half]], axis=-1) * sin


def absorbed_is_cheaper(cfg: ModelConfig, t: int, s: int) -> bool:
    """Whether T new positions over S positions in all cost fewer multiply-adds absorbed than
    expanded (module docstring)."""
    c, n, r, v = cfg.mla.kv_lora_rank, cfg.mla.qk_nope_head_dim, cfg.mla.qk_rope_head_dim, cfg.mla.v_head_dim
    expanded = s * c * (n + v) + t * s * (n + r + v)
    absorbed = t * c * (n + v) + t * s * (2 * c + r)
    return absorbed < expanded


def mla(cfg: ModelConfig, dense: dict, layer: int, kv: LatentKV, x: np.ndarray, *,
        absorbed: bool | None = None) -> tuple[np.ndarray, LatentKV]:
    """Causal latent attention of the new positions over the cache and themselves.
    absorbed: the form (None: the cheaper, `absorbed_is_cheaper`).

    Shapes:
        x: [T, D] (already normed) -> ([T, D], LatentKV with T more positions)
    """
    nm = TensorNames
    dense = as_dense_weights(dense)  # a plain dict of float32 arrays (tests) is wrapped
    w = lambda s: dense[nm.block(layer, s)]  # noqa: E731
    proj = lambda s, a: dense.linear(nm.block(layer, s), a)  # noqa: E731  a W^T
    t, h = x.shape[0], cfg.n_heads
    c, n, r, v = cfg.mla.kv_lora_rank, cfg.mla.qk_nope_head_dim, cfg.mla.qk_rope_head_dim, cfg.mla.v_head_dim
    if cfg.mla.q_lora_rank:
        q = proj(nm.attn_q_b, rms_norm(proj(nm.attn_q_a, x), w(nm.attn_q_a_norm), MLA_NORM_EPS))
    else:
        q = proj(nm.attn_q, x)
    q = q.reshape(t, h, n + r).transpose(1, 0, 2)  # [H, T, n + r]
    kva = proj(nm.attn_kv_a_mqa, x)  # [T, c + r]
    latent = rms_norm(kva[:, :c], w(nm.attn_kv_a_norm), MLA_NORM_EPS)  # [T, c]
    positions = np.arange(kv.length, kv.length + t)
    cos, sin = rope_cos_sin(cfg, positions)  # [T, r / 2]
    q_nope, q_rope = q[..., :n], _rope(q[..., n:], cos, sin)  # [H, T, n], [H, T, r]
    k_rope = _rope(kva[:, c:], cos, sin)  # [T, r]
    state = LatentKV(np.concatenate([kv.latent, latent]), np.concatenate([kv.rope_key, k_rope]))
    s = state.length
    kvb = w(nm.attn_kv_b).reshape(h, n + v, c)  # [H, n + v, c]
    w_uk, w_uv = kvb[:, :n], kvb[:, n:]  # [H, n, c], [H, v, c]
    if absorbed is None:
        absorbed = absorbed_is_cheaper(cfg, t, s)
    rope_scores = q_rope @ state.rope_key.T  # [H, T, S]
    if absorbed:
        q_lat = q_nope @ w_uk  # [H, T, c]
        scores = q_lat @ state.latent.T + rope_scores
    else:
        k_nope = np.einsum("hnc,sc->hsn", w_uk, state.latent)  # [H, S, n]
        scores = q_nope @ k_nope.transpose(0, 2, 1) + rope_scores
    scores = scores * np.float32(softmax_scale(cfg))
    causal = np.arange(s)[None, :] <= positions[:, None]  # [T, S]
    scores = np.where(causal[None], scores, np.float32(-np.inf))
    scores = scores - scores.max(axis=-1, keepdims=True)
    probs = np.exp(scores)
    probs /= probs.sum(axis=-1, keepdims=True)  # [H, T, S]
    if absorbed:
        out = (probs @ state.latent) @ w_uv.transpose(0, 2, 1)  # [H, T, c] -> [H, T, v]
    else:
        values = np.einsum("hvc,sc->hsv", w_uv, state.latent)  # [H, S, v]
        out = probs @ values
    out = out.transpose(1, 0, 2).reshape(t, h * v)  # [T, H*v]
    return proj(nm.attn_output, out).astype(np.float32), state
