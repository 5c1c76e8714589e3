"""The router kernel: the residual after attention, the router input, the router logits and the
read-ahead guess, in one launch (they share the same D-value input and normalisation).

Every block recomputes x_mid = x + sum_h attn_partials[h] and its RMSNorm h (D values, from L2),
block 0 writes both out; then each warp takes one row: rows 0..E-1 of the F32 router
(z = W_router . h, SPEC §3), rows E..E+NG-1 of the next layer's Q8_0 router copy (the guess,
SPEC §6 pred_q8; NG = 0: none). Lanes read 16 contiguous bytes each (a warp: 512 bytes a step).

Shapes:
    x float32 [T, D], partials float32 [T, H, D], norm_w float16 [D], w_router float32 [E, D],
    guess codes uint8 [NG, D] + scales float16 [NG, D/32]
    -> x_mid float32 [T, D], h float32 [T, D], z float32 [T, E], g float32 [T, max(NG, 1)]
"""

from __future__ import annotations

import mlx.core as mx
import numpy as np

from strata.mlx_backend.kernels.launch import absent, float_params, launch
from strata.mlx_backend.kernels.preludes import WARP
from strata.mlx_backend.kernels.source import KernelSource

THREADS = 256

BODY = r"""
  constexpr int NW = NT / 32;
  constexpr int NBR = (E + NW - 1) / NW;      // blocks of router rows; the rest take guess rows
  const uint32_t t = by;
  const float eps = fparams[0];
  SHARED float hv[D];
  SHARED float red[NW];
  float ss = 0.0f;
  for (uint32_t d = tid; d < (uint32_t)D; d += NT) {
    float v = x[(uint64_t)t * D + d];
    for (int p = 0; p < P; ++p) v += parts[((uint64_t)t * P + p) * D + d];
    hv[d] = v;
    ss += v * v;
  }
  ss = warp_sum(ss);
  if (lane == 0) red[warp_id] = ss;
  BARRIER();
  float tot = 0.0f;
  for (int w = 0; w < NW; ++w) tot += red[w];
  const float inv = 1.0f / sqrt_f(tot / (float)D + eps);
  for (uint32_t d = tid; d < (uint32_t)D; d += NT) {
    const float v = hv[d];
    const float n = v * inv * F32(norm_w[d]);
    hv[d] = n;
    if (bx == 0) { x_mid[(uint64_t)t * D + d] = v; h[(uint64_t)t * D + d] = n; }
  }
  BARRIER();
  if (bx < (uint32_t)NBR) {
    const uint32_t e = bx * NW + warp_id;
    if (e < (uint32_t)E) {
      const DEVICE float* row = w_router + (uint64_t)e * D;
      float a = 0.0f;
      for (uint32_t g = lane; g < (uint32_t)(D / 4); g += 32) {
        const f4 w = load_f4(row + 4 * g);
        a += w.v[0] * hv[4 * g] + w.v[1] * hv[4 * g + 1] + w.v[2] * hv[4 * g + 2] + w.v[3] * hv[4 * g + 3];
      }
      a = warp_sum(a);
      if (lane == 0) z[(uint64_t)t * E + e] = a;
    }
  } else {
    const uint32_t e = (bx - NBR) * NW + warp_id;
    if (e < (uint32_t)NG) {
      const DEVICE uint32_t* row = (const DEVICE uint32_t*)(g_codes + (uint64_t)e * D);
      const DEVICE half_t* sc = g_scales + (uint64_t)e * (D / 32);
      float a = 0.0f;
      for (uint32_t w = lane; w < (uint32_t)(D / 4); w += 32) {
        const uint32_t qv = row[w];
        const float s = F32(((int32_t)(qv << 24)) >> 24) * hv[4 * w] + F32(((int32_t)(qv << 16)) >> 24) * hv[4 * w + 1]
                      + F32(((int32_t)(qv << 8)) >> 24) * hv[4 * w + 2] + F32(((int32_t)qv) >> 24) * hv[4 * w + 3];
        a += F32(sc[w / 8]) * s;
      }
      a = warp_sum(a);
      if (lane == 0) g[(uint64_t)t * NG + e] = a;
    }
  }
"""

SOURCE = KernelSource("strata_router", ("x", "parts", "norm_w", "w_router", "g_codes", "g_scales", "fparams"),
                      ("x_mid", "h", "z", "g"), BODY)


def router(x: mx.array, parts: mx.array, norm_w: mx.array, w_router: mx.array, g_codes: mx.array | None,
           g_scales: mx.array | None, eps: float) -> tuple[mx.array, mx.array, mx.array, mx.array]:
    """Kernel path -> (x_mid [T, D], h [T, D], z [T, E], g [T, NG or 1])."""
    t, d = x.shape
    e = w_router.shape[0]
    ng = 0 if g_codes is None else g_codes.shape[0]
    nw = THREADS // WARP
    blocks = (e + nw - 1) // nw + (ng + nw - 1) // nw
    return tuple(launch(
        SOURCE, [x, parts, norm_w, w_router, g_codes if ng else absent(np.uint8),
                 g_scales if ng else absent(np.float16), float_params(eps)],
        [(t, d), (t, d), (t, e), (t, max(ng, 1))], [mx.float32] * 4, blocks=(blocks, t, 1), threads=THREADS,
        template=(("D", d), ("P", parts.shape[1]), ("E", e), ("NG", ng), ("NT", THREADS))))
