"""Dense float16 GEMV with float32 activations and accumulation (the LM head on the GPU path):
y[t, r] = sum_c W[r, c] x[t, c]. One warp per row, each lane 8 halves (16 bytes) per step.

Shapes:
    w float16 [R, C], x float32 [T, C] -> y float32 [T, R]
"""

from __future__ import annotations

import mlx.core as mx

from strata.mlx_backend.kernels.launch import launch
from strata.mlx_backend.kernels.preludes import WARP
from strata.mlx_backend.kernels.source import KernelSource

THREADS = 256

BODY = r"""
  constexpr int NW = NT / 32;
  const uint32_t t = by;
  const uint32_t r = bx * NW + warp_id;
  if (r < (uint32_t)R) {
    const DEVICE half_t* row = w + (uint64_t)r * C;
    const DEVICE float* xt = x + (uint64_t)t * C;
    float acc = 0.0f;
    for (uint32_t g = lane; g < (uint32_t)(C / 8); g += 32) {
      const f8 wv = load_h8(row + 8 * g);
      const f4 x0 = load_f4(xt + 8 * g);
      const f4 x1 = load_f4(xt + 8 * g + 4);
      acc += wv.v[0] * x0.v[0] + wv.v[1] * x0.v[1] + wv.v[2] * x0.v[2] + wv.v[3] * x0.v[3]
           + wv.v[4] * x1.v[0] + wv.v[5] * x1.v[1] + wv.v[6] * x1.v[2] + wv.v[7] * x1.v[3];
    }
    acc = warp_sum(acc);
    if (lane == 0) y[(uint64_t)t * R + r] = acc;
  }
"""

SOURCE = KernelSource("strata_dense_gemv", ("w", "x"), ("y",), BODY)


def dense_gemv(w: mx.array, x: mx.array) -> mx.array:
    """Kernel path. w float16 [R, C] (C a multiple of 8), x float32 [T, C] -> float32 [T, R]"""
    r, c = w.shape
    t = x.shape[0]
    nw = THREADS // WARP
    return launch(SOURCE, [w, x], [(t, r)], [mx.float32], blocks=((r + nw - 1) // nw, t, 1), threads=THREADS,
                  template=(("R", r), ("C", c), ("NT", THREADS)))[0]
