"""The QKV projection's epilogue over a prompt in one launch: the hi and lo terms' products added
(lowp.join_rows), the bias, the per-head q / k RMSNorm, RoPE at positions start.., and the
outputs in the layouts their readers take: q, k, v in float16 [heads, T, HD] for the fused
attention, k and v in float32 for the KV cache.

Why (H200, ncu, one layer of the seed shape at 2048 tokens): these steps were ~45 launches
and ~400 us (the join's casts and add, the norms' nine ops a tensor, RoPE's products and
concatenation, the transposes, the float16 casts) over ~25 MB of rows: ~15 us at HBM speed.
A block is a position: its q | k | v row, joined and biased, in shared memory ((H + 2 KVH) HD
floats: 12 KB at the seed shape); warp w normalises heads w, w + NW, .. in place; then every
thread writes its elements rotated (a1 c - a2 s | a2 c + a1 s over the first rope_dim of a head,
the rest as they are; the tables are attention.rope_table's float32 cos / sin).

Formulas as the ops path's (prompt_attention.py, attention.rms_norm): the sums in another order,
and a product pair the compiler may contract into an FMA (within FAST of the ops).

Shapes: T positions, H / KVH heads of HD, R = rope_dim; y [P T, (H + 2 KVH) HD] (P terms).
"""

from __future__ import annotations

import mlx.core as mx
import numpy as np

from strata.mlx_backend.kernels.launch import absent, block_threads, float_params, index_param, launch
from strata.mlx_backend.kernels.source import KernelSource

THREADS = 256
MAX_ROW = 12288  # floats of a position's q | k | v row in shared memory (48 KB: every dialect's minimum)

BODY = r"""
  constexpr int NQK = H + KVH;             // heads normalised and rotated
  constexpr int ROW = (H + 2 * KVH) * HD;  // q | k | v columns
  constexpr int HALF = R / 2;
  SHARED float row[ROW];
  const uint64_t t = (uint64_t)bx;
  const uint64_t n = (uint64_t)rows_n[0];
  const uint64_t pos = (uint64_t)start[0] + t;
  for (uint32_t c = tid; c < (uint32_t)ROW; c += NT) {
    float a = F32(y[t * YC + c]);
    if (P == 2) a = a + F32(y[(n + t) * YC + c]);  // hi + lo, as lowp.join_rows adds them
    if (HAS_BIAS) a = a + F32(bias[c]);
    row[c] = a;
  }
  BARRIER();
  if (QK) {  // the per-head RMSNorm: each lane reads and writes only its own columns of the head
    for (uint32_t hh = warp_id; hh < (uint32_t)NQK; hh += NT / 32) {
      float ss = 0.0f;
      for (uint32_t c = lane; c < (uint32_t)HD; c += 32u) { const float a = row[hh * HD + c]; ss += a * a; }
      ss = warp_sum(ss);
      const float inv = 1.0f / sqrt_f(ss * (1.0f / (float)HD) + eps[0]);
      for (uint32_t c = lane; c < (uint32_t)HD; c += 32u) {
        const float nw = hh < (uint32_t)H ? F32(q_norm[c]) : F32(k_norm[c]);
        row[hh * HD + c] = row[hh * HD + c] * inv * nw;
      }
    }
    BARRIER();
  }
  for (uint32_t c = tid; c < (uint32_t)ROW; c += NT) {
    const uint32_t hh = c / (uint32_t)HD, d = c % (uint32_t)HD;
    float o = row[c];
    if (hh < (uint32_t)NQK && d < (uint32_t)R) {  // RoPE: the rotated pair (d, d + R/2)
      const uint32_t i = d < (uint32_t)HALF ? d : d - (uint32_t)HALF;
      const float cs = cos_t[pos * HALF + i], sn = sin_t[pos * HALF + i];
      const float a1 = row[hh * HD + i], a2 = row[hh * HD + i + HALF];
      o = d < (uint32_t)HALF ? a1 * cs - a2 * sn : a2 * cs + a1 * sn;
    }
    if (hh < (uint32_t)H) {
      q16[((uint64_t)hh * n + t) * HD + d] = to_half(o);
    } else if (hh < (uint32_t)NQK) {
      const uint64_t at = ((uint64_t)(hh - H) * n + t) * HD + d;
      k16[at] = to_half(o);
      k32[at] = o;
    } else {
      const uint64_t at = ((uint64_t)(hh - NQK) * n + t) * HD + d;
      v16[at] = to_half(o);
      v32[at] = o;
    }
  }
"""

