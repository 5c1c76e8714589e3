"""The shared expert on dense float16 weights, split like the routed kernel (moe.py): block sb
computes h_f = silu(gate_f . x) * (up_f . x) for FCS hidden units, then its partial of the down
projection. The sigmoid gate is applied in the combine kernel (it needs the whole h anyway).

`SHARED_BLOCK` is the block's work, written once and used by two kernels: the standalone shared
expert here (the streaming path launches it between issuing reads and waiting, design §4) and the
all-resident decode's expert kernel (moe.py), where the shared expert's blocks ride in the routed
experts' launch (one launch fewer per layer: the H200 measured ~14 us of host time per launch,
and this kernel alone 16 us of GPU time on 16 blocks of 32 rows, 491 KB each).

Sizes (the reference engine's Fs = 512, D = 2560): FCS = 8 rows per block (one per warp), so 64 blocks of
~123 KB (82 KB of gate/up rows, 41 KB of down columns), about the routed blocks' 77 KB: the two
kinds finish together. x is staged in threadgroup memory (D floats) instead of registers: in the
merged kernel the register count is the larger of the two kinds', and the routed blocks need 73.

Reads: gate/up rows by one warp each, a lane taking 8 halves (16 bytes) at group lane + 32 i (a
warp reads 512 contiguous bytes per step), the loads of both rows issued before use. Down: a
thread per output row reads its chunk's FCS halves, SDB rows' loads in flight before use.

Shapes:
    x float32 [T, D], gate/up float16 [Fs, D], down float16 [D, Fs] -> partials float32 [T, Fs/FCS, D]
"""

from __future__ import annotations

import mlx.core as mx

from strata.mlx_backend.kernels.launch import as_f32, launch
from strata.mlx_backend.kernels.source import KernelSource

THREADS = 256
MAX_HIDDEN = 8192  # D floats of threadgroup memory (32 KB)

# The kernel that includes SHARED_BLOCK declares: t (token), sb (shared block), hs[>= FCS] and
# xsh[>= D] (SHARED floats), and has template ints D, FS, FCS, NSB, NT; inputs x, sgate, sup,
# sdown; output sout [T, NSB, D]. Block-uniform throughout (barriers inside).
SHARED_BLOCK = r"""
  {
    constexpr int NWS = NT / 32;
    constexpr int SGPR = D / 8;                   // 8-half groups per row
    constexpr int SGPL = (SGPR + 31) / 32;        // groups per lane
    constexpr int SRPW = (FCS + NWS - 1) / NWS;   // rows per warp
    constexpr int SDB = 32 / FCS > 0 ? 32 / FCS : 1;  // down rows per thread with loads in flight
    constexpr int SDPT = (D + NT - 1) / NT;       // down rows per thread
    for (uint32_t d = tid; d < (uint32_t)D; d += NT) xsh[d] = x[(uint64_t)t * D + d];
    BARRIER();
    float ga[SRPW], ua[SRPW];
    UNROLL for (int rr = 0; rr < SRPW; ++rr) { ga[rr] = 0.0f; ua[rr] = 0.0f; }
    UNROLL for (int i = 0; i < SGPL; ++i) {
      const int g = (int)lane + 32 * i;
      if (g < SGPR) {  // lane-dependent only where SGPR is not a multiple of 32; no warp op inside
        f8 gv[SRPW], uv[SRPW];
        UNROLL for (int rr = 0; rr < SRPW; ++rr) {
          const int r = (int)warp_id + NWS * rr;
          if (r < FCS) {
            const uint64_t f = (uint64_t)sb * FCS + r;
            gv[rr] = load_h8(sgate + f * D + 8 * g);
            uv[rr] = load_h8(sup + f * D + 8 * g);
          }
        }
        UNROLL for (int rr = 0; rr < SRPW; ++rr) {
          if ((int)warp_id + NWS * rr < FCS) {
            UNROLL for (int j = 0; j < 8; ++j) {
              const float xv = xsh[8 * g + j];
              ga[rr] += gv[rr].v[j] * xv;
              ua[rr] += uv[rr].v[j] * xv;
            }
          }
        }
      }
    }
    UNROLL for (int rr = 0; rr < SRPW; ++rr) {
      const int r = (int)warp_id + NWS * rr;  // warp-uniform
      if (r < FCS) {
        const float gs = warp_sum(ga[rr]), us = warp_sum(ua[rr]);
        if (lane == 0) hs[r] = gs / (1.0f + exp_f(-gs)) * us;
      }
    }
    BARRIER();
    DEVICE float* sdst = sout + ((uint64_t)t * NSB + sb) * D;
    for (int i0 = 0; i0 < SDPT; i0 += SDB) {
      f8 w[SDB][FCS / 8];
      UNROLL for (int b = 0; b < SDB; ++b) {
        const uint32_t d = tid + NT * (uint32_t)(i0 + b);
        if (i0 + b < SDPT && d < (uint32_t)D) {
          const DEVICE half_t* row = sdown + (uint64_t)d * FS + (uint64_t)sb * FCS;
          UNROLL for (int q = 0; q < FCS / 8; ++q) w[b][q] = load_h8(row + 8 * q);
        }
      }
      UNROLL for (int b = 0; b < SDB; ++b) {
        const uint32_t d = tid + NT * (uint32_t)(i0 + b);
        if (i0 + b < SDPT && d < (uint32_t)D) {
          float acc = 0.0f;
          UNROLL for (int q = 0; q < FCS / 8; ++q) {
            UNROLL for (int j = 0; j < 8; ++j) acc += w[b][q].v[j] * hs[8 * q + j];
          }
          sdst[d] = acc;
        }
      }
    }
  }
"""

BODY = r"""
  const uint32_t t = by;
  const uint32_t sb = bx;
  SHARED float hs[FCS];
  SHARED float xsh[D];
""" + SHARED_BLOCK

SOURCE = KernelSource("strata_shared_expert", ("x", "sgate", "sup", "sdown"), ("sout",), BODY)


def chunk_for(fs: int) -> int:
    """FCS: hidden units per block. 8 (one row per warp) up to Fs = 1024, then 16 (fewer
    partials for combine to add: Fs / FCS of them)."""
    if fs % 8:
        raise ValueError(f"shared expert kernel: shared_ffn {fs} must be a multiple of 8")
    return 16 if fs > 1024 and fs % 16 == 0 else 8


def check_hidden(d: int) -> None:
    if d % 8 or d > MAX_HIDDEN:
        raise ValueError(f"shared expert kernel: hidden {d} must be a multiple of 8, at most {MAX_HIDDEN}")


def template(fs: int) -> tuple[tuple[str, int], ...]:
    """The template ints of SHARED_BLOCK beside D and NT (which the including kernel has)."""
    fcs = chunk_for(fs)
    return (("FS", fs), ("FCS", fcs), ("NSB", fs // fcs))


def shared_partials(x: mx.array, gate: mx.array, up: mx.array, down: mx.array) -> mx.array:
    """Kernel path. x [T, D]; gate/up float16 [Fs, D]; down float16 [D, Fs] -> [T, Fs/FCS, D]"""
    t, d = x.shape
    fs = gate.shape[0]
    check_hidden(d)
    tpl = template(fs)
    nsb = dict(tpl)["NSB"]
    return launch(SOURCE, [as_f32(x), gate, up, down], [(t, nsb, d)], [mx.float32],
                  blocks=(nsb, t, 1), threads=THREADS, template=(("D", d),) + tpl + (("NT", THREADS),))[0]
