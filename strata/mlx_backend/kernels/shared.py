"""The shared expert on dense float16 weights, split like the routed kernel (moe.py): block
(c, t) computes h_f = silu(gate_f . x) * (up_f . x) for FCS rows, then its partial of the down
projection. The sigmoid gate is applied in the combine kernel (it needs the whole h anyway).

Reads: gate/up rows by one warp each, a lane taking 8 halves (16 bytes) at group lane + 32 i (a
warp reads 512 contiguous bytes per step); the lane's x values stay in registers. Down: a thread
per output row reads its chunk's FCS halves.

Shapes:
    h float32 [T, D], gate/up float16 [Fs, D], down float16 [D, Fs] -> partials float32 [T, Fs/FCS, D]
"""

from __future__ import annotations

import mlx.core as mx

from strata.mlx_backend.kernels.launch import as_f32, launch
from strata.mlx_backend.kernels.source import KernelSource

THREADS = 256
CHUNK = 32  # hidden units per block

BODY = r"""
  constexpr int NW = NT / 32;
  constexpr int GPR = D / 8;                  // 8-half groups per row
  constexpr int GPL = (GPR + 31) / 32;        // groups per lane
  const uint32_t t = by;
  const uint32_t c = bx;
  SHARED float hs[FC];
  float xr[GPL * 8];
  UNROLL for (int i = 0; i < GPL; ++i) {
    const int g = (int)lane + 32 * i;
    UNROLL for (int j = 0; j < 8; j += 4) {
      f4 v; v.v[0] = 0.0f; v.v[1] = 0.0f; v.v[2] = 0.0f; v.v[3] = 0.0f;
      if (g < GPR) v = load_f4(x + (uint64_t)t * D + 8 * g + j);
      UNROLL for (int q = 0; q < 4; ++q) xr[i * 8 + j + q] = v.v[q];
    }
  }
  for (int r = (int)warp_id; r < FC; r += NW) {
    const uint64_t f = (uint64_t)c * FC + r;
    float ga = 0.0f, ua = 0.0f;
    UNROLL for (int i = 0; i < GPL; ++i) {
      const int g = (int)lane + 32 * i;
      if (g < GPR) {
        const f8 gv = load_h8(gate + f * D + 8 * g);
        const f8 uv = load_h8(up + f * D + 8 * g);
        UNROLL for (int j = 0; j < 8; ++j) { ga += gv.v[j] * xr[i * 8 + j]; ua += uv.v[j] * xr[i * 8 + j]; }
      }
    }
    ga = warp_sum(ga);
    ua = warp_sum(ua);
    if (lane == 0) hs[r] = ga / (1.0f + exp_f(-ga)) * ua;
  }
  BARRIER();
  DEVICE float* dst = out + ((uint64_t)t * NCH + c) * D;
  for (uint32_t d = tid; d < (uint32_t)D; d += NT) {
    const DEVICE half_t* row = down + (uint64_t)d * FS + (uint64_t)c * FC;
    float acc = 0.0f;
    UNROLL for (int g = 0; g < FC / 8; ++g) {
      const f8 w = load_h8(row + 8 * g);
      UNROLL for (int j = 0; j < 8; ++j) acc += w.v[j] * hs[8 * g + j];
    }
    dst[d] = acc;
  }
"""

SOURCE = KernelSource("strata_shared_expert", ("x", "gate", "up", "down"), ("out",), BODY)


def chunk_for(fs: int) -> int:
    for fc in (CHUNK, 16, 8):
        if fs % fc == 0:
            return fc
    raise ValueError(f"shared expert kernel: shared_ffn {fs} must be a multiple of 8")


def shared_partials(x: mx.array, gate: mx.array, up: mx.array, down: mx.array) -> mx.array:
    """Kernel path. x [T, D]; gate/up float16 [Fs, D]; down float16 [D, Fs] -> [T, Fs/FC, D]"""
    t, d = x.shape
    fs = gate.shape[0]
    if d % 8:
        raise ValueError(f"shared expert kernel: hidden {d} must be a multiple of 8")
    fc = chunk_for(fs)
    return launch(SOURCE, [as_f32(x), gate, up, down], [(t, fs // fc, d)], [mx.float32],
                  blocks=(fs // fc, t, 1), threads=THREADS,
                  template=(("D", d), ("FS", fs), ("FC", fc), ("NCH", fs // fc), ("NT", THREADS)))[0]
