"""The gated DeltaNet mixer on MLX arrays: the twin of strata.reference.deltanet.

Two forms of the same recurrence (the reference's module doc gives the math):
- `recurrent`: position by position (decode, and decode windows, whose every position keeps a
  snapshot): per position one decay, one read (S^T k), one rank-1 update and one read (S^T q)
  of the [Hv, dk, dv] state;
- `chunked`: the prompt path, CHUNK positions at a time in the UT-transform form (as transformers'
  torch_chunk_gated_delta_rule and flash-linear-attention compute it): inside a chunk the delta
  rule's updates are condensed into a lower-triangular system M = I + strict_lower((k beta) k^T * D)
  solved once, so a chunk costs a few [Hv, L, L] and [Hv, L, d] matmuls and one state read and
  write instead of L sequential updates. M^-1 is computed as the product of (I + (-N)^(2^i)),
  exact for the nilpotent N in log2(L) squarings: batched matmuls only (no triangular solve,
  which MLX runs on the CPU).

A decoded position (T = 1, not a window) on a kernel path is three launches instead
(`kernel_applies`): the input projection with the layer's norm (kernels/dense_gemv.py), the
decode step (kernels/deltanet.py: conv, gates, the delta rule on the state, the gated RMSNorm)
and the output projection; the new conv and recurrent states are the step's outputs (new
arrays: the snapshots keep the old ones).

The state is the reference's `DeltaNetState` holding MLX arrays (snapshots, trim and
kept_position are the reference's own). Dense weights: float32 ops on either dtype.

Shapes: T positions, D hidden, C = 2 Hk dk + Hv dv conv channels, V = Hv dv.
"""

from __future__ import annotations

from dataclasses import dataclass

import mlx.core as mx
import numpy as np

from strata.mlx_backend.attention import rms_norm
from strata.mlx_backend.dense import linear
from strata.mlx_backend.kernels import deltanet as step_kernel
from strata.mlx_backend.kernels import dense_gemv as dense_kernel
from strata.mlx_backend.kernels.launch import KernelPath, current_path
from strata.model_config import ModelConfig
from strata.reference.deltanet import L2NORM_EPS, SOFTPLUS_THRESHOLD, DeltaNetState, Snapshot, conv_channels

__all__ = ["DeltaNetWeights", "empty_state", "deltanet_partials", "recurrent", "chunked", "CHUNK", "kernel_applies", "output_gate"]

CHUNK = 64  # positions per chunk of the prompt path (transformers' and fla's default)


@dataclass(frozen=True, eq=False)
class DeltaNetWeights:
    """One DeltaNet layer's weights. w_in is the four input projections stacked (one GEMV):
    rows qkv [C], z [V], beta [Hv], alpha [Hv].

    Shapes: norm [D] (None: the input comes normed, as a hyper-connection gives it);
    w_in [C + V + 2 Hv, D]; conv [C, K]; a, dt_bias [Hv]; out_norm [dv]; wo [D, V]
    """

    norm: mx.array | None
    w_in: mx.array
    conv: mx.array
    a: mx.array
    dt_bias: mx.array
    out_norm: mx.array
    wo: mx.array

    def arrays(self) -> list[mx.array]:
        return [a for a in (self.norm, self.w_in, self.conv, self.a, self.dt_bias, self.out_norm, self.wo)
                if a is not None]


def empty_state(cfg: ModelConfig) -> DeltaNetState:
    dn = cfg.deltanet
    conv = mx.zeros((conv_channels(cfg), dn.linear_conv_kernel - 1), mx.float32)
    rec = mx.zeros((dn.linear_v_heads, dn.linear_k_head_dim, dn.linear_v_head_dim), mx.float32)
    return DeltaNetState(conv, rec)


def _softplus(x: mx.array) -> mx.array:
    return mx.where(x > SOFTPLUS_THRESHOLD, x, mx.log1p(mx.exp(mx.minimum(x, SOFTPLUS_THRESHOLD))))


def _l2norm(x: mx.array) -> mx.array:
    return x * mx.rsqrt(mx.sum(x * x, axis=-1, keepdims=True) + L2NORM_EPS)


def output_gate(cfg: ModelConfig, z: mx.array) -> mx.array:
    """Twin of the reference's output_gate: sigmoid(z) (cfg.qwen4.deltanet_sigmoid_gate), else silu(z)."""
    return mx.sigmoid(z) if cfg.qwen4.deltanet_sigmoid_gate else z * mx.sigmoid(z)


