"""Attention for decode in two kernels (strata.reference.attention is the definition).

`qkv_rope`: block (s, t) owns head-slot s of the fused [q heads | k heads | v heads] projection:
RMSNorm of x (each block recomputes the D-value norm), the head's HD rows of W_qkv (+ bias),
per-head q/k RMSNorm (QKN = 1), RoPE in the rotate-half form from a cos/sin table computed on the
host in float64 (the reference's angles, bit for bit), then q is written out and k / v are written
into the layer's KV cache at position pos0 + t. The cache is an input the kernel writes in place
(a cast away from const): a separate cache-update op would cost a launch and, when anything else
aliases the cache, a copy of all of it.

`attend`: block (h, t) runs one query head over positions 0..pos0+t of its KV head: each warp
takes every NW-th position with an online softmax (running max, sum, weighted values), warps merge
through threadgroup memory; then the head's slice of the output projection, a partial [D] output
per head ([T, H, D]), summed by the router kernel into the residual. The projection takes a
thread per output row with 8 loads of 16 bytes in flight (a first version, a warp per row with 16
lanes and one load each, waited on memory once per row: 320 times per block at the seed's size).

Shapes:
    qkv_rope: x float32 [T, D] -> q float32 [T, H, HD]; writes kc/vc [KVH, S_MAX, HD]
    attend:   q float32 [T, H, HD] -> partials float32 [T, H, D]
"""

from __future__ import annotations

import mlx.core as mx
import numpy as np

from strata.mlx_backend.kernels.launch import absent, as_f32, float_params, index_param, launch
from strata.mlx_backend.kernels.source import KernelSource

THREADS = 256

QKV_BODY = r"""
  constexpr int NW = NT / 32;
  constexpr int GPR = D / 8;
  constexpr int GPL = (GPR + 31) / 32;
  constexpr int HALF = HD / 2;
  const uint32_t s = bx;
  const uint32_t t = by;
  const int32_t pos = params[0] + (int32_t)t;
  const float eps = fparams[0];
  SHARED float xn[D];
  SHARED float red[NW];
  SHARED float o[HD];
  float ss = 0.0f;
  for (uint32_t d = tid; d < (uint32_t)D; d += NT) { const float v = x[(uint64_t)t * D + d]; xn[d] = v; ss += v * v; }
  ss = warp_sum(ss);
  if (lane == 0) red[warp_id] = ss;
  BARRIER();
  float tot = 0.0f;
  for (int w = 0; w < NW; ++w) tot += red[w];
  const float inv = 1.0f / sqrt_f(tot / (float)D + eps);
  for (uint32_t d = tid; d < (uint32_t)D; d += NT) xn[d] = xn[d] * inv * F32(norm_w[d]);
  BARRIER();
  float xr[GPL * 8];
  UNROLL for (int i = 0; i < GPL; ++i) {
    const int g = (int)lane + 32 * i;
    UNROLL for (int j = 0; j < 8; ++j) xr[i * 8 + j] = (g < GPR) ? xn[8 * g + j] : 0.0f;
  }
  for (int r = (int)warp_id; r < HD; r += NW) {
    const uint64_t row = (uint64_t)s * HD + r;
    float acc = 0.0f;
    UNROLL for (int i = 0; i < GPL; ++i) {
      const int g = (int)lane + 32 * i;
      if (g < GPR) {
        const f8 w = load_h8(wqkv + row * D + 8 * g);
        UNROLL for (int j = 0; j < 8; ++j) acc += w.v[j] * xr[i * 8 + j];
      }
    }
    acc = warp_sum(acc);
    if (lane == 0) o[r] = acc + (BIAS ? F32(bias[row]) : 0.0f);
  }
  BARRIER();
  const bool is_q = s < (uint32_t)H;
  const bool is_k = !is_q && s < (uint32_t)(H + KVH);
  if (QKN) {  // per-head RMSNorm of q and k (block-uniform branches below)
    float s2 = 0.0f;
    for (uint32_t r = tid; r < (uint32_t)HD; r += NT) s2 += o[r] * o[r];
    s2 = warp_sum(s2);
    if (lane == 0) red[warp_id] = s2;
    BARRIER();
    float t2 = 0.0f;
    for (int w = 0; w < NW; ++w) t2 += red[w];
    const float inv2 = 1.0f / sqrt_f(t2 / (float)HD + eps);
    float nv[(HD + NT - 1) / NT];
    int n = 0;
    for (uint32_t r = tid; r < (uint32_t)HD; r += NT, ++n)
      nv[n] = is_q ? o[r] * inv2 * F32(q_norm[r]) : (is_k ? o[r] * inv2 * F32(k_norm[r]) : o[r]);
    BARRIER();
    n = 0;
    for (uint32_t r = tid; r < (uint32_t)HD; r += NT, ++n) o[r] = nv[n];
    BARRIER();
  }
  if (is_q || is_k) {
    for (uint32_t r = tid; r < (uint32_t)HALF; r += NT) {
      const float a = o[r], b = o[r + HALF];
      const float cs = rope_cos[(uint64_t)pos * HALF + r], sn = rope_sin[(uint64_t)pos * HALF + r];
      const float ra = a * cs - b * sn, rb = b * cs + a * sn;
      if (is_q) {
        q[((uint64_t)t * H + s) * HD + r] = ra;
        q[((uint64_t)t * H + s) * HD + r + HALF] = rb;
      } else {
        DEVICE float* kd = (DEVICE float*)kc + ((uint64_t)(s - H) * S_MAX + pos) * HD;
        kd[r] = ra;
        kd[r + HALF] = rb;
      }
    }
  } else {
    DEVICE float* vd = (DEVICE float*)vc + ((uint64_t)(s - H - KVH) * S_MAX + pos) * HD;
    for (uint32_t r = tid; r < (uint32_t)HD; r += NT) vd[r] = o[r];
  }
"""

