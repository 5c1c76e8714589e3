"""The router kernel: the residual after attention, the router input, the router logits and the
read-ahead guess, in one launch (they share the same D-value input and normalisation).

Why this geometry: on the H200 (132 SMs) ncu timed the previous kernel at 15 us per decoded layer
of the seed-shape model (D=2560, E=256 F32 router rows = 2.6 MB, 256 Q8_0 guess rows = 0.7 MB).
It ran 64 blocks of 256 threads, each warp one row with one 16-byte load in flight per lane, and
only after its block had normalised x (so nothing hid HBM's latency): 64 SMs busy, ~20 dependent
loads a lane. Now:

- a block is 4 warps (NT=128), each warp one row: rows 0..E-1 of the F32 router
  (z = W_router . h, design §3) in the first ceil(E/4) blocks, rows of the next layer's Q8_0 router
  copy (the guess, design §6 pred_q8; NG = 0: none) in the rest (a block-uniform split, so the
  norm's barriers may sit inside each branch). Seed shape: 64 + 64 = 128 blocks.
- a lane issues all its row loads at once (up to ROW_LOADS 4-column units: 20 float4 = 320 bytes
  of an F32 row or 20 words of Q8_0 codes at D=2560; bigger D in batches) *before* the norm, so
  the weights' HBM latency overlaps the norm's round trip to L2: ~2.6 MB in flight at once;
- every block recomputes x_mid = x + sum_p parts[p] and its RMSNorm (P partials: one a head
  from attend_project, 16 at the seed shape, PB = 4 of them loaded at once, so 4 round trips to
  L2 rather than 16; 1 from the split attention's GEMV), five float4 units a thread at D=2560; block 0
  writes x_mid and h. The shared copy holds x_mid * norm_w column-planar (hv[k D/4 + u] is
  column 4u + k) so a lane reading its units' 4 columns reads 32 consecutive words a warp (no
  bank conflicts); the row sums are scaled by 1/rms at the end (z = inv * W . (x_mid * norm_w)).

Predicted at the reference engine shape, T=1: 128 blocks x 128 threads; 3.3 MB of weights from HBM (one
round of loads) overlapping 128 x 25 KB of x / parts / norm_w from L2: ~2-3 us.
Every sum is in a fixed order (per lane, then warp_sum, then warps in order).

Shapes:
    x float32 [T, D], parts float32 [T, P, D], norm_w float16 [D], w_router float32 [E, D],
    guess codes uint8 [NG, D] + scales float16 [NG, D/32]
    -> x_mid float32 [T, D], h float32 [T, D], z float32 [T, E], g float32 [T, max(NG, 1)]
Grid: x = ceil(E / 4) + ceil(NG / 4), y = T; THREADS threads a block.
"""

from __future__ import annotations


import mlx.core as mx
import numpy as np

from strata.mlx_backend.kernels.launch import absent, float_params
from strata.mlx_backend.kernels.phases import LaunchSpec, run
from strata.mlx_backend.kernels.preludes import WARP
from strata.mlx_backend.kernels.source import KernelSource, expand


THREADS = 128  # 4 warps, one row each: 128 blocks at the reference engine shape, one per H200 SM

