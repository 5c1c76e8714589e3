"""The combine kernel: x + (sum of routed partials + sigmoid(w_gi . h) * sum of shared partials),
partials summed in a fixed order (so the result does not depend on scheduling).

Why this geometry: on the H200 (132 SMs) ncu timed the previous kernel at 19 us per decoded layer
of the seed-shape model (D=2560, 10 experts x 18 partials + 16 shared partials = 196 vectors,
~2 MB fresh in L2). It ran D/64 = 40 blocks of 64 threads, each thread summing all 196 partials
of one column serially: 40 SMs busy, each thread ~25 dependent rounds of 8 loads. Now:

- a block covers a strip of `STRIP` = 16 columns (160 blocks at D=2560, T=1: every SM busy);
- its 256 threads are 4 column groups (float4 = 4 columns each; VEC=1 when D % 4 != 0) x 64 row
  subsets: thread s sums rows s, s + 64, ... (routed rows 0..P-1, then shared rows), all its
  loads issued before they are added (seed shape: 196 / 64 -> at most 4 float4 loads a thread,
  one round trip to L2);
- the gate's dot product (D values of h and gate_inp) is recomputed by every block, its loads
  issued before the partials' so both round trips overlap;
- a fixed-order merge through threadgroup memory: each column's 64 subset sums are folded VEC at
  a time (subsets g*VEC .. g*VEC+VEC-1 by thread group g), then the 256/16 = 16 group sums in
  order by the strip's first 16 threads, which write the output.

Predicted at the reference engine shape, T=1: 160 blocks x 256 threads; 2.0 MB of partials + 160 x 15 KB of
gate operands (h and gate_inp, L2 hits) + 20 KB of x / out, two round trips to L2 in all and two
barriers: ~2-3 us. The strip width does not depend on T, so a token's bits are the same in a
prompt batch and in decode.

Shapes:
    x float32 [T, D], routed float32 [T, P, D], shared float32 [T, PS, D], h float32 [T, D],
    gate_inp float16 [D] -> float32 [T, D]
Grid: x = ceil(D / STRIP), y = T; THREADS threads a block.
"""

from __future__ import annotations

import mlx.core as mx
import numpy as np

from strata.mlx_backend.kernels.launch import absent, launch
from strata.mlx_backend.kernels.source import KernelSource, expand

THREADS = 256
STRIP = 16  # columns a block: D/16 = 160 blocks at the reference engine's D=2560 (more than the H200's 132 SMs)

_GATE_LOAD = r"""
      UNROLL for (int i = 0; i < GB; ++i) {
        const uint32_t d = tid + NT * (uint32_t)(gb * GB + i);
        gw[i] = d < (uint32_t)D ? F32(gate_inp[d]) : 0.0f;
        gh[i] = d < (uint32_t)D ? h[(uint64_t)t * D + d] : 0.0f;
      }
"""

