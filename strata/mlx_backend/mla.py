"""Multi-head latent attention on MLX arrays: the twin of strata.reference.mla.

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

A decoded position (T = 1) on a kernel path takes the absorbed form in custom kernels instead
(`kernel_applies`; kernels/mla.py): the a-projections (W_qa and W_kva stacked, one GEMV with the
layer's norm), the q up-projection (GEMV with q_a_norm), the three MLA kernels (absorbed query and
the new cache row, flash-decoding splits over the cached rows, their merge times W_uv), and the
output projection (GEMVs over column blocks of at most MAX_COLS: DeepSeek-V3's H v = 16384
activations do not fit one block's threadgroup memory). That path reads the position from the
device (`pos`), so the compiled decode step can trace it; the ops forms slice the cache by the
Python length.

Shapes: T new positions, S = length + T, D hidden, H heads; c = kv_lora_rank, n = qk_nope_head_dim,
r = qk_rope_head_dim, v = v_head_dim.
"""

from __future__ import annotations

from dataclasses import dataclass

import mlx.core as mx
import numpy as np

from strata.formats.dense_weights import StoredTensor, as_dense_weights
from strata.mlx_backend.attention import check_context, rms_norm, softmax_with_sinks
from strata.mlx_backend.dense import Q8Dense, Weight, held_rows_of, linear
from strata.mlx_backend.dense import held as held_weight
from strata.mlx_backend.kernels import dense_gemv as dense_kernel
from strata.mlx_backend.kernels import mla as mla_kernel
from strata.mlx_backend.kernels.launch import KernelPath, current_path
from strata.model_config import ModelConfig, TensorNames
from strata.reference.mla import MLA_NORM_EPS, absorbed_is_cheaper, rope_cos_sin, softmax_scale

__all__ = ["MlxLatentKV", "MlaWeights", "mla_weights", "mla", "mla_partials", "kernel_applies", "rope_table"]


@dataclass(frozen=True, eq=False)
class MlxLatentKV:
    """One latent-attention layer's cache: buffer float32 [max_context, c + r] (normed latent,
    then roped rope key), `length` rows used. Successive values of a layer share the buffer
    (written in place), so only the newest is valid."""

    buffer: mx.array
    length: int

    @staticmethod
    def empty(cfg: ModelConfig) -> "MlxLatentKV":
        buf = mx.zeros((cfg.max_context, cfg.mla.kv_lora_rank + cfg.mla.qk_rope_head_dim), mx.float32)
        mx.eval(buf)
        return MlxLatentKV(buf, 0)

    def trim(self, n: int) -> "MlxLatentKV":
        """The first n positions (every position is kept, so any n works; later rows are written over)."""
        return MlxLatentKV(self.buffer, min(int(n), self.length))

    def latent(self, cfg: ModelConfig) -> mx.array:
        """The cached latents [length, c] (the reference's LatentKV.latent)."""
        return self.buffer[:self.length, :cfg.mla.kv_lora_rank]

    def rope_key(self, cfg: ModelConfig) -> mx.array:
        """The cached rope keys [length, r] (the reference's LatentKV.rope_key)."""
        return self.buffer[:self.length, cfg.mla.kv_lora_rank:]


@dataclass(frozen=True, eq=False)
class MlaWeights:
    """One latent-attention layer's weights: the projections as stored (mlx_backend/dense.py:
    float16 on kernel paths, the stored type widened per op on the ops path, Q8_0 as its planes),
    the norms and W_kvb's halves float16 / float32; computed in float32 either way. W_qa and W_kva
    are stacked (one GEMV of the normed input on the kernel path), W_kvb is split per head once
    here, as the reference splits it, and W_o is kept as column blocks of at most MAX_COLS (the
    GEMV kernel's activations; one block below it).

    Shapes: norm [D]; a [q_lora_rank + c + r, D] (W_qa rows, then W_kva; W_kva alone without a q
    low-rank path); q_a_norm [q_lora_rank] or None; q_b [H (n + r), q_lora_rank or D] (W_q without
    a q low-rank path); kv_a_norm [c]; w_uk [H, n, c]; w_uv [H, v, c]; wo_blocks: [D, <= MAX_COLS]
    each, together [D, H v]
    """

    norm: mx.array
    a: Weight
    q_a_norm: mx.array | None
    q_b: Weight
    kv_a_norm: mx.array
    w_uk: mx.array
    w_uv: mx.array
    wo_blocks: tuple[Weight, ...]

    @property
    def q_lora_rank(self) -> int:
        return 0 if self.q_a_norm is None else self.q_a_norm.shape[0]

    def arrays(self) -> list[mx.array]:
        held = (self.norm, self.a, self.q_a_norm, self.q_b, self.kv_a_norm, self.w_uk, self.w_uv, *self.wo_blocks)
        return [x for a in held if a is not None for x in (a.arrays() if isinstance(a, Q8Dense) else [a])]