# x_mid * norm_w into hv (planar), sum of squares -> inv = 1 / rms; block 0 writes x_mid and h.
_NORM = r"""
    float ss = 0.0f;
    for (int j0 = 0; j0 < NJ; j0 += JB) {
      f4 v[JB];
      float nw[JB][4];
      UNROLL for (int i = 0; i < JB; ++i) {
        const uint32_t u = tid + NT * (uint32_t)(j0 + i);
        if (u < (uint32_t)D4) {
          v[i] = load_f4(x + (uint64_t)t * D + 4 * u);
          UNROLL for (int k = 0; k < 4; ++k) nw[i][k] = F32(norm_w[4 * u + k]);
        } else {
          UNROLL for (int k = 0; k < 4; ++k) { v[i].v[k] = 0.0f; nw[i][k] = 0.0f; }
        }
      }
      for (int p0 = 0; p0 < P; p0 += PB) {  // PB partials' loads in flight at once, added in order
        f4 a[PB][JB];
        UNROLL for (int q = 0; q < PB; ++q) {
          UNROLL for (int i = 0; i < JB; ++i) {
            const uint32_t u = tid + NT * (uint32_t)(j0 + i);
            if (p0 + q < P && u < (uint32_t)D4) {
              a[q][i] = load_f4(parts + ((uint64_t)t * P + p0 + q) * D + 4 * u);
            } else {
              UNROLL for (int k = 0; k < 4; ++k) a[q][i].v[k] = 0.0f;
            }
          }
        }
        UNROLL for (int q = 0; q < PB; ++q) {
          if (p0 + q < P) {
            UNROLL for (int i = 0; i < JB; ++i) {
              UNROLL for (int k = 0; k < 4; ++k) v[i].v[k] += a[q][i].v[k];
            }
          }
        }
      }
      UNROLL for (int i = 0; i < JB; ++i) {
        const uint32_t u = tid + NT * (uint32_t)(j0 + i);
        if (u < (uint32_t)D4) {
          UNROLL for (int k = 0; k < 4; ++k) {
            const float vk = v[i].v[k];
            ss += vk * vk;
            hv[k * D4 + u] = vk * nw[i][k];
            if (bx == 0) x_mid[(uint64_t)t * D + 4 * u + k] = vk;
          }
        }
      }
    }
    ss = warp_sum(ss);
    if (lane == 0) red[warp_id] = ss;
    BARRIER();
    float tot = 0.0f;
    for (int w = 0; w < NW; ++w) tot += red[w];
    const float inv = 1.0f / sqrt_f(tot / (float)D + eps);
    if (bx == 0) {
      for (uint32_t u = tid; u < (uint32_t)D4; u += NT) {
        UNROLL for (int k = 0; k < 4; ++k) h[(uint64_t)t * D + 4 * u + k] = hv[k * D4 + u] * inv;
      }
    }
"""

# Batch b of an F32 router row: LB float4 units a lane (unit u = columns 4u .. 4u+3).
_LOAD_F32 = r"""
      UNROLL for (int i = 0; i < LB; ++i) {
        const uint32_t u = lane + 32 * (uint32_t)(b * LB + i);
        if (live && u < (uint32_t)D4) {
          wv[i] = load_f4(w_router + (uint64_t)e * D + 4 * u);
        } else {
          UNROLL for (int k = 0; k < 4; ++k) wv[i].v[k] = 0.0f;
        }
      }
"""

_DOT_F32 = r"""
      UNROLL for (int i = 0; i < LB; ++i) {
        const uint32_t u = lane + 32 * (uint32_t)(b * LB + i);
        if (u < (uint32_t)D4) {
          a += wv[i].v[0] * hv[u] + wv[i].v[1] * hv[D4 + u] + wv[i].v[2] * hv[2 * D4 + u] + wv[i].v[3] * hv[3 * D4 + u];
        }
      }
"""

# Batch b of a Q8_0 guess row: LB words of 4 codes a lane, and each word's block scale (kept raw:
# converting them here would wait for the loads before the norm).
_LOAD_Q8 = r"""
      UNROLL for (int i = 0; i < LB; ++i) {
        const uint32_t u = lane + 32 * (uint32_t)(b * LB + i);
        const bool ok = live && u < (uint32_t)D4;
        wq[i] = ok ? codes[(uint64_t)e * D4 + u] : 0u;
        ws[i] = g_scales[ok ? (uint64_t)e * (D / 32) + u / 8 : 0];
      }
"""

_DOT_Q8 = r"""
      UNROLL for (int i = 0; i < LB; ++i) {
        const uint32_t u = lane + 32 * (uint32_t)(b * LB + i);
        if (u < (uint32_t)D4) {
          const uint32_t qv = wq[i];
          const float s = F32(((int32_t)(qv << 24)) >> 24) * hv[u] + F32(((int32_t)(qv << 16)) >> 24) * hv[D4 + u]
                        + F32(((int32_t)(qv << 8)) >> 24) * hv[2 * D4 + u] + F32(((int32_t)qv) >> 24) * hv[3 * D4 + u];
          a += F32(ws[i]) * s;
        }
      }
"""