SOURCE = KernelSource("strata_qkv_rope", ("y", "bias", "q_norm", "k_norm", "cos_t", "sin_t", "eps", "start", "rows_n"),
                      ("q16", "k16", "v16", "k32", "v32"), BODY)


def qkv_rope_refusal(n_heads: int, n_kv: int, head_dim: int, rope_dim: int) -> str | None:
    """Why a layer's QKV epilogue keeps the ops (None: the kernel serves it)."""
    if (n_heads + 2 * n_kv) * head_dim > MAX_ROW:
        return f"a q | k | v row of {(n_heads + 2 * n_kv) * head_dim} floats (the kernel holds {MAX_ROW})"
    if rope_dim % 2 or rope_dim > head_dim:
        return f"rope_dim {rope_dim} of head_dim {head_dim}"
    return None


def qkv_rope(y: mx.array, n: int, *, n_heads: int, n_kv: int, head_dim: int, rope_dim: int, cos_t: mx.array,
             sin_t: mx.array, start: int, bias: mx.array | None = None, q_norm: mx.array | None = None,
             k_norm: mx.array | None = None, eps: float = 0.0) -> tuple[mx.array, ...]:
    """q, k, v of n positions at start.. from the QKV GEMM's output (P = rows / n terms; the
    columns past q | k | v, an output gate's, are not read). q_norm / k_norm: per-head weights
    [HD] (both or neither). A kernel path only.

    Shapes:
        y [P n, >= (H + 2 KVH) HD] (float16 or float32); cos_t, sin_t float32 [>= start + n, R/2]
        -> q float16 [H, n, HD], k, v float16 [KVH, n, HD], k, v float32 [KVH, n, HD]
    """
    p = y.shape[0] // n
    if p * n != y.shape[0] or p not in (1, 2) or (q_norm is None) != (k_norm is None):
        raise ValueError(f"qkv_rope: {y.shape[0]} rows for {n} positions, q / k norms "
                         f"{q_norm is not None} / {k_norm is not None}")
    if (why := qkv_rope_refusal(n_heads, n_kv, head_dim, rope_dim)) is not None:
        raise ValueError(f"qkv_rope: {why}")
    f32, nt = np.float32, block_threads(THREADS)
    template = (("H", n_heads), ("KVH", n_kv), ("HD", head_dim), ("R", rope_dim), ("YC", y.shape[1]), ("P", p),
                ("Y_F16", int(y.dtype == mx.float16)), ("HAS_BIAS", int(bias is not None)),
                ("B_F16", int(bias is not None and bias.dtype == mx.float16)), ("QK", int(q_norm is not None)),
                ("N_F16", int(q_norm is not None and q_norm.dtype == mx.float16)), ("NT", nt))
    q_shape, kv_shape = (n_heads, n, head_dim), (n_kv, n, head_dim)
    return tuple(launch(SOURCE, [y, absent(f32) if bias is None else bias, absent(f32) if q_norm is None else q_norm,
                                 absent(f32) if k_norm is None else k_norm, cos_t, sin_t, float_params(float(eps)),
                                 index_param(start), index_param(n)],
                        [q_shape, kv_shape, kv_shape, kv_shape, kv_shape],
                        [mx.float16, mx.float16, mx.float16, mx.float32, mx.float32],
                        blocks=(n, 1, 1), threads=nt, template=template))
