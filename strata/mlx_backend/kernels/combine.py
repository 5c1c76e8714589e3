"""The combine kernel: x + (sum of routed partials + sigmoid(w_gi . h) * sum of shared partials),
partials summed in a fixed order (so the result does not depend on scheduling).

Shapes:
    x float32 [T, D], routed float32 [T, P, D], shared float32 [T, PS, D], h float32 [T, D],
    gate_inp float16 [D] -> float32 [T, D]
Grid: x = ceil(D / NT), y = T. Every block recomputes the gate's dot product (D values).
"""

from __future__ import annotations

import mlx.core as mx
import numpy as np

from strata.mlx_backend.kernels.launch import absent, launch
from strata.mlx_backend.kernels.source import KernelSource

THREADS = 256

BODY = r"""
  constexpr int NW = NT / 32;
  const uint32_t t = by;
  SHARED float red[NW];
  float sg = 1.0f;
  if (GATED) {
    float a = 0.0f;
    for (uint32_t d = tid; d < (uint32_t)D; d += NT) a += F32(gate_inp[d]) * h[(uint64_t)t * D + d];
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
    for (int p = 0; p < P; ++p) r += routed[((uint64_t)t * P + p) * D + d];
    float s = 0.0f;
    for (int p = 0; p < PS; ++p) s += shared[((uint64_t)t * PS + p) * D + d];
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
