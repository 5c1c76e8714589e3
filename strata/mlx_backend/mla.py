"""Multi-head latent attention on MLX arrays: the twin of strata.reference.mla (ops only, no kernel yet).

The cache is preallocated per layer like `MlxLayerKV`: one float32 buffer [max_context, c + r]
whose row p holds position p's normed latent [c] then its roped rope key [r] (what the reference's
`LatentKV` holds in two arrays), written in place at length..length+T-1 by one slice update. So
`trim` is a shorter length over the same buffer, and a position costs (c + r) floats, not the
2·H·(n + v) of expanded keys and values.

The form is the reference's choice (`absorbed_is_cheaper`): a decoded token absorbs W_uk into
the query and W_uv after the softmax, a long prompt chunk expands the cached latents into per-head
keys and values. RoPE is the reference's "rotate half" over the r rope dims of each head (the
converter laid DeepSeek's interleaved rope rows out so), with a cos/sin table computed once on the
host in float64 exactly as the reference computes its angles.

No attention kernel reads this layer yet: the compiled decode step refuses it
(compiled.py `unsupported`), since these ops slice the cache by the Python length.

Shapes: T new positions, S = length + T, D hidden, H heads; c = kv_lora_rank, n = qk_nope_head_dim,
r = qk_rope_head_dim, v = v_head_dim.
"""

from __future__ import annotations

from dataclasses import dataclass

import mlx.core as mx
import numpy as np

from strata.formats.dense_weights import as_dense_weights
from strata.mlx_backend.attention import check_context, rms_norm, softmax_with_sinks
from strata.mlx_backend.dense import held as held_weight
from strata.mlx_backend.dense import linear
from strata.model_config import ModelConfig, TensorNames
from strata.reference.mla import MLA_NORM_EPS, absorbed_is_cheaper

__all__ = ["MlxLatentKV", "MlaWeights", "mla_weights", "mla", "mla_partials"]


@dataclass(frozen=True, eq=False)
class MlxLatentKV:
    """One latent-attention layer's cache: buffer float32 [max_context, c + r] (normed latent,
    then roped rope key), `length` rows used. Successive values of a layer share the buffer
    (written in place), so only the newest is valid."""

    buffer: mx.array
    length: int

    @staticmethod
    def empty(cfg: ModelConfig) -> "MlxLatentKV":
        buf = mx.zeros((cfg.max_context, cfg.kv_lora_rank + cfg.qk_rope_head_dim), mx.float32)
        mx.eval(buf)
        return MlxLatentKV(buf, 0)

    def trim(self, n: int) -> "MlxLatentKV":
        """The first n positions (every position is kept, so any n works; later rows are written over)."""
        return MlxLatentKV(self.buffer, min(int(n), self.length))

    def latent(self, cfg: ModelConfig) -> mx.array:
        """The cached latents [length, c] (the reference's LatentKV.latent)."""
        return self.buffer[:self.length, :cfg.kv_lora_rank]

    def rope_key(self, cfg: ModelConfig) -> mx.array:
        """The cached rope keys [length, r] (the reference's LatentKV.rope_key)."""
        return self.buffer[:self.length, cfg.kv_lora_rank:]


@dataclass(frozen=True, eq=False)
class MlaWeights:
    """One latent-attention layer's weights (float16 on kernel paths, float32 on the ops path;
    computed in float32 either way). W_kvb is split per head once here, as the reference splits it.

    Shapes: norm [D]; q_a [q_lora_rank, D] and q_a_norm [q_lora_rank] or None; q_b [H (n + r),
    q_lora_rank or D] (W_q without a q low-rank path); kv_a [c + r, D]; kv_a_norm [c];
    w_uk [H, n, c]; w_uv [H, v, c]; wo [D, H v]
    """

    norm: mx.array
    q_a: mx.array | None
    q_a_norm: mx.array | None
    q_b: mx.array
    kv_a: mx.array
    kv_a_norm: mx.array
    w_uk: mx.array
    w_uv: mx.array
    wo: mx.array

    def arrays(self) -> list[mx.array]:
        return [a for a in (self.norm, self.q_a, self.q_a_norm, self.q_b, self.kv_a, self.kv_a_norm, self.w_uk,
                            self.w_uv, self.wo) if a is not None]


def mla_weights(cfg: ModelConfig, dense, layer: int, dtype: mx.Dtype) -> MlaWeights:
    """A layer's MlaWeights from the reference's dense dict (float32 numpy, mla_tensor_shapes)."""
    nm = TensorNames
    get = lambda s: np.asarray(dense[nm.block(layer, s)], np.float32)  # noqa: E731
    arr = lambda a: mx.array(a).astype(dtype)  # noqa: E731
    held = lambda s: held_weight(as_dense_weights(dense).stored(nm.block(layer, s)), dtype)  # noqa: E731  as stored
    h, n, v = cfg.n_heads, cfg.qk_nope_head_dim, cfg.v_head_dim
    kvb = get(nm.attn_kv_b).reshape(h, n + v, cfg.kv_lora_rank)  # per head: n key rows, then v value rows
    low_rank = bool(cfg.q_lora_rank)
    # the projections as stored (mlx_backend/dense.py); kv_b is split per head, so it is widened here
    return MlaWeights(arr(get(nm.attn_norm)),
                      held(nm.attn_q_a) if low_rank else None,
                      arr(get(nm.attn_q_a_norm)) if low_rank else None,
                      held(nm.attn_q_b if low_rank else nm.attn_q),
                      held(nm.attn_kv_a_mqa), arr(get(nm.attn_kv_a_norm)),
                      arr(kvb[:, :n]), arr(kvb[:, n:]), held(nm.attn_output))