def _inputs(cfg: ModelConfig, w: DeltaNetWeights, state: DeltaNetState, x: mx.array):
    """Norm, projections, conv, heads: q, k [Hv, T, dk], v [Hv, T, dv], g, beta [Hv, T], z [T, V],
    and the padded conv inputs [K-1+T, C]."""
    t, c, hv = x.shape[0], conv_channels(cfg), cfg.deltanet.linear_v_heads
    hk, dk, dv = cfg.deltanet.linear_k_heads, cfg.deltanet.linear_k_head_dim, cfg.deltanet.linear_v_head_dim
    xn = x if w.norm is None else rms_norm(x, w.norm, cfg.rms_norm_eps)  # None: normed by the caller (Qwen4-Exp)
    proj = linear(xn, w.w_in)  # [T, C + V + 2 Hv]; weights as stored, widened per op (dense.py)
    qkv, z = proj[:, :c], proj[:, c:c + hv * dv]
    b, a = proj[:, c + hv * dv:c + hv * dv + hv], proj[:, c + hv * dv + hv:]
    padded = mx.concatenate([state.conv.T, qkv], axis=0)  # [K-1+T, C]
    wc = w.conv.astype(mx.float32)
    mixed = sum(wc[:, j] * padded[j:j + t] for j in range(cfg.deltanet.linear_conv_kernel))
    mixed = mixed * mx.sigmoid(mixed)
    r = hv // hk
    q = _l2norm(mixed[:, :hk * dk].reshape(t, hk, dk)) * np.float32(dk ** -0.5)
    k = _l2norm(mixed[:, hk * dk:2 * hk * dk].reshape(t, hk, dk))
    v = mixed[:, 2 * hk * dk:].reshape(t, hv, dv)
    q, k = mx.repeat(q, r, axis=1), mx.repeat(k, r, axis=1)  # v head h reads k head h // r
    beta = mx.sigmoid(b)
    g = w.a.astype(mx.float32) * _softplus(a + w.dt_bias.astype(mx.float32))
    heads = lambda u: u.transpose(1, 0, 2)  # noqa: E731  [T, Hv, d] -> [Hv, T, d]
    return heads(q), heads(k), heads(v), g.T, beta.T, z, padded


def recurrent(s: mx.array, q: mx.array, k: mx.array, v: mx.array, g: mx.array, beta: mx.array
              ) -> tuple[mx.array, list[mx.array]]:
    """The gated delta rule position by position (twin of the reference's loop).

    Shapes: s [Hv, dk, dv], q/k [Hv, T, dk], v [Hv, T, dv], g/beta [Hv, T]
        -> (o [Hv, T, dv], the state after each position: T x [Hv, dk, dv])
    """
    outs, states = [], []
    for t in range(q.shape[1]):
        s = s * mx.exp(g[:, t])[:, None, None]
        kt = k[:, t]
        kv_mem = (s * kt[:, :, None]).sum(axis=1)  # [Hv, dv]
        delta = (v[:, t] - kv_mem) * beta[:, t][:, None]
        s = s + kt[:, :, None] * delta[:, None, :]
        outs.append((s * q[:, t][:, :, None]).sum(axis=1))
        states.append(s)
    return mx.stack(outs, axis=1), states


def _unit_lower_inverse(n: mx.array) -> mx.array:
    """(I + N)^-1 for strictly lower-triangular N [..., L, L]: prod_i (I + (-N)^(2^i))."""
    size = n.shape[-1]
    eye = mx.eye(size, dtype=n.dtype)
    p = -n
    inv = eye + p
    span = 2
    while span < size:
        p = p @ p
        inv = inv @ (eye + p)  # the factors commute (powers of one matrix)
        span *= 2
    return inv


def chunked(s: mx.array, q: mx.array, k: mx.array, v: mx.array, g: mx.array, beta: mx.array, *,
            chunk: int = CHUNK) -> tuple[mx.array, mx.array]:
    """The gated delta rule CHUNK positions at a time (see the module doc).

    Shapes: as `recurrent` -> (o [Hv, T, dv], the state after the last position [Hv, dk, dv])
    """
    hv, t, dk = q.shape
    pad = -t % chunk
    if pad:  # zero keys and betas, no decay: padded positions leave the state as it is
        zpad = lambda a: mx.pad(a, [(0, 0), (0, pad)] + [(0, 0)] * (a.ndim - 2))  # noqa: E731
        q, k, v, g, beta = zpad(q), zpad(k), zpad(v), zpad(g), zpad(beta)
    n_chunks = (t + pad) // chunk
    split = lambda a: a.reshape(hv, n_chunks, chunk, *a.shape[2:])  # noqa: E731  [Hv, N, L, ...]
    q, k, v, g, beta = split(q), split(k), split(v), split(g), split(beta)
    cum = mx.cumsum(g, axis=-1)  # [Hv, N, L]: log decay from the chunk's start
    lower = mx.tril(mx.ones((chunk, chunk), dtype=mx.bool_))  # j <= i
    diff = cum[..., :, None] - cum[..., None, :]  # [Hv, N, L, L]
    decay = mx.where(lower, mx.exp(mx.where(lower, diff, 0.0)), 0.0)
    k_beta = k * beta[..., None]
    strict = mx.tril(mx.ones((chunk, chunk), dtype=mx.bool_), k=-1)
    n = mx.where(strict, (k_beta @ k.swapaxes(-1, -2)) * decay, 0.0)
    inv = _unit_lower_inverse(n)
    u = inv @ (v * beta[..., None])  # the chunk's corrected values, before the state's prediction
    w = inv @ (k_beta * mx.exp(cum)[..., None])  # the keys that read the chunk-start state
    intra = (q @ k.swapaxes(-1, -2)) * decay  # [Hv, N, L, L]
    q_dec = q * mx.exp(cum)[..., None]
    last = cum[..., -1:]  # [Hv, N, 1]
    k_dec = k * mx.exp(last - cum)[..., None]
    outs = []
    for c in range(n_chunks):
        v_new = u[:, c] - w[:, c] @ s  # [Hv, L, dv]
        outs.append(q_dec[:, c] @ s + intra[:, c] @ v_new)
        s = s * mx.exp(last[:, c])[..., None] + k_dec[:, c].swapaxes(-1, -2) @ v_new
    o = mx.concatenate(outs, axis=1)[:, :t]
    return o, s


