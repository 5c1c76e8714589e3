"""The combine kernel: x + (sum of routed partials + sigmoid(w_gi . h) * sum of shared partials),
partials summed in a fixed order (so the result does not depend on scheduling).

Shapes:
    x float32 [T, D], routed float32 [T, P, D], shared float32 [T, PS, D], h float32 [T, D],
    gate_inp float16 [D] -> float32 [T, D]
Grid: x = ceil(D / NT), y = T. Every block recomputes the gate's dot product (D values). Each
thread keeps 8 loads in flight before adding them, in the same fixed order.
"""

from __future__ import annotations

import mlx.core as mx
import numpy as np

from strata.mlx_backend.kernels.launch import absent, launch
from strata.mlx_backend.kernels.source import KernelSource

THREADS = 64  # D / 64 blocks (40 at the seed's size): the partial sums are latency-bound per thread

BODY = r"""
  constexpr int NW = NT / 32;
  constexpr int B = 8;  // loads in flight per thread before they are added (in the fixed order)
  const uint32_t t = by;
  SHARED float red[NW];
  float sg = 1.0f;
  if (GATED) {
    float a = 0.0f;
    for (uint32_t d0 = tid; d0 < (uint32_t)D; d0 += NT * B) {
      float gv[B], hv[B];
      UNROLL for (int i = 0; i < B; ++i) {
        const uint32_t d = d0 + NT * i;
        gv[i] = d < (uint32_t)D ? F32(gate_inp[d]) : 0.0f;
        hv[i] = d < (uint32_t)D ? h[(uint64_t)t * D + d] : 0.0f;
      }
      UNROLL for (int i = 0; i < B; ++i) a += gv[i] * hv[i];
    }
    a = warp_sum(a);
    if (lane == 0) red[warp_id] = a;
    BARRIER();
    float tot = 0.0f;
    for (int w = 0; w < NW; ++w) tot += red[w];
    sg = 1.0f / (1.0f + exp_f(-tot));
  }
  const uint32_t d = bx * NT + tid;
  if (d < (uint32_t)D) {
    float r = 0.0f;
    for (int p0 = 0; p0 < P; p0 += B) {
      float v[B];
      UNROLL for (int i = 0; i < B; ++i) v[i] = p0 + i < P ? routed[((uint64_t)t * P + p0 + i) * D + d] : 0.0f;
      UNROLL for (int i = 0; i < B; ++i) { if (p0 + i < P) r += v[i]; }
    }
    float s = 0.0f;
    for (int p0 = 0; p0 < PS; p0 += B) {
      float v[B];
      UNROLL for (int i = 0; i < B; ++i) v[i] = p0 + i < PS ? shared[((uint64_t)t * PS + p0 + i) * D + d] : 0.0f;
      UNROLL for (int i = 0; i < B; ++i) { if (p0 + i < PS) s += v[i]; }
    }
    out[(uint64_t)t * D + d] = x[(uint64_t)t * D + d] + (r + s * sg);
  }
"""

SOURCE = KernelSource("strata_combine", ("x", "routed", "shared", "h", "gate_inp"), ("out",), BODY)


def combine(x: mx.array, routed: mx.array, shared: mx.array | None, h: mx.array,
            gate_inp: mx.array | None) -> mx.array:
    """Kernel path. shared None: no shared expert; gate_inp None: ungated."""
    t, d = x.shape
    ps = 0 if shared is None else shared.shape[1]
    shared = absent(np.float32) if shared is None else shared
    gated = gate_inp is not None and ps > 0
    gate_inp = gate_inp if gate_inp is not None else absent(np.float16)
    return launch(SOURCE, [x, routed, shared, h, gate_inp], [(t, d)], [mx.float32],
                  blocks=((d + THREADS - 1) // THREADS, t, 1), threads=THREADS,
                  template=(("D", d), ("P", routed.shape[1]), ("PS", ps), ("GATED", int(gated)), ("NT", THREADS)))[0]
