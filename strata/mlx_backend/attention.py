"""Grouped-query attention on MLX arrays: the twin of strata.reference.attention.

Three layers (STYLE §4): the kernels, an MLX-ops path, and `attention_partials` which chooses.
The kernel path is three launches (kernels/attention.py says why, with the H200's numbers):
the QKV projection (kernels/dense_gemv.py: RMSNorm + W_qkv + bias -> raw q | k | v rows),
`attend` (q/k RMSNorm + RoPE, partial where the model's is, attention over the cache and the
chunk's own positions, cache write, the output gate where the model has one) and the output
projection (dense_gemv). A gated layer's gate rows are stacked under W_qkv, so its projection
stays one GEMV on both paths. The KV cache is preallocated per layer
([KVH, max_context, HD] float32) and written in place at positions length..length+T-1 (kernel
path: by `attend`; ops path: one slice update, in place when nothing else aliases the cache).

RoPE uses a cos/sin table computed once on the host in float64 exactly as the reference
computes its angles (YaRN's scaled frequencies and attention factor included), so both paths
rotate by the reference's float32 values.

gpt-oss's options (attention sinks, the output bias, sliding-window layers) run on the ops path
only: the attend kernel refuses such a layer (`_kernel_ok`). A sliding layer's cache keeps every
position like a full one (so trim restores any n); its ops attention reads only the keys some
query of the chunk can see.
"""

from __future__ import annotations

from dataclasses import dataclass

import mlx.core as mx
import numpy as np

from strata.mlx_backend.dense import linear
from strata.mlx_backend.kernels import attend_project, attend_split
from strata.mlx_backend.kernels import attention as attn_kernels
from strata.mlx_backend.kernels import dense_gemv as dense_kernel
from strata.mlx_backend.kernels.launch import KernelPath, current_path
from strata.model_config import ModelConfig, QKNorm
from strata.reference.attention import KVPrecision
from strata.reference.rope_scaling import rope_frequencies

__all__ = ["MlxLayerKV", "AttentionWeights", "rope_table", "rms_norm", "attention", "attention_partials",
           "kernel_applies", "check_context"]


def rms_norm(x: mx.array, weight: mx.array, eps: float) -> mx.array:
    """Twin of reference `rms_norm`: x / sqrt(mean(x^2) + eps) * weight, float32."""
    x = x.astype(mx.float32)
    inv = 1.0 / mx.sqrt(mx.mean(x * x, axis=-1, keepdims=True) + eps)
    return x * inv * weight.astype(mx.float32)


def rope_table(cfg: ModelConfig) -> tuple[mx.array, mx.array]:
    """cos, sin float32 [max_context, rope_dim/2]: the reference's angles (float64), rounded once
    (rope_dim: the rotated part of a head, the whole head but for partial rotary)."""
    inv_freq, scale = rope_frequencies(cfg)  # [rope_dim/2]; scale: YaRN's attention factor (else 1)
    angles = np.arange(cfg.max_context, dtype=np.float64)[:, None] * inv_freq[None, :]
    return (mx.array((np.cos(angles) * scale).astype(np.float32)),
            mx.array((np.sin(angles) * scale).astype(np.float32)))


@dataclass(frozen=True, eq=False)
class MlxLayerKV:
    """One layer's KV cache: buffers [n_kv_heads, max_context, head_dim] float32 (float16 for
    KVPrecision.F16), `length` used.

    The buffers are shared by successive MlxLayerKV values of a layer (written in place), so
    only the newest value of a layer is valid."""

    keys: mx.array
    values: mx.array
    length: int

    @staticmethod
    def empty(cfg: ModelConfig, precision: KVPrecision = KVPrecision.F32) -> "MlxLayerKV":
        """Zeroed buffers; float16 ones for KVPrecision.F16 (each key and value rounded as written)."""
        shape = (cfg.n_kv_heads, cfg.max_context, cfg.head_dim)
        dtype = mx.float16 if precision is KVPrecision.F16 else mx.float32
        k, v = mx.zeros(shape, dtype), mx.zeros(shape, dtype)
        mx.eval(k, v)
        return MlxLayerKV(k, v, 0)

    @property
    def precision(self) -> KVPrecision:
        return KVPrecision.F16 if self.keys.dtype == mx.float16 else KVPrecision.F32