BODY = r"""
  constexpr int NW = NT / 32;
  constexpr int D4 = D / 4;                          // 4-column units
  constexpr int ROW_LOADS = RL;                      // units a lane keeps in flight (20, D <= 2560: a whole row)
  constexpr int NL = (D4 + 31) / 32;                 // units a lane in one row
  constexpr int NBATCH = (NL + ROW_LOADS - 1) / ROW_LOADS;
  constexpr int LB = (NL + NBATCH - 1) / NBATCH;     // units a lane a batch
  constexpr int NJ = (D4 + NT - 1) / NT;             // units a thread in the norm
  constexpr int JB = NJ < 8 ? NJ : 8;                // ... loaded at once
  constexpr int PB = P < 4 ? P : 4;                  // partials loaded at once (attend_project: one a head)
  constexpr int NBR = (E + NW - 1) / NW;             // blocks of router rows; the rest take guess rows
  const uint32_t t = by;
  const float eps = fparams[0];
  SHARED float hv[D];                                // x_mid * norm_w, column-planar: hv[k * D4 + u] = column 4u + k
  SHARED float red[NW];
  if (bx < (uint32_t)NBR) {                          // block-uniform
    const uint32_t e = bx * NW + warp_id;
    const bool live = e < (uint32_t)E;
    f4 wv[LB];
    ROWS_F32
    if (live && lane == 0) z[(uint64_t)t * E + e] = a * inv;
  } else {
    const uint32_t e = (bx - NBR) * NW + warp_id;
    const bool live = e < (uint32_t)NG;
    const DEVICE uint32_t* codes = (const DEVICE uint32_t*)g_codes;
    uint32_t wq[LB];
    half_t ws[LB];
    ROWS_Q8
    if (live && lane == 0) g[(uint64_t)t * NG + e] = a * inv;
  }
"""
# One warp's row in either branch: the first batch of loads goes out before the norm (its latency
# hides behind the norm's L2 round trip), then batch by batch, loads then dot products.
_ROWS = r"""
{
  const int b = 0;
  LOAD
}
NORM
float a = 0.0f;
for (int b = 0; b < NBATCH; ++b) {
  if (b > 0) {
    LOAD
  }
  DOT
}
a = warp_sum(a);
"""
BODY = expand(expand(BODY, ROWS_F32=expand(_ROWS, LOAD=_LOAD_F32, DOT=_DOT_F32),
                     ROWS_Q8=expand(_ROWS, LOAD=_LOAD_Q8, DOT=_DOT_Q8)), NORM=_NORM)

SOURCE = KernelSource("strata_router", ("x", "parts", "norm_w", "w_router", "g_codes", "g_scales", "fparams"),
                      ("x_mid", "h", "z", "g"), BODY)


ROW_LOADS = 20  # 4-column units a lane loads at once (RL): a whole row of D = 2560
# where the router's body first reads x and the parts (the F32 rows' first loads are out before):
# a chain's wait goes there (phases.chain_all; only without a guess, whose blocks branch apart)
WAIT_AT = BODY.rindex("\n", 0, BODY.index("float ss = 0.0f;")) + 1  # the start of the norm's first line


def router(x: mx.array, parts, norm_w: mx.array, w_router: mx.array, g_codes: mx.array | None,
           g_scales: mx.array | None, eps: float, *, threads: int = THREADS, row_loads: int = ROW_LOADS,
           spec: bool = False):
    """Kernel path -> (x_mid [T, D], h [T, D], z [T, E], g [T, NG or 1]).
    threads, row_loads: a block's threads (a warp a row) and a lane's loads in flight (the
    chained form's, attend_project.qkv_attend_route); spec: the launch's `phases.LaunchSpec`
    (parts may be a `phases.Pending`).

    Shapes:
        x float32 [T, D], parts float32 [T, P, D], norm_w float16 [D], w_router float32 [E, D],
        g_codes uint8 [NG, D] and g_scales float16 [NG, D/32], or both None; D % 4 == 0
        (D % 32 == 0 with a guess)
    """
    t, d = x.shape
    e = w_router.shape[0]
    ng = 0 if g_codes is None else g_codes.shape[0]
    if d % 4 or (ng and d % 32):
        raise ValueError(f"router kernel: hidden size {d} must be a multiple of 4 (of 32 with a guess)")
    nw = threads // WARP
    blocks = (e + nw - 1) // nw + (ng + nw - 1) // nw
    one = LaunchSpec(SOURCE, (x, parts, norm_w, w_router, g_codes if ng else absent(np.uint8),
                              g_scales if ng else absent(np.float16), float_params(eps)),
                     ((t, d), (t, d), (t, e), (t, max(ng, 1))), (mx.float32,) * 4, (blocks, t, 1), threads,
                     (("D", d), ("P", parts.shape[1]), ("E", e), ("NG", ng), ("NT", threads), ("RL", row_loads)))
    return one if spec else tuple(run(one))
