"""Dense float16 GEMV with float32 activations and accumulation, optionally after an RMSNorm of
the activations (the LM head on the GPU path: final norm + head in one launch):
y[t, r] = sum_c W[r, c] xn[t, c], xn = x / sqrt(mean(x^2) + eps) * norm_w (NORM) or x.

Each block stages its token's (normed) activations in threadgroup memory (C floats, read once
from memory instead of once per warp), then one warp per row, each lane 8 halves (16 bytes) of
the row per step.

Shapes:
    w float16 [R, C], x float32 [T, C], norm_w float16 [C] -> y float32 [T, R]
"""

from __future__ import annotations

import mlx.core as mx
import numpy as np

from strata.mlx_backend.kernels.launch import absent, float_params, launch
from strata.mlx_backend.kernels.preludes import WARP
from strata.mlx_backend.kernels.source import KernelSource

THREADS = 256
MAX_COLS = 8192  # C floats of threadgroup memory per block (32 KB)

BODY = r"""
  constexpr int NW = NT / 32;
  const uint32_t t = by;
  SHARED float xv[C];
  SHARED float red[NW];
  float ss = 0.0f;
  for (uint32_t c = tid; c < (uint32_t)C; c += NT) {
    const float v = x[(uint64_t)t * C + c];
    xv[c] = v;
    ss += v * v;
  }
  if (NORM) {
    ss = warp_sum(ss);
    if (lane == 0) red[warp_id] = ss;
    BARRIER();
    float tot = 0.0f;
    for (int w = 0; w < NW; ++w) tot += red[w];
    const float inv = 1.0f / sqrt_f(tot / (float)C + fparams[0]);
    for (uint32_t c = tid; c < (uint32_t)C; c += NT) xv[c] = xv[c] * inv * F32(norm_w[c]);  // this thread's own
  }
  BARRIER();
  const uint32_t r = bx * NW + warp_id;
  if (r < (uint32_t)R) {
    const DEVICE half_t* row = w + (uint64_t)r * C;
    float acc = 0.0f;
    for (uint32_t g = lane; g < (uint32_t)(C / 8); g += 32) {
      const f8 wv = load_h8(row + 8 * g);
      acc += wv.v[0] * xv[8 * g] + wv.v[1] * xv[8 * g + 1] + wv.v[2] * xv[8 * g + 2] + wv.v[3] * xv[8 * g + 3]
           + wv.v[4] * xv[8 * g + 4] + wv.v[5] * xv[8 * g + 5] + wv.v[6] * xv[8 * g + 6] + wv.v[7] * xv[8 * g + 7];
    }
    acc = warp_sum(acc);
    if (lane == 0) y[(uint64_t)t * R + r] = acc;
  }
"""

SOURCE = KernelSource("strata_dense_gemv", ("w", "x", "norm_w", "fparams"), ("y",), BODY)


def dense_gemv(w: mx.array, x: mx.array, norm_w: mx.array | None = None, eps: float = 0.0) -> mx.array:
    """Kernel path. w float16 [R, C] (C a multiple of 8, at most MAX_COLS), x float32 [T, C];
    with norm_w (float16 [C]) x is RMS-normed first -> float32 [T, R]"""
    r, c = w.shape
    t = x.shape[0]
    if c % 8 or c > MAX_COLS:
        raise ValueError(f"dense GEMV kernel: {c} columns must be a multiple of 8, at most {MAX_COLS}")
    nw = THREADS // WARP
    norm = norm_w is not None
    return launch(SOURCE, [w, x, norm_w if norm else absent(np.float16), float_params(eps)], [(t, r)], [mx.float32],
                  blocks=((r + nw - 1) // nw, t, 1), threads=THREADS,
                  template=(("R", r), ("C", c), ("NORM", int(norm)), ("NT", THREADS)))[0]