@dataclass(frozen=True, eq=False)
class AttentionWeights:
    """One layer's attention weights (float16 on the kernel path, float32 on the ops path).

    Shapes: norm [D]; wqkv [(H + 2 KVH + gated H) HD, D] (q rows, then k, then v, then the
    output gate's when gated); bqkv like its rows or None; q_norm / k_norm [HD] (PER_HEAD) or
    [H HD] / [KVH HD] (FULL) or None; wo [D, H HD]
    """

    norm: mx.array
    wqkv: mx.array
    bqkv: mx.array | None
    q_norm: mx.array | None
    k_norm: mx.array | None
    wo: mx.array
    # Qwen3-Next / Qwen3.5: wqkv ends with the output gate's rows (one GEMV computes q | k | v |
    # gate); the attention output is multiplied by sigmoid(xn . gate)
    gated: bool = False
    sinks: mx.array | None = None  # float32 [H]: each head's sink logit (gpt-oss)
    bo: mx.array | None = None  # [D]: the output projection's bias (gpt-oss)
    window: int = 0  # a sliding layer's window (gpt-oss); 0: full attention


def kernel_applies(cfg: ModelConfig, w: AttentionWeights) -> bool:
    """Whether `attention_partials` takes the kernel path for this layer (on the current path)."""
    return _kernel_ok(cfg, w)


def _kernel_ok(cfg: ModelConfig, w: AttentionWeights) -> bool:
    return (current_path() is not KernelPath.OPS and w.wqkv.dtype == mx.float16 and cfg.qk_norm is not QKNorm.FULL
            and w.sinks is None and w.bo is None and not w.window  # gpt-oss's take the ops path
            and cfg.hidden_size % 8 == 0 and cfg.head_dim % 8 == 0 and cfg.head_dim <= attn_kernels.MAX_HEAD_DIM
            and cfg.hidden_size <= dense_kernel.MAX_COLS and cfg.n_heads * cfg.head_dim <= dense_kernel.MAX_COLS)


def qkv_heads(cfg: ModelConfig, w: AttentionWeights, qkv: mx.array) -> tuple[mx.array, ...]:
    """The QKV projection's rows as heads, the layer's q/k norms applied (the ops path and the
    prompt path's fallback both take it).

    Shapes:
        qkv float32 [T, QR + 2 KR (+ QR gate columns)] -> q [H, T, HD], k, v [KVH, T, HD],
        gate [T, QR] (no columns: ungated)
    """
    t, hd, h, kvh = qkv.shape[0], cfg.head_dim, cfg.n_heads, cfg.n_kv_heads
    qr, kr = h * hd, kvh * hd
    q, k, v, gate = qkv[:, :qr], qkv[:, qr:qr + kr], qkv[:, qr + kr:qr + 2 * kr], qkv[:, qr + 2 * kr:]
    if cfg.qk_norm is QKNorm.FULL:
        q, k = rms_norm(q, w.q_norm, cfg.rms_norm_eps), rms_norm(k, w.k_norm, cfg.rms_norm_eps)
    q = q.reshape(t, h, hd).transpose(1, 0, 2)  # [H, T, hd]
    k = k.reshape(t, kvh, hd).transpose(1, 0, 2)  # [KVH, T, hd]
    v = v.reshape(t, kvh, hd).transpose(1, 0, 2)
    if cfg.qk_norm is QKNorm.PER_HEAD:
        q, k = rms_norm(q, w.q_norm, cfg.rms_norm_eps), rms_norm(k, w.k_norm, cfg.rms_norm_eps)
    return q, k, v, gate


