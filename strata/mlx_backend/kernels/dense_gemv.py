"""Dense float16 GEMV with float32 activations and accumulation, optionally after an RMSNorm of
the activations and with a bias: y[t, r] = sum_c W[r, c] xn[t, c] (+ b[r]),
xn = x / sqrt(mean(x^2) + eps) * norm_w (NORM) or x.

Three uses per decoded token: the attention's QKV projection (NORM + optional BIAS), its output
projection (plain) and the LM head (NORM: final norm + head in one launch).

Each block stages its token's (normed) activations in threadgroup memory, transposed
(xs[j * C/8 + g] = xn[8 g + j]) so that lane-consecutive groups read consecutive words (the
straight layout, lane l reading xn[8 l + j], is an 8-way bank conflict: 640 shared-memory cycles
per row at C = 2560, against ~250 cycles of HBM time for the row's 5 KB). Then a warp per RPW
rows: each lane owns the 16-byte groups g = lane + 32 i of the rows and issues all of them
(up to MAX_LOADS per lane) before using any, so a lane has 160 bytes in flight at C = 2560
instead of waiting on memory once per group. Writing the loads first is not enough: ptxas
(CUDA 13, sm_90) interleaved them with their FMAs, 3 in flight, to stay at 32 registers (the old
fused kernels' loads were interleaved the same way, SASS read with nvdisasm); a `warp_sync()`
between the loads and their use keeps all 10 LDG.128 ahead (55 registers at C = 2560). At the reference engine shape (D 2560, 16 + 2 x 4 heads of
128) the QKV projection runs on 384 blocks of 8 rows (40 KB of weights each, 2.9 per H200 SM)
and the output projection on 320 blocks (32 KB each); the old fused QKV kernel had 24 blocks
(one per head slot), so 24 of 132 SMs moved all 15.7 MB (64 us, ~12% of copy bandwidth).

Shapes:
    w float16 [R, C], x float32 [T, C], norm_w float16 [C], bias float16 [R] -> y float32 [T, R]
Grid: x = ceil(R / (NW RPW)) blocks of NT threads, y = T.
"""

from __future__ import annotations

import mlx.core as mx
import numpy as np

from strata.mlx_backend.kernels.launch import absent, as_f32, float_params
from strata.mlx_backend.kernels.phases import LaunchSpec, run
from strata.mlx_backend.kernels.preludes import WARP
from strata.mlx_backend.kernels.source import KernelSource, expand

THREADS = 256
MAX_COLS = 8192  # C floats of threadgroup memory per block (32 KB)
MAX_LOADS = 16  # 16-byte loads a lane issues before it uses them (registers: ~4 each while in flight)
# Blocks worth filling before a warp takes two rows per step: 4 per SM of an H200 (132 SMs).
# Below it (the QKV and output projections) a warp takes one row, so the grid has more blocks.
MIN_BLOCKS_FOR_TWO_ROWS = 4 * 132
# The first batch of weight loads before the activations are staged and normed (they do not
# depend on x), so HBM's latency hides behind the prologue's L2 round trips and barriers instead
# of following them: at one token a GEMV is a single round of loads a warp (10 LDG.128 a lane at
# C = 2560), so the prologue was ~1.5 us of a ~12 us QKV launch (ncu, H200) with nothing in
# flight. Predicted: QKV 12 -> ~10 us, output projection 6.6 -> ~5.5 us. The sums are unchanged.