BODY = r"""
  constexpr int NW = NT / 32;
  constexpr int CG = W / VEC;             // threads across one row of the strip (VEC columns each)
  constexpr int NS = NT / CG;             // row subsets: subset s sums rows s, s + NS, s + 2 NS, ...
  constexpr int G = NT / W;               // merge groups: group g folds subsets g*VEC .. g*VEC+VEC-1
  constexpr int Q = P + PS;               // rows: routed 0..P-1, then shared P..P+PS-1
  constexpr int RPT = (Q + NS - 1) / NS;  // rows a thread sums
  constexpr int B = RPT < 8 ? RPT : 8;    // row loads in flight a thread
  constexpr int NGL = (D + NT - 1) / NT;  // gate values a thread
  constexpr int GB = NGL < 16 ? NGL : 16; // gate loads in flight a thread
  const uint32_t t = by;
  SHARED float sub_r[NS * W];             // [subset][column] routed sums
  SHARED float sub_s[NS * W];             // [subset][column] shared sums
  SHARED float grp_r[G * W];              // [group][column]
  SHARED float grp_s[G * W];
  SHARED float red[NW];
  const uint32_t c = tid % CG;
  const uint32_t s = tid / CG;
  const uint32_t col = bx * W + c * VEC;  // this thread's first column
  const bool live = col < (uint32_t)D;

  float gw[GB], gh[GB];
  float ga = 0.0f;
  if (GATED) {
    const int gb = 0;
    GATE_LOAD
  }

  float r[VEC], sh[VEC];
  UNROLL for (int j = 0; j < VEC; ++j) { r[j] = 0.0f; sh[j] = 0.0f; }
  for (int q0 = (int)s; q0 < Q; q0 += NS * B) {
    float v[B][VEC];
    UNROLL for (int i = 0; i < B; ++i) {
      const int q = q0 + NS * i;
      if (live && q < Q) {
        const DEVICE float* src = q < P ? routed + ((uint64_t)t * P + q) * D + col
                                        : shared + ((uint64_t)t * PS + (q - P)) * D + col;
        if (VEC == 4) {
          const f4 w4 = load_f4(src);
          UNROLL for (int j = 0; j < VEC; ++j) v[i][j] = w4.v[j];
        } else {
          v[i][0] = src[0];
        }
      } else {
        UNROLL for (int j = 0; j < VEC; ++j) v[i][j] = 0.0f;
      }
    }
    UNROLL for (int i = 0; i < B; ++i) {
      const int q = q0 + NS * i;
      if (q < P) {
        UNROLL for (int j = 0; j < VEC; ++j) r[j] += v[i][j];
      } else if (q < Q) {
        UNROLL for (int j = 0; j < VEC; ++j) sh[j] += v[i][j];
      }
    }
  }
  UNROLL for (int j = 0; j < VEC; ++j) {
    sub_r[s * W + c * VEC + j] = r[j];
    sub_s[s * W + c * VEC + j] = sh[j];
  }

  if (GATED) {
    for (int gb = 0; gb * GB < NGL; ++gb) {
      if (gb > 0) {
        GATE_LOAD
      }
      UNROLL for (int i = 0; i < GB; ++i) ga += gw[i] * gh[i];
    }
    ga = warp_sum(ga);
    if (lane == 0) red[warp_id] = ga;
  }
  BARRIER();
  {
    const uint32_t k = tid % W;
    const uint32_t g = tid / W;
    float fr = 0.0f, fs = 0.0f;
    UNROLL for (int u = 0; u < VEC; ++u) {
      fr += sub_r[(g * VEC + u) * W + k];
      fs += sub_s[(g * VEC + u) * W + k];
    }
    grp_r[g * W + k] = fr;
    grp_s[g * W + k] = fs;
  }
  BARRIER();
  if (tid < (uint32_t)W) {
    const uint32_t d = bx * W + tid;
    float sg = 1.0f;
    if (GATED) {
      float tot = 0.0f;
      for (int w = 0; w < NW; ++w) tot += red[w];
      sg = 1.0f / (1.0f + exp_f(-tot));
    }
    if (d < (uint32_t)D) {
      float rs = 0.0f, ss = 0.0f;
      for (int g = 0; g < G; ++g) {
        rs += grp_r[g * W + tid];
        ss += grp_s[g * W + tid];
      }
      out[(uint64_t)t * D + d] = x[(uint64_t)t * D + d] + (rs + ss * sg);
    }
  }
"""
BODY = expand(BODY, GATE_LOAD=_GATE_LOAD)

SOURCE = KernelSource("strata_combine", ("x", "routed", "shared", "h", "gate_inp"), ("out",), BODY)


def combine(x: mx.array, routed: mx.array, shared: mx.array | None, h: mx.array,
            gate_inp: mx.array | None) -> mx.array:
    """Kernel path. shared None: no shared expert; gate_inp None: ungated.

    Shapes:
        x float32 [T, D], routed float32 [T, P, D], shared float32 [T, PS, D] or None,
        h float32 [T, D], gate_inp float16 [D] or None -> float32 [T, D]
    """
    t, d = x.shape
    ps = 0 if shared is None else shared.shape[1]
    shared = absent(np.float32) if shared is None else shared
    gated = gate_inp is not None and ps > 0
    gate_inp = gate_inp if gate_inp is not None else absent(np.float16)
    vec = 4 if d % 4 == 0 else 1  # float4 loads need 16-byte aligned rows
    return launch(SOURCE, [x, routed, shared, h, gate_inp], [(t, d)], [mx.float32],
                  blocks=((d + STRIP - 1) // STRIP, t, 1), threads=THREADS,
                  template=(("D", d), ("P", routed.shape[1]), ("PS", ps), ("GATED", int(gated)), ("NT", THREADS),
                            ("W", STRIP), ("VEC", vec)))[0]
