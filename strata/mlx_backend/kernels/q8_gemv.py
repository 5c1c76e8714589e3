"""Q8_0 GEMV (the read-ahead router guess, design §6 pred_q8): y[t, r] = sum_c W[r, c] x[t, c].

W is two planes (strata.formats.quant_matrix): int8 codes [R, C] and float16 block scales
[R, C/32]. One warp per row; each lane reads whole uint32 words (4 codes) of the row, so a warp
reads 128 contiguous bytes per step; per word: d * (sum of 4 code*x).

Shapes:
    codes uint8 [R, C], scales float16 [R, C/32], x float32 [T, C] -> y float32 [T, R]
Grid: x = ceil(R / NW) blocks of NT threads, y = T.
"""

from __future__ import annotations

import mlx.core as mx

from strata.formats.quant_types import QuantType, layout
from strata.mlx_backend.kernels.launch import as_f32, launch
from strata.mlx_backend.kernels.preludes import WARP
from strata.mlx_backend.kernels.source import KernelSource

Q8 = layout(QuantType.Q8_0)
THREADS = 256

BODY = r"""
  constexpr int NW = NT / 32;
  const uint32_t t = by;
  const uint32_t r = bx * NW + warp_id;
  if (r < (uint32_t)R) {  // warp-uniform; no barrier in this kernel
    const DEVICE uint32_t* row = (const DEVICE uint32_t*)(codes + (uint64_t)r * C);
    const DEVICE half_t* sc = scales + (uint64_t)r * (C / QB);
    const DEVICE float* xt = x + (uint64_t)t * C;
    float acc = 0.0f;
    for (uint32_t w = lane; w < (uint32_t)(C / 4); w += 32) {
      const uint32_t q = row[w];
      const f4 xv = load_f4(xt + 4 * w);
      const float s = F32(((int32_t)(q << 24)) >> 24) * xv.v[0] + F32(((int32_t)(q << 16)) >> 24) * xv.v[1]
                    + F32(((int32_t)(q << 8)) >> 24) * xv.v[2] + F32(((int32_t)q) >> 24) * xv.v[3];
      acc += F32(sc[w / (QB / 4)]) * s;
    }
    acc = warp_sum(acc);
    if (lane == 0) y[(uint64_t)t * R + r] = acc;
  }
"""

SOURCE = KernelSource("strata_q8_gemv", ("codes", "scales", "x"), ("y",), BODY)


def q8_gemv(codes: mx.array, scales: mx.array, x: mx.array) -> mx.array:
    """The kernel path. codes uint8 [R, C], scales float16 [R, C/32], x float32 [T, C] -> [T, R]"""
    r, c = codes.shape
    t = x.shape[0]
    nw = THREADS // WARP
    return launch(SOURCE, [codes, scales, as_f32(x)], [(t, r)], [mx.float32],
                  blocks=((r + nw - 1) // nw, t, 1), threads=THREADS,
                  template=(("R", r), ("C", c), ("QB", Q8.block_size), ("NT", THREADS)))[0]