BODY = r"""
  constexpr int NW = NT / 32;
  constexpr int GPR = C / 8;                                   // 16-byte groups per row
  constexpr int GPL = (GPR + 31) / 32;                         // groups per lane
  constexpr int NB = (GPL + MAX_LOADS / RPW - 1) / (MAX_LOADS / RPW);  // batches of loads per lane
  constexpr int GB = (GPL + NB - 1) / NB;                      // groups per lane per batch
  const uint32_t t = by;
  SHARED float xs[C];  // xs[j * GPR + g] = xn[8 g + j]
  SHARED float red[NW];
  const uint32_t r0 = (bx * NW + warp_id) * RPW;
  const DEVICE half_t* rows[RPW];
  float acc[RPW];
  UNROLL for (int k = 0; k < RPW; ++k) {
    const uint32_t r = r0 + k < (uint32_t)R ? r0 + k : (uint32_t)(R - 1);  // past R: read a real row, store nothing
    rows[k] = w + (uint64_t)r * C;
    acc[k] = 0.0f;
  }
  uint4 wv[RPW][GB];  // the halves as loaded: widened only where used, so the loads stay in flight
  LOAD_BATCH
  {  // batch 0's weights do not depend on x: in flight while x is staged and normed
    const int b = 0;
    LOAD
  }
  STAGE_X
  UNROLL for (int b = 0; b < NB; ++b) {
    if (b > 0) {
      LOAD
    }
    warp_sync();  // a fence for the scheduler: the loads above all issue before the FMAs below
    UNROLL for (int i = 0; i < GB; ++i) {
      const int g = (int)lane + 32 * (b * GB + i);
      if (g < GPR) {
        f8 wf[RPW];
        UNROLL for (int k = 0; k < RPW; ++k) wf[k] = h8_f8(wv[k][i]);
        UNROLL for (int j = 0; j < 8; ++j) {
          const float xv = xs[j * GPR + g];
          UNROLL for (int k = 0; k < RPW; ++k) acc[k] += wf[k].v[j] * xv;
        }
      }
    }
  }
  UNROLL for (int k = 0; k < RPW; ++k) {
    const float a = warp_sum(acc[k]);
    if (lane == 0 && r0 + k < (uint32_t)R) y[(uint64_t)t * R + r0 + k] = a + (BIAS ? F32(bias[r0 + k]) : 0.0f);
  }
"""
# batch b's 16-byte groups of the warp's rows, every one issued before any is used
_LOAD = r"""
    UNROLL for (int i = 0; i < GB; ++i) {
      const int g = (int)lane + 32 * (b * GB + i);
      const int gc = g < GPR ? g : GPR - 1;  // past the row: re-read its last group (unused; no branch)
      UNROLL for (int k = 0; k < RPW; ++k) wv[k][i] = *(const DEVICE uint4*)(rows[k] + 8 * gc);
    }
"""
# token t's activations into threadgroup memory (xs[j * GPR + g] = x[8 g + j]), RMS-normed by
# norm_w where NORM; every thread's own elements, then a barrier. Shared with kernels/qkv_groups.py,
# whose rows must be summed over the very same xs
STAGE_X = r"""
  float ss = 0.0f;
  for (uint32_t c = tid; c < (uint32_t)C; c += NT) {
    const float v = x[(uint64_t)t * C + c];
    xs[(c % 8) * GPR + c / 8] = v;
    ss += v * v;
  }
  if (NORM) {
    ss = warp_sum(ss);
    if (lane == 0) red[warp_id] = ss;
    BARRIER();
    float tot = 0.0f;
    for (int q = 0; q < NW; ++q) tot += red[q];
    const float inv = 1.0f / sqrt_f(tot / (float)C + fparams[0]);
    for (uint32_t c = tid; c < (uint32_t)C; c += NT) {  // this thread's own elements
      const uint32_t k = (c % 8) * GPR + c / 8;
      xs[k] = xs[k] * inv * F32(norm_w[c]);
    }
  }
  BARRIER();
"""
BODY = expand(BODY.replace("  LOAD_BATCH\n", ""), LOAD=_LOAD, STAGE_X=STAGE_X)

SOURCE = KernelSource("strata_dense_gemv", ("w", "x", "norm_w", "bias", "fparams"), ("y",), BODY)


def rows_per_warp(r: int) -> int:
    """1, or 2 where the grid still has MIN_BLOCKS_FOR_TWO_ROWS blocks per token (the LM head)."""
    nw = THREADS // WARP
    return 2 if (r + 2 * nw - 1) // (2 * nw) >= MIN_BLOCKS_FOR_TWO_ROWS else 1


def dense_gemv(w: mx.array, x: mx.array, norm_w: mx.array | None = None, eps: float = 0.0,
               bias: mx.array | None = None, *, spec: bool = False):
    """Kernel path. w float16 [R, C] (C a multiple of 8, at most MAX_COLS), x float32 [T, C];
    with norm_w (float16 [C]) x is RMS-normed first; with bias (float16 [R]) it is added.
    spec: the launch's `phases.LaunchSpec` instead of its output (for `phases.chain`).

    Shapes:
        w [R, C], x [T, C] -> y float32 [T, R]
    """
    r, c = w.shape
    t = x.shape[0]
    if c % 8 or c > MAX_COLS:
        raise ValueError(f"dense GEMV kernel: {c} columns must be a multiple of 8, at most {MAX_COLS}")
    rpw = rows_per_warp(r)
    rows_per_block = rpw * (THREADS // WARP)
    norm, has_bias = norm_w is not None, bias is not None
    one = LaunchSpec(SOURCE, (w, as_f32(x), norm_w if norm else absent(np.float16),
                              bias if has_bias else absent(np.float16), float_params(eps)),
                     ((t, r),), (mx.float32,), ((r + rows_per_block - 1) // rows_per_block, t, 1), THREADS,
                     (("R", r), ("C", c), ("NORM", int(norm)), ("BIAS", int(has_bias)), ("RPW", rpw),
                      ("MAX_LOADS", MAX_LOADS), ("NT", THREADS)))
    return one if spec else run(one)[0]