ATTEND_BODY = r"""
  constexpr int NW = NT / 32;
  constexpr int QPL = (HD + 31) / 32;
  const uint32_t h = bx;
  const uint32_t t = by;
  const int32_t n_pos = params[0] + (int32_t)t + 1;     // causal: positions 0 .. pos0 + t
  const uint32_t kvh = h / (H / KVH);
  const float scale = sqrt_f((float)HD);
  SHARED float qs[HD];
  SHARED float mw[NW];
  SHARED float lw[NW];
  SHARED float accw[NW * HD];
  SHARED float o[HD];
  for (uint32_t r = tid; r < (uint32_t)HD; r += NT) qs[r] = q[((uint64_t)t * H + h) * HD + r];
  BARRIER();
  float m = NEG_BIG, l = 0.0f;
  float acc[QPL];
  UNROLL for (int i = 0; i < QPL; ++i) acc[i] = 0.0f;
  for (int32_t p = (int32_t)warp_id; p < n_pos; p += NW) {
    const DEVICE float* kp = kc + ((uint64_t)kvh * S_MAX + p) * HD;
    const DEVICE float* vp = vc + ((uint64_t)kvh * S_MAX + p) * HD;
    float dot = 0.0f;
    UNROLL for (int i = 0; i < QPL; ++i) {
      const int j = (int)lane + 32 * i;
      if (j < HD) dot += qs[j] * kp[j];
    }
    const float sc = warp_sum(dot) / scale;
    const float mn = sc > m ? sc : m;
    const float corr = exp_f(m - mn), pe = exp_f(sc - mn);
    l = l * corr + pe;
    UNROLL for (int i = 0; i < QPL; ++i) {
      const int j = (int)lane + 32 * i;
      acc[i] = acc[i] * corr + (j < HD ? pe * vp[j] : 0.0f);
    }
    m = mn;
  }
  if (lane == 0) { mw[warp_id] = m; lw[warp_id] = l; }
  UNROLL for (int i = 0; i < QPL; ++i) {
    const int j = (int)lane + 32 * i;
    if (j < HD) accw[warp_id * HD + j] = acc[i];
  }
  BARRIER();
  for (uint32_t r = tid; r < (uint32_t)HD; r += NT) {
    float mm = NEG_BIG;
    for (int w = 0; w < NW; ++w) mm = mw[w] > mm ? mw[w] : mm;
    float ll = 0.0f, aa = 0.0f;
    for (int w = 0; w < NW; ++w) { const float f = exp_f(mw[w] - mm); ll += lw[w] * f; aa += accw[w * HD + r] * f; }
    o[r] = aa / ll;
  }
  BARRIER();
  // output projection: a thread per output row (HD halves), GB 16-byte loads in flight before use
  constexpr int NG = HD / 8;
  constexpr int GB = NG % 8 == 0 ? 8 : (NG % 4 == 0 ? 4 : (NG % 2 == 0 ? 2 : 1));
  DEVICE float* dst = out + ((uint64_t)t * H + h) * D;
  for (uint32_t d = tid; d < (uint32_t)D; d += NT) {
    const DEVICE half_t* row = wo + (uint64_t)d * (H * HD) + (uint64_t)h * HD;
    float a = 0.0f;
    for (int g0 = 0; g0 < NG; g0 += GB) {
      f8 w[GB];
      UNROLL for (int g = 0; g < GB; ++g) w[g] = load_h8(row + 8 * (g0 + g));
      UNROLL for (int g = 0; g < GB; ++g) {
        UNROLL for (int j = 0; j < 8; ++j) a += w[g].v[j] * o[8 * (g0 + g) + j];
      }
    }
    dst[d] = a;
  }
"""