def _ops(cfg: ModelConfig, w: AttentionWeights, kv: MlxLayerKV, x: mx.array) -> tuple[mx.array, MlxLayerKV]:
    t = x.shape[0]
    hd, h, kvh = cfg.head_dim, cfg.n_heads, cfg.n_kv_heads
    qr = h * hd
    f32 = lambda a: a.astype(mx.float32)  # noqa: E731
    xn = rms_norm(x, w.norm, cfg.rms_norm_eps)
    qkv = linear(xn, w.wqkv)  # [T, QR + 2 KR (+ QR gate columns)]; widened per op (dense.py)
    if w.bqkv is not None:
        qkv = qkv + f32(w.bqkv)
    q, k, v, gate = qkv_heads(cfg, w, qkv)
    cos_t, sin_t = rope_table_cached(cfg)
    start = kv.length
    rd = cfg.rope_dim  # the rotated dims: the first rd of each head (partial rotary), the rest pass
    cos = mx.concatenate([cos_t[start:start + t]] * 2, axis=-1)  # [T, rd]
    sin = mx.concatenate([sin_t[start:start + t]] * 2, axis=-1)
    rot = lambda a: mx.concatenate([-a[..., rd // 2:rd], a[..., :rd // 2]], axis=-1)  # noqa: E731
    rope = lambda a: mx.concatenate([a[..., :rd] * cos + rot(a) * sin, a[..., rd:]], axis=-1)  # noqa: E731
    q, k = rope(q), rope(k)
    keys, values = kv.keys, kv.values
    keys[:, start:start + t, :] = k.astype(keys.dtype)  # float16 buffers: rounded as stored
    values[:, start:start + t, :] = v.astype(values.dtype)
    s = start + t
    lo = max(0, start - w.window + 1) if w.window else 0  # the first key any query here sees
    group = h // kvh
    kh = mx.repeat(f32(keys[:, lo:s]), group, axis=0)  # [H, S - lo, hd]
    vh = mx.repeat(f32(values[:, lo:s]), group, axis=0)
    scores = (q @ kh.transpose(0, 2, 1)) / np.float32(np.sqrt(hd))  # [H, T, S - lo]
    key_pos, query_pos = mx.arange(lo, s)[None, :], mx.arange(start, s)[:, None]
    visible = key_pos <= query_pos  # [T, S - lo]
    if w.window:
        visible = visible & (key_pos > query_pos - w.window)
    scores = mx.where(visible[None], scores, -np.inf)
    probs = softmax_with_sinks(scores, w.sinks)
    out = (probs @ vh).transpose(1, 0, 2).reshape(t, qr)  # [T, H*hd]
    if w.gated:
        out = out * mx.sigmoid(gate)
    out = linear(out, w.wo)
    if w.bo is not None:
        out = out + f32(w.bo)
    return out, MlxLayerKV(keys, values, s)


def softmax_with_sinks(scores: mx.array, sinks: mx.array | None) -> mx.array:
    """Twin of reference `softmax_with_sinks`. scores [H, T, S]; sinks float32 [H] or None -> [H, T, S]"""
    top = scores.max(axis=-1, keepdims=True)
    if sinks is None:
        probs = mx.exp(scores - top)
        return probs / probs.sum(axis=-1, keepdims=True)
    sink = sinks.astype(mx.float32)[:, None, None]  # [H, 1, 1]
    top = mx.maximum(top, sink)
    probs = mx.exp(scores - top)
    return probs / (probs.sum(axis=-1, keepdims=True) + mx.exp(sink - top))


_tables: dict[tuple, tuple[mx.array, mx.array]] = {}


def rope_table_cached(cfg: ModelConfig) -> tuple[mx.array, mx.array]:
    key = (cfg.rope_dim, cfg.rope_theta, cfg.max_context, cfg.rope_scaling, cfg.yarn_factor, cfg.yarn_original_context,
           cfg.yarn_beta_fast, cfg.yarn_beta_slow, cfg.yarn_truncate, cfg.yarn_attention_factor)
    if key not in _tables:
        _tables[key] = rope_table(cfg)
    return _tables[key]


def check_context(cfg: ModelConfig, length: int, t: int) -> None:
    """t more positions after `length` fit the model's context, else a ValueError saying so."""
    if length + t > cfg.max_context:
        raise ValueError(f"attention: {length + t} positions exceed the context of {cfg.max_context}")


def attention_partials(cfg: ModelConfig, w: AttentionWeights, kv: MlxLayerKV, x: mx.array, *,
                       pos: mx.array | None = None) -> tuple[mx.array, MlxLayerKV]:
    """The attention output of new positions as partials (their sum over axis 1 is the output;
    the router kernel adds x + sum_p parts): one part, or one a head where attention and its
    output projection are one launch (kernels/attend_project.py: a short window, not split).

    pos: kv.length already on the device (int32, element 0: `launch.index_param(kv.length)`), for
    a traced step (compiled.py) whose graph must not hold the position as a constant. Kernel path
    only: the ops path slices the cache by the Python int.

    Shapes:
        x float32 [T, D] (the residual, not yet normed) -> ([T, 1 or H, D], MlxLayerKV with T more positions)
    """
    t = x.shape[0]
    check_context(cfg, kv.length, t)
    if pos is not None and not _kernel_ok(cfg, w):
        raise ValueError("attention: a device position needs the attend kernel (the ops path slices by kv.length)")
    if _kernel_ok(cfg, w):
        cos, sin = rope_table_cached(cfg)
        if attend_project.chains_qkv(t, kv.length + t, w.wo):  # the QKV GEMV, attend and W_o in one launch
            _, parts = attend_project.qkv_attend_project(w.wqkv, x, w.norm, w.bqkv, w.q_norm, w.k_norm, cos, sin,
                                                         kv.keys, kv.values, w.wo, kv.length, cfg.rms_norm_eps,
                                                         cfg.n_heads, pos=pos, rotary_dim=cfg.rope_dim, gated=w.gated)
            return parts, MlxLayerKV(kv.keys, kv.values, kv.length + t)
        qkv = dense_kernel.dense_gemv(w.wqkv, x, w.norm, cfg.rms_norm_eps, bias=w.bqkv)  # [T, (H + 2 KVH (+ H)) HD]
        if attend_project.applies(t, kv.length + t, w.wo):  # attend + W_o in one launch: partials [T, H, D]
            parts = attend_project.attend_project(qkv, w.q_norm, w.k_norm, cos, sin, kv.keys, kv.values, w.wo,
                                                  kv.length, cfg.rms_norm_eps, cfg.n_heads, pos=pos,
                                                  rotary_dim=cfg.rope_dim, gated=w.gated)
            return parts, MlxLayerKV(kv.keys, kv.values, kv.length + t)
        split = attn_kernels.split_applies(kv.length + t, t)
        if split and attend_split.applies(w.wo):  # attention split over the context, merged in W_o's blocks
            parts = attend_split.attend_split_project(qkv, w.q_norm, w.k_norm, cos, sin, kv.keys, kv.values, w.wo,
                                                      kv.length, cfg.rms_norm_eps, cfg.n_heads, pos=pos,
                                                      rotary_dim=cfg.rope_dim, gated=w.gated)
            return parts, MlxLayerKV(kv.keys, kv.values, kv.length + t)
        o = attn_kernels.attend(qkv, w.q_norm, w.k_norm, cos, sin, kv.keys, kv.values, kv.length,
                                cfg.rms_norm_eps, cfg.n_heads, pos=pos, rotary_dim=cfg.rope_dim,
                                gated=w.gated, split=split)  # [T, H HD]
        out = dense_kernel.dense_gemv(w.wo, o)  # [T, D]
        return out[:, None, :], MlxLayerKV(kv.keys, kv.values, kv.length + t)
    out, kv = _ops(cfg, w, kv, x)
    return out[:, None, :], kv


def routes_with_attention(cfg: ModelConfig, w: AttentionWeights, kv: MlxLayerKV, t: int) -> bool:
    """Whether `attention_router` serves t new positions here (one token, the kernel path on CUDA
    or the emulator; a short context, or past SPLIT_FROM the split attention's chain)."""
    return _kernel_ok(cfg, w) and (attend_project.chains_router(t, kv.length + t, w.wo)
                                   or attend_split.chains_router(t, kv.length + t, w.wo))


def attention_router(cfg: ModelConfig, w: AttentionWeights, kv: MlxLayerKV, x: mx.array, ffn_norm: mx.array,
                     w_router: mx.array, *, pos: mx.array | None = None,
                     hand_on: bool = False) -> tuple[mx.array, mx.array, mx.array, MlxLayerKV]:
    """The attention (`attention_partials`) and the router kernel after it (no guess) as one
    launch, where `routes_with_attention` (past SPLIT_FROM the split attention's chain,
    kernels/attend_split.py): the residual after attention, the router's input and
    its logits (model.router_stage's first three), and the new cache. hand_on: h and z as
    `Region`s of the launch's folded buffer, for the expert step's launch alone to read
    (attend_project.routed_chain says why).

    Shapes:
        x float32 [1, D], w_router float32 [E, D] -> (x_mid [1, D], h [1, D], z [1, E], MlxLayerKV with 1 more)
    """
    check_context(cfg, kv.length, x.shape[0])
    cos, sin = rope_table_cached(cfg)
    short = attend_project.chains_router(x.shape[0], kv.length + x.shape[0], w.wo)
    route = attend_project.qkv_attend_route if short else attend_split.qkv_split_route
    x_mid, h, z = route(w.wqkv, x, w.norm, w.bqkv, w.q_norm, w.k_norm, cos, sin, kv.keys, kv.values, w.wo, ffn_norm,
                        w_router, kv.length, cfg.rms_norm_eps, cfg.n_heads, pos=pos, rotary_dim=cfg.rope_dim,
                        gated=w.gated, hand_on=hand_on)
    return x_mid, h, z, MlxLayerKV(kv.keys, kv.values, kv.length + x.shape[0])


def attention(cfg: ModelConfig, w: AttentionWeights, kv: MlxLayerKV, x) -> tuple[mx.array, MlxLayerKV]:
    """Twin of reference `attention`: x [T, D] (normed by the caller in the reference; here the
    layer's attn_norm is part of `w`, so x is the residual) -> ([T, D], MlxLayerKV)."""
    x = x if isinstance(x, mx.array) else mx.array(np.asarray(x, np.float32))
    parts, kv = attention_partials(cfg, w, kv, x)
    return parts.sum(axis=1), kv
