"""RMSNorm of a prompt's rows in one launch: the residual's add before it (x + sum_p parts[p]) and
the float16 terms of the result after it (lowp.py's hi and lo rows, the QKV GEMM's input), where
the ops path takes ~9 launches for the norm (square, row sum, mean, eps, sqrt, divide, two
multiplies, the weight's cast), ~6 for the terms and 2-3 for the residual.

Why (H200, ncu, one layer of the seed shape at 2048 tokens): the attention's norm and terms
were ~100 us over 15 launches and the residual + FFN norm ~90 us over 12, for rows of 21 MB
read and 21 MB written: ~13 us each at HBM speed. A block is a row: its D values in registers
(D / NT a thread), one block-wide sum of squares (warp_sum, then the warps in order), then the
row written as float32 (the router and the tile kernel read h in float32) or as TERMS float16
rows, hi = f16(y) then lo = f16(y - hi), at rows t and T + t of a [TERMS T, D] array.

The formula is rms_norm's (attention.py): y = (v inv) w, inv = 1 / sqrt(sum(v^2) (1 / D) + eps),
v = x + (sum of the parts in order); the sums in another order (within FAST of the ops).

Shapes: T rows, D columns, P parts.
"""

from __future__ import annotations

import mlx.core as mx

from strata.mlx_backend.kernels.launch import block_threads, float_params, index_param, launch
from strata.mlx_backend.kernels.source import KernelSource

THREADS = 256

BODY = r"""
  constexpr int PER = (D + NT - 1) / NT;  // values a thread
  SHARED float red[NT / 32];
  const uint64_t row = (uint64_t)bx;
  const uint64_t n = (uint64_t)rows_n[0];
  float v[PER];
  float ss = 0.0f;
  UNROLL for (int j = 0; j < PER; ++j) {
    const uint32_t c = tid + NT * (uint32_t)j;
    float a = 0.0f;
    if (c < (uint32_t)D) {
      a = x[row * D + c];
      if (P > 0) {  // x + parts.sum(axis=1): the parts summed first, in order
        float s = F32(parts[row * P * D + c]);
        for (int p = 1; p < P; ++p) s += F32(parts[(row * P + p) * D + c]);
        a = a + s;
        x_out[row * D + c] = a;
      }
    }
    v[j] = a;
    ss += a * a;
  }
  ss = warp_sum(ss);
  if (lane == 0u) red[warp_id] = ss;
  BARRIER();
  float total = 0.0f;
  for (int w = 0; w < NT / 32; ++w) total += red[w];
  const float inv = 1.0f / sqrt_f(total * (1.0f / (float)D) + eps[0]);
  UNROLL for (int j = 0; j < PER; ++j) {
    const uint32_t c = tid + NT * (uint32_t)j;
    if (c < (uint32_t)D) {
      const float r = v[j] * inv * F32(w[c]);
      if (TERMS == 0) {
        put(y + row * D + c, r);
      } else {
        const float hi = F32(to_half(r));
        put(y + row * D + c, hi);  // exact: hi is a float16 value
        if (TERMS == 2) put(y + (n + row) * D + c, r - hi);
      }
    }
  }
"""

# y is float32 or float16 by TERMS: a store that rounds to the pointer's type (both branches compile
# for either type; CUDA may build without implicit half conversions)
HELPERS = r"""
INLINE void put(DEVICE float* p, float v) { *p = v; }
INLINE void put(DEVICE half_t* p, float v) { *p = to_half(v); }
"""

SOURCE = KernelSource("strata_row_norm", ("x", "parts", "w", "eps", "rows_n"), ("x_out", "y"), BODY, HELPERS)


def _dtype_code(a: mx.array) -> int:
    """A template value for an input's dtype (float32 0, float16 1): one build per dtype."""
    if a.dtype not in (mx.float32, mx.float16):
        raise ValueError(f"row_norm: a {a.dtype} input (float32 or float16)")
    return int(a.dtype == mx.float16)


def row_norm(x: mx.array, w: mx.array, eps: float, *, parts: mx.array | None = None, terms: int = 0
             ) -> tuple[mx.array, mx.array]:
    """(v, rms_norm(v, w, eps)) for v = x + parts.sum(axis=1) (v = x without parts), the norm as
    float32 rows (terms 0) or as its float16 terms (terms 1: hi; 2: hi rows, then lo rows). A
    kernel path only.

    Shapes:
        x float32 [T, D]; w [D]; parts [T, P, D] -> (v float32 [T, D] (x itself without parts),
        float32 [T, D] or float16 [terms T, D])
    """
    t, d = x.shape
    nt = block_threads(THREADS)
    p = 0 if parts is None else parts.shape[1]
    if terms not in (0, 1, 2):
        raise ValueError(f"row_norm: {terms} terms (0, 1 or 2)")
    template = (("D", d), ("P", p), ("PARTS_F16", 0 if parts is None else _dtype_code(parts)),
                ("W_F16", _dtype_code(w)), ("TERMS", terms), ("NT", nt))
    out_shape, out_dtype = ((t, d), mx.float32) if terms == 0 else ((terms * t, d), mx.float16)
    x_out, y = launch(SOURCE, [x.astype(mx.float32), x if parts is None else parts, w, float_params(float(eps)),
                               index_param(t)], [(t, d) if p else (8,), out_shape], [mx.float32, out_dtype],
                      blocks=(t, 1, 1), threads=nt, template=template)
    return (x_out if p else x), y