def _column_blocks(t, dtype: mx.Dtype) -> tuple[Weight, ...]:
    """A stored matrix (float32 numpy or StoredTensor) held as column blocks of at most MAX_COLS,
    each contiguous (a kernel input that is a view would be copied on every launch)."""
    cols, step = t.shape[1], dense_kernel.MAX_COLS
    if isinstance(t, StoredTensor) and t.qtype.whole_blocks:  # llama.cpp's blocks (a GGUF's Q6_K): rows of
        t = t.widen()                                         # 256-weight blocks cut by column only when widened
    out = []
    for i in range(0, cols, step):
        j = min(cols, i + step)
        if isinstance(t, StoredTensor):
            scales = None if t.scales is None else np.ascontiguousarray(t.scales[:, i // 32:j // 32])  # Q8_0 blocks
            part = StoredTensor(t.qtype, (t.shape[0], j - i), np.ascontiguousarray(t.codes[:, i:j]), scales)
        else:
            part = np.ascontiguousarray(np.asarray(t, np.float32)[:, i:j])
        out.append(held_weight(part, dtype))
    return tuple(out)


def mla_weights(cfg: ModelConfig, dense, layer: int, dtype: mx.Dtype) -> MlaWeights:
    """A layer's MlaWeights from the reference's dense dict (float32 numpy or stored tensors,
    mla_tensor_shapes)."""
    nm = TensorNames
    get = lambda s: np.asarray(dense[nm.block(layer, s)], np.float32)  # noqa: E731
    arr = lambda a: mx.array(a).astype(dtype)  # noqa: E731
    stored = as_dense_weights(dense)
    held = lambda s: held_weight(stored.stored(nm.block(layer, s)), dtype)  # noqa: E731  as stored
    h, n, v = cfg.n_heads, cfg.mla.qk_nope_head_dim, cfg.mla.v_head_dim
    kvb = get(nm.attn_kv_b).reshape(h, n + v, cfg.mla.kv_lora_rank)  # per head: n key rows, then v value rows
    low_rank = bool(cfg.mla.q_lora_rank)
    a = (held_rows_of(dense, [nm.block(layer, nm.attn_q_a), nm.block(layer, nm.attn_kv_a_mqa)], dtype) if low_rank
         else held(nm.attn_kv_a_mqa))
    return MlaWeights(arr(get(nm.attn_norm)), a, arr(get(nm.attn_q_a_norm)) if low_rank else None,
                      held(nm.attn_q_b if low_rank else nm.attn_q), arr(get(nm.attn_kv_a_norm)),
                      arr(kvb[:, :n]), arr(kvb[:, n:]), _column_blocks(stored.stored(nm.block(layer, nm.attn_output)), dtype))


_tables: dict[tuple, tuple[mx.array, mx.array]] = {}


def rope_table(cfg: ModelConfig) -> tuple[mx.array, mx.array]:
    """cos, sin float32 [max_context, r / 2]: the reference's `rope_cos_sin` of every position
    (float64 angles, YaRN's frequencies and factor where the config scales), rounded once."""
    key = (cfg.mla.qk_rope_head_dim, cfg.rope_theta, cfg.max_context, cfg.yarn)  # every YaRN number is in cfg.yarn
    if key not in _tables:
        cos, sin = rope_cos_sin(cfg, np.arange(cfg.max_context))
        _tables[key] = (mx.array(cos), mx.array(sin))
    return _tables[key]


def _rope(a: mx.array, cos: mx.array, sin: mx.array) -> mx.array:
    """Rotate half over the last axis. a [..., T, r]; cos, sin [T, r / 2] -> [..., T, r]"""
    half = a.shape[-1] // 2
    cos, sin = mx.concatenate([cos, cos], axis=-1), mx.concatenate([sin, sin], axis=-1)
    return a * cos + mx.concatenate([-a[..., half:], a[..., :half]], axis=-1) * sin


def kernel_applies(cfg: ModelConfig, w: MlaWeights) -> bool:
    """Whether a decoded position of this layer takes the kernel path (on the current path)."""
    cols = (cfg.hidden_size, w.q_b.shape[1])
    return (current_path() is not KernelPath.OPS and w.a.dtype == mx.float16 and w.q_b.dtype == mx.float16
            and all(c % 8 == 0 and c <= dense_kernel.MAX_COLS for c in cols)
            and all(b.dtype == mx.float16 and b.shape[1] % 8 == 0 for b in w.wo_blocks)
            and mla_kernel.fits(cfg.mla.kv_lora_rank, cfg.mla.qk_rope_head_dim))


def _project_out(w: MlaWeights, out: mx.array, gemv: bool) -> mx.array:
    """out [T, H v] -> [T, D]: W_o block by block (the GEMV kernel, or float32 ops)."""
    y, lo = None, 0
    for b in w.wo_blocks:
        part = out[:, lo:lo + b.shape[1]]
        part = dense_kernel.dense_gemv(b, part) if gemv else linear(part, b)
        y = part if y is None else y + part
        lo += b.shape[1]
    return y


def _kernel_decode(cfg: ModelConfig, w: MlaWeights, kv: MlxLatentKV, x: mx.array, norm: mx.array | None,
                   pos: mx.array | None, splits: int | None) -> tuple[mx.array, MlxLatentKV]:
    """One decoded position on the kernel path (module doc): x [1, D] (the residual when `norm`
    is the layer's norm, else already normed) -> ([1, D], MlxLatentKV one position on)."""
    check_context(cfg, kv.length, 1)
    ql = w.q_lora_rank
    eps = cfg.rms_norm_eps if norm is not None else 0.0
    a = dense_kernel.dense_gemv(w.a, x, norm, eps)  # [1, q_lora_rank + c + r] (or [1, c + r])
    if ql:
        q = dense_kernel.dense_gemv(w.q_b, a[:, :ql], w.q_a_norm, MLA_NORM_EPS)  # [1, H (n + r)]
        kva = a[:, ql:]
    else:
        q = dense_kernel.dense_gemv(w.q_b, x, norm, eps)
        kva = a
    cos, sin = rope_table(cfg)
    out = mla_kernel.mla_decode(q, kva, w.w_uk, w.w_uv, w.kv_a_norm, cos, sin, kv.buffer, kv.length, eps=MLA_NORM_EPS,
                                scale=softmax_scale(cfg), pos_param=pos, splits=splits)  # [1, H v]
    return _project_out(w, out, gemv=True), MlxLatentKV(kv.buffer, kv.length + 1)


def mla(cfg: ModelConfig, w: MlaWeights, kv: MlxLatentKV, x: mx.array, *,
        absorbed: bool | None = None) -> tuple[mx.array, MlxLatentKV]:
    """Twin of reference `mla` (x already normed; the weights as MlaWeights, not the dense dict).
    absorbed: the form (None: the cheaper, `absorbed_is_cheaper`, the reference's rule). A
    decoded position in the absorbed form on a kernel path runs the kernels (`kernel_applies`).

    Shapes:
        x float32 [T, D] -> (float32 [T, D], MlxLatentKV with T more positions)
    """
    t, h = x.shape[0], cfg.n_heads
    c, n, r, v = cfg.mla.kv_lora_rank, cfg.mla.qk_nope_head_dim, cfg.mla.qk_rope_head_dim, cfg.mla.v_head_dim
    if t == 1 and absorbed is not False and kernel_applies(cfg, w):
        return _kernel_decode(cfg, w, kv, x, None, None, None)
    check_context(cfg, kv.length, t)
    f32 = lambda a: a.astype(mx.float32)  # noqa: E731
    x = f32(x)
    ql = w.q_lora_rank
    a = linear(x, w.a)  # [T, q_lora_rank + c + r]
    if ql:
        q = linear(rms_norm(a[:, :ql], w.q_a_norm, MLA_NORM_EPS), w.q_b)
    else:
        q = linear(x, w.q_b)
    q = q.reshape(t, h, n + r).transpose(1, 0, 2)  # [H, T, n + r]
    kva = a[:, ql:]  # [T, c + r]
    latent = rms_norm(kva[:, :c], w.kv_a_norm, MLA_NORM_EPS)  # [T, c]
    start = kv.length
    cos_t, sin_t = rope_table(cfg)
    cos, sin = cos_t[start:start + t], sin_t[start:start + t]  # [T, r / 2]
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
    scores = scores * np.float32(softmax_scale(cfg))
    causal = mx.arange(s)[None, :] <= mx.arange(start, s)[:, None]  # [T, S]
    probs = softmax_with_sinks(mx.where(causal[None], scores, -np.inf), None)  # [H, T, S]
    if absorbed:
        out = (probs @ lat) @ w_uv.transpose(0, 2, 1)  # [H, T, c] -> [H, T, v]
    else:
        out = probs @ (w_uv @ lat.T).transpose(0, 2, 1)  # expanded values [H, S, v]
    out = out.transpose(1, 0, 2).reshape(t, h * v)  # [T, H v]
    return _project_out(w, out, gemv=False), MlxLatentKV(buf, s)


def mla_partials(cfg: ModelConfig, w: MlaWeights, kv: MlxLatentKV, x: mx.array, *,
                 pos: mx.array | None = None, splits: int | None = None) -> tuple[mx.array, MlxLatentKV]:
    """The layer's mixer as one partial (the reference's mixer_block without the residual add):
    mla(rms_norm(x)); a decoded position on a kernel path fuses the norm into its first GEMV.
    pos: kv.length on the device (kernel path only: the compiled decode); splits: the attend
    kernel's position splits (None: the kernel's MAX_SPLITS, the same at every length).

    Shapes:
        x float32 [T, D] (the residual, not yet normed) -> ([T, 1, D], MlxLatentKV with T more positions)
    """
    if x.shape[0] == 1 and kernel_applies(cfg, w):
        if pos is not None and splits is None:  # traced once for every later length: the most splits
            splits = mla_kernel.MAX_SPLITS
        out, kv = _kernel_decode(cfg, w, kv, x, w.norm, pos, splits)
        return out[:, None, :], kv
    if pos is not None:
        raise ValueError("latent attention: a device position needs the kernel path (the ops slice by the length)")
    out, kv = mla(cfg, w, kv, rms_norm(x, w.norm, cfg.rms_norm_eps))
    return out[:, None, :], kv