def kernel_applies(cfg: ModelConfig, w: DeltaNetWeights) -> bool:
    """Whether a decoded position of this layer takes the kernel path (on the current path)."""
    dn = cfg.deltanet
    d, v = cfg.hidden_size, dn.linear_v_heads * dn.linear_v_head_dim
    return (current_path() is not KernelPath.OPS and w.w_in.dtype == mx.float16 and w.wo.dtype == mx.float16
            and d % 8 == 0 and v % 8 == 0 and d <= dense_kernel.MAX_COLS and v <= dense_kernel.MAX_COLS
            and step_kernel.fits(dn.linear_k_head_dim, dn.linear_v_head_dim, dn.linear_conv_kernel))


def _kernel_step(cfg: ModelConfig, w: DeltaNetWeights, state: DeltaNetState, x: mx.array
                 ) -> tuple[mx.array, DeltaNetState]:
    """One decoded position on the kernel path: three launches (the module doc). x [1, D] -> [1, 1, D]"""
    proj = dense_kernel.dense_gemv(w.w_in, x, w.norm, cfg.rms_norm_eps)  # [1, C + V + 2 Hv]
    y, conv, rec = step_kernel.deltanet_step(proj, state.conv, w.conv, w.a, w.dt_bias, w.out_norm, state.recurrent,
                                             k_heads=cfg.deltanet.linear_k_heads, eps=cfg.rms_norm_eps,
                                             l2_eps=L2NORM_EPS,
                                             softplus_max=SOFTPLUS_THRESHOLD,
                                             sigmoid_gate=cfg.qwen4.deltanet_sigmoid_gate)
    out = dense_kernel.dense_gemv(w.wo, y)  # [1, D]
    n = state.length + 1
    new = DeltaNetState(conv, rec, n, state.kept).keep([Snapshot(n, conv, rec)])
    return out[:, None, :], new


def deltanet_partials(cfg: ModelConfig, w: DeltaNetWeights, state: DeltaNetState, x: mx.array, *,
                      window: bool = False) -> tuple[mx.array, DeltaNetState]:
    """Twin of reference `deltanet` (with the layer's norm): the output as one partial and the new
    state. Decode and windows run `recurrent` (a snapshot at every window position), a prompt
    longer than one position `chunked` (a snapshot at its end); a decoded position (or a window
    of one) on a kernel path the decode-step kernel.

    Shapes:
        x float32 [T, D] (the residual) -> ([T, 1, D], DeltaNetState with T more positions)
    """
    t = x.shape[0]
    if t == 1 and kernel_applies(cfg, w):
        return _kernel_step(cfg, w, state, x)
    q, k, v, g, beta, z, padded = _inputs(cfg, w, state, x)
    keep = cfg.deltanet.linear_conv_kernel - 1
    conv_after = lambda i: padded[i + 1:i + 1 + keep].T  # noqa: E731  the conv state after i + 1 positions
    if window or t == 1:
        o, states = recurrent(state.recurrent, q, k, v, g, beta)
        positions = range(t) if window else [t - 1]
        snaps = [Snapshot(state.length + i + 1, conv_after(i), states[i]) for i in positions]
    else:
        o, s = chunked(state.recurrent, q, k, v, g, beta)
        snaps = [Snapshot(state.length + t, conv_after(t - 1), s)]
    last = snaps[-1]
    new = DeltaNetState(last.conv, last.recurrent, state.length + t, state.kept).keep(snaps)
    o = o.transpose(1, 0, 2)  # [T, Hv, dv]
    normed = rms_norm(o, w.out_norm, cfg.rms_norm_eps) * output_gate(cfg, z.reshape(o.shape))
    out = linear(normed.reshape(t, -1), w.wo)
    return out[:, None, :], new