_tables: dict[tuple, tuple[mx.array, mx.array]] = {}


def _rope_table(cfg: ModelConfig) -> tuple[mx.array, mx.array]:
    """cos, sin float32 [max_context, r]: the reference `rope`'s angles for an r-wide head
    (float64, both halves), rounded once."""
    key = (cfg.qk_rope_head_dim, cfg.rope_theta, cfg.max_context)
    if key not in _tables:
        r = cfg.qk_rope_head_dim
        inv_freq = 1.0 / (cfg.rope_theta ** (np.arange(0, r, 2, dtype=np.float64) / r))  # [r/2]
        angles = np.arange(cfg.max_context, dtype=np.float64)[:, None] * inv_freq[None, :]
        angles = np.concatenate([angles, angles], axis=-1)  # [max_context, r]
        _tables[key] = (mx.array(np.cos(angles).astype(np.float32)), mx.array(np.sin(angles).astype(np.float32)))
    return _tables[key]


def _rope(a: mx.array, cos: mx.array, sin: mx.array) -> mx.array:
    """Rotate half over the last axis. a [..., T, r]; cos, sin [T, r] -> [..., T, r]"""
    half = a.shape[-1] // 2
    return a * cos + mx.concatenate([-a[..., half:], a[..., :half]], axis=-1) * sin


def mla(cfg: ModelConfig, w: MlaWeights, kv: MlxLatentKV, x: mx.array, *,
        absorbed: bool | None = None) -> tuple[mx.array, MlxLatentKV]:
    """Twin of reference `mla` (x already normed; the weights as MlaWeights, not the dense dict).
    absorbed: the form (None: the cheaper, `absorbed_is_cheaper`, the reference's rule).

    Shapes:
        x float32 [T, D] -> (float32 [T, D], MlxLatentKV with T more positions)
    """
    t, h = x.shape[0], cfg.n_heads
    c, n, r, v = cfg.kv_lora_rank, cfg.qk_nope_head_dim, cfg.qk_rope_head_dim, cfg.v_head_dim
    check_context(cfg, kv.length, t)
    f32 = lambda a: a.astype(mx.float32)  # noqa: E731
    x = f32(x)
    if w.q_a is not None:
        q = linear(rms_norm(linear(x, w.q_a), w.q_a_norm, MLA_NORM_EPS), w.q_b)
    else:
        q = linear(x, w.q_b)
    q = q.reshape(t, h, n + r).transpose(1, 0, 2)  # [H, T, n + r]
    kva = linear(x, w.kv_a)  # [T, c + r]
    latent = rms_norm(kva[:, :c], w.kv_a_norm, MLA_NORM_EPS)  # [T, c]
    start = kv.length
    cos_t, sin_t = _rope_table(cfg)
    cos, sin = cos_t[start:start + t], sin_t[start:start + t]  # [T, r]
    q_nope, q_rope = q[..., :n], _rope(q[..., n:], cos, sin)  # [H, T, n], [H, T, r]
    k_rope = _rope(kva[:, c:], cos, sin)  # [T, r]
    buf = kv.buffer
    buf[start:start + t, :] = mx.concatenate([latent, k_rope], axis=-1)  # in place: nothing else aliases it
    s = start + t
    lat, keys = buf[:s, :c], buf[:s, c:]  # [S, c], [S, r]
    w_uk, w_uv = f32(w.w_uk), f32(w.w_uv)  # [H, n, c], [H, v, c]
    if absorbed is None:
        absorbed = absorbed_is_cheaper(cfg, t, s)
    rope_scores = q_rope @ keys.T  # [H, T, S]
    if absorbed:
        scores = (q_nope @ w_uk) @ lat.T + rope_scores  # q_lat [H, T, c] against every latent
    else:
        scores = q_nope @ (w_uk @ lat.T) + rope_scores  # expanded keys [H, n, S]
    scores = scores / np.float32(np.sqrt(n + r))
    causal = mx.arange(s)[None, :] <= mx.arange(start, s)[:, None]  # [T, S]
    probs = softmax_with_sinks(mx.where(causal[None], scores, -np.inf), None)  # [H, T, S]
    if absorbed:
        out = (probs @ lat) @ w_uv.transpose(0, 2, 1)  # [H, T, c] -> [H, T, v]
    else:
        out = probs @ (w_uv @ lat.T).transpose(0, 2, 1)  # expanded values [H, S, v]
    out = out.transpose(1, 0, 2).reshape(t, h * v)  # [T, H v]
    return linear(out, w.wo), MlxLatentKV(buf, s)


def mla_partials(cfg: ModelConfig, w: MlaWeights, kv: MlxLatentKV, x: mx.array) -> tuple[mx.array, MlxLatentKV]:
    """The layer's mixer as one partial (the reference's mixer_block without the residual add):
    mla(rms_norm(x)).

    Shapes:
        x float32 [T, D] (the residual, not yet normed) -> ([T, 1, D], MlxLatentKV with T more positions)
    """
    out, kv = mla(cfg, w, kv, rms_norm(x, w.norm, cfg.rms_norm_eps))
    return out[:, None, :], kv