QKV_SOURCE = KernelSource(
    "strata_qkv_rope",
    ("x", "norm_w", "wqkv", "bias", "q_norm", "k_norm", "rope_cos", "rope_sin", "params", "fparams", "kc", "vc"),
    ("q",), QKV_BODY)
ATTEND_SOURCE = KernelSource("strata_attend", ("q", "kc", "vc", "wo", "params"), ("out",), ATTEND_BODY)


def qkv_rope(x: mx.array, norm_w: mx.array, wqkv: mx.array, bias: mx.array | None, q_norm: mx.array | None,
             k_norm: mx.array | None, rope_cos: mx.array, rope_sin: mx.array, kc: mx.array, vc: mx.array,
             pos0: int, eps: float, n_heads: int) -> mx.array:
    """Kernel path. x [T, D] -> q [T, H, HD]; writes k, v of positions pos0.. into kc / vc."""
    t, d = x.shape
    kvh, s_max, hd = kc.shape
    if d % 8 or hd % 8 or hd > THREADS:
        raise ValueError(f"qkv kernel: hidden {d} and head_dim {hd} must be multiples of 8, head_dim <= {THREADS}")
    half = absent(np.float16)  # absent optional inputs
    return launch(QKV_SOURCE, [as_f32(x), norm_w, wqkv, bias if bias is not None else half,
                               q_norm if q_norm is not None else half, k_norm if k_norm is not None else half,
                               rope_cos, rope_sin, index_param(pos0), float_params(eps), kc, vc],
                  [(t, n_heads, hd)], [mx.float32], blocks=(n_heads + 2 * kvh, t, 1), threads=THREADS,
                  template=(("D", d), ("H", n_heads), ("KVH", kvh), ("HD", hd), ("S_MAX", s_max),
                            ("QKN", int(q_norm is not None)), ("BIAS", int(bias is not None)), ("NT", THREADS)))[0]


def attend(q: mx.array, kc: mx.array, vc: mx.array, wo: mx.array, pos0: int) -> mx.array:
    """Kernel path. q [T, H, HD] over the cache -> output-projection partials [T, H, D]."""
    t, h, hd = q.shape
    kvh, s_max, _ = kc.shape
    d = wo.shape[0]
    return launch(ATTEND_SOURCE, [q, kc, vc, wo, index_param(pos0)], [(t, h, d)], [mx.float32],
                  blocks=(h, t, 1), threads=THREADS,
                  template=(("D", d), ("H", h), ("KVH", kvh), ("HD", hd), ("S_MAX", s_max), ("NT", THREADS)))[0]
