"""The body of the native fused expert kernel (kernels/moe_native.py has the why, the limits and
the entries): the per-type decoders, the routed block's work around moe.py's preambles and
shared-expert branch, and the two KernelSources (host slots, routing on the device).

Template ints it reads (moe_native._template): D, F, FC, NCH, K, SLOT, XW, QK (0 affine, 1
MXFP4), BITS, G, SBF (bfloat16 scales), the plane offsets GC/GS/GZ, UC/US/UZ, DC/DS/DZ, EB and
GB/UB/DB_OFF (expert biases), ACT, NT, DN, HX, VL, DWORDS, ULS; with the shared expert's (moe.py).

Shapes:
    arena uint8 [S, SLOT], x float32 [T, D], act float32 [8] (alpha, limit) -> out float32 [T, K*NCH, D]
"""

from __future__ import annotations

from strata.mlx_backend.kernels import moe
from strata.mlx_backend.kernels.source import KernelSource

HELPERS = r"""
#define NQ_TWO64 18446744073709551616.0f
#define NQ_TWO62 4611686018427387904.0f
// affine codes: the first 23 / b of a word's codes are below bit 23 and are masked in place in w
// (lo); the rest in w >> (b * (23 / b)) (hi). aq_shift: code j's bit position in its word.
INLINE int aq_nlo(int b) { return 23 / b; }
INLINE int aq_shift(int b, int j) { return b * (j < aq_nlo(b) ? j : j - aq_nlo(b)); }
INLINE uint32_t aq_mask(int b, int j) { return ((1u << b) - 1u) << aq_shift(b, j); }
// DN = 1: the code masked in place is the subnormal q 2^(s-149)
INLINE float aq_dn(uint32_t w, int b, int j) { return bits_f32(w & aq_mask(b, j)); }
// DN = 0: lo / hi under 1.0f's exponent, once per word; (1 + q 2^(s-23)) - 1 = q 2^(s-23) exactly
INLINE uint32_t aq_lo(uint32_t w, int b) { return opaque((w & ((1u << (b * aq_nlo(b))) - 1u)) | 0x3F800000u); }
INLINE uint32_t aq_hi(uint32_t w, int b) { return opaque((w >> (b * aq_nlo(b))) | 0x3F800000u); }
INLINE float aq_code(uint32_t lo, uint32_t hi, int b, int j) {
  return bits_f32((j < aq_nlo(b) ? lo : hi) & (0xFF800000u | aq_mask(b, j))) - 1.0f;
}
// MXFP4 code j of a word (nibble j, low nibble first). DN = 1: magnitude bits at 22-24, the sign
// at 31: e2m1 * 2^-126 (subnormal for |v| <= 0.5). DN = 0: the exponent rebased by 126 for the
// normal codes (m >= 2), 0 or 0.5 written out: e2m1 exactly, normal floats only.
INLINE float fp4_dn(uint32_t w, int j) {
  const uint32_t n = w >> (4 * j);
  return bits_f32(((n & 7u) << 22) | ((n & 8u) << 28));
}
INLINE float fp4_value(uint32_t w, int j) {
  const uint32_t n = w >> (4 * j), m = n & 7u;
  const uint32_t mag = m >= 2u ? (m << 22) + (126u << 23) : ((0u - m) & 0x3F000000u);
  return bits_f32(mag | ((n & 8u) << 28));
}
// what code j's product partner (x or h) is multiplied by, exactly (a power of two)
INLINE float nq_prescale(int qk, int dn, int b, int j) {
  if (qk == 1) return dn ? NQ_TWO64 : 1.0f;
  return bits_f32((uint32_t)(127 + (dn ? 85 : 23) - aq_shift(b, j)) << 23);
}
// a 16-bit scale or bias (float16, or bfloat16's raw bits) and an e8m0 scale byte, as float32
// (bfloat16 from the aligned uint32 word holding it: the bodies use no 16-bit integer type)
INLINE float nq_s16(const DEVICE uint8_t* p, uint64_t i, int bf) {
  if (!bf) return F32(((const DEVICE half_t*)p)[i]);
  const uint32_t w = ((const DEVICE uint32_t*)p)[i >> 1];
  return bits_f32((i & 1u) ? (w & 0xFFFF0000u) : (w << 16));
}
INLINE float nq_e8m0(const DEVICE uint8_t* p, uint64_t i) {
  const uint32_t e = p[i];
  return e ? bits_f32(e << 23) : bits_f32(0x00400000u);  // e = 0: 2^-127, a subnormal
}
// Σ over one word of code x partner (already pre-scaled), as Σ value * partner: the decoder by type
INLINE float nq_unscale(int qk, int dn, float s) { return dn ? fma_keep(s, qk == 1 ? NQ_TWO62 : NQ_TWO64, 0.0f) : s; }
INLINE float nq_act(int act, float g, float u, float alpha, float limit) {
  if (act == 0) return g / (1.0f + exp_f(-g)) * u;
  const float gc = g < limit ? g : limit;
  const float uc = u < -limit ? -limit : (u > limit ? limit : u);
  return (uc + 1.0f) * (gc / (1.0f + exp_f(-gc * alpha)));  // gpt-oss's clamped SwiGLU
}
"""

# One word's dot product: code j of the word $W times its partner $P(j) (x or h, pre-scaled), as
# sum value * partner in $OUT (the decoder by type).
WORD_DOT = r"""
          float $OUT = 0.0f;
          if (QK == 0 && DN) {
            const uint32_t wh = $W >> (BITS * NLO);
            UNROLL for (int j = 0; j < CPW; ++j) $OUT = fma_keep(aq_dn(j < NLO ? $W : wh, BITS, j), $P(j), $OUT);
          } else if (QK == 0) {
            const uint32_t lo = aq_lo($W, BITS), hi = aq_hi($W, BITS);
            UNROLL for (int j = 0; j < CPW; ++j) $OUT += aq_code(lo, hi, BITS, j) * $P(j);
          } else if (DN) {
            UNROLL for (int j = 0; j < CPW; ++j) $OUT = fma_keep(fp4_dn($W, j), $P(j), $OUT);
          } else {
            UNROLL for (int j = 0; j < CPW; ++j) $OUT += fp4_value($W, j) * $P(j);
          }
          $OUT = nq_unscale(QK, DN, $OUT);
"""


def _dot(word: str, partner: str, out: str) -> str:
    """WORD_DOT for one word expression, partner expression (@ standing for j) and result name."""
    return WORD_DOT.replace("$P(j)", partner.replace("@", "j")).replace("$OUT", out).replace("$W", word)


COMMON = r"""
  constexpr int NW = NT / 32;
  constexpr int NLO = 23 / BITS;
  constexpr int WPR = D / CPW;                // uint32 words per gate/up row
  constexpr int WPL = (WPR + 31) / 32;        // words per lane
  constexpr int RPW = (FC + NW - 1) / NW;     // gate/up rows per warp
  constexpr int WC = FC / CPW;                // words of one down row in this chunk
  constexpr int DPT = (D + NT - 1) / NT;      // down rows per thread
  constexpr int DB = DWORDS / WC > 0 ? (DWORDS / WC < DPT ? DWORDS / WC : DPT) : 1;  // down rows in flight
  constexpr int NGC = FC >= G ? FC / G : 1;   // scale groups in a down row's chunk (FC and G: powers of 2)
  constexpr int WPG = WC / NGC;               // words per group in the chunk
  constexpr int RB = D * BITS / 8;            // bytes of a gate/up row's codes
  constexpr int DRB = F * BITS / 8;           // bytes of a down row's codes
  const uint32_t c = rb % NCH;                // chunk of FC hidden units
  const bool live = slot >= 0;
  const DEVICE uint8_t* rec = arena + (uint64_t)(live ? slot : 0) * (uint64_t)SLOT;  // 64-bit: arenas pass 4 GB
  for (uint32_t w = tid; w < (uint32_t)WPR; w += NT) {  // x pre-scaled per code, and each word's sum
    float s = 0.0f;
    UNROLL for (int j = 0; j < CPW; j += 4) {
      const f4 v = load_f4(x + (uint64_t)t * D + CPW * w + j);
      UNROLL for (int q = 0; q < 4; ++q) {
        xsh[XW * w + j + q] = v.v[q] * nq_prescale(QK, DN, BITS, j + q);
        s += v.v[q];
      }
    }
    xsum[w] = s;
  }
  BARRIER();
  float ga[RPW], ua[RPW];
  UNROLL for (int rr = 0; rr < RPW; ++rr) { ga[rr] = 0.0f; ua[rr] = 0.0f; }
  // ULS: the lane steps unrolled or a loop. The loop is the default (moe_native.py): by ncu's GPU
  // time on the H200 it beat the unrolled body for 4-bit affine (FC = 64) and MXFP4 (FC = 32)
  if (ULS) {
    UNROLL for (int i = 0; i < WPL; ++i) {
LANE_STEP
    }
  } else {
    for (int i = 0; i < WPL; ++i) {
LANE_STEP
    }
  }
  const float alpha = act[0], limit = act[1];
  UNROLL for (int rr = 0; rr < RPW; ++rr) {
    const int r = (int)warp_id + NW * rr;  // warp-uniform
    if (r < FC) {
      float g = warp_sum(ga[rr]), u = warp_sum(ua[rr]);
      if (lane == 0) {
        if (EB && live) {  // the expert's gate and up biases (gpt-oss)
          g += ((const DEVICE float*)(rec + GB))[c * FC + r];
          u += ((const DEVICE float*)(rec + UB))[c * FC + r];
        }
        hs[r] = nq_act(ACT, g, u, alpha, limit);
      }
    }
  }
  BARRIER();
  if (tid < (uint32_t)WC) {
    float s = 0.0f;
    for (int j = 0; j < CPW; ++j) s += hs[CPW * tid + j];
    hsum[tid] = s;
  }
  for (uint32_t f = tid; f < (uint32_t)FC; f += NT) hxs[f] = hs[f] * nq_prescale(QK, DN, BITS, (int)(f % CPW));
  BARRIER();
  // down: thread d takes rows d, d + NT, ...; DB rows' loads in flight, then their arithmetic
  float hx[FC];
  if (!HX) { UNROLL for (int f = 0; f < FC; ++f) hx[f] = hxs[f]; }
  DEVICE float* dst = out + ((uint64_t)t * (K * NCH) + rb) * D;
  for (int i0 = 0; i0 < DPT; i0 += DB) {
    uint32_t dq[DB][WC];
    float dsc[DB][NGC], dz[DB][NGC];
    UNROLL for (int b = 0; b < DB; ++b) {
      const uint32_t d = tid + NT * (uint32_t)(i0 + b);
      UNROLL for (int w = 0; w < WC; ++w) dq[b][w] = 0u;
      UNROLL for (int n = 0; n < NGC; ++n) { dsc[b][n] = 0.0f; dz[b][n] = 0.0f; }
      if (live && i0 + b < DPT && d < (uint32_t)D) {
        const DEVICE uint32_t* q = (const DEVICE uint32_t*)(rec + DC + (uint64_t)d * DRB) + c * WC;
        if (VL && WC % 4 == 0 && DRB % 16 == 0) {  // 16-byte loads (rows and chunks 16-byte aligned)
          UNROLL for (int w = 0; w < WC; w += 4) {
            const uint4 v = *(const DEVICE uint4*)(q + w);
            dq[b][w] = v.x; dq[b][w + 1] = v.y; dq[b][w + 2] = v.z; dq[b][w + 3] = v.w;
          }
        } else if (VL && WC % 2 == 0 && DRB % 8 == 0) {
          UNROLL for (int w = 0; w < WC; w += 2) {
            const uint2 v = *(const DEVICE uint2*)(q + w);
            dq[b][w] = v.x; dq[b][w + 1] = v.y;
          }
        } else {
          UNROLL for (int w = 0; w < WC; ++w) dq[b][w] = q[w];
        }
        UNROLL for (int n = 0; n < NGC; ++n) {
          const uint64_t si = (uint64_t)d * (F / G) + (uint64_t)(c * FC) / G + n;
          if (QK == 0) { dsc[b][n] = nq_s16(rec + DS, si, SBF); dz[b][n] = nq_s16(rec + DZ, si, SBF); }
          else dsc[b][n] = nq_e8m0(rec + DS, si);
        }
      }
    }
    UNROLL for (int b = 0; b < DB; ++b) {
      const uint32_t d = tid + NT * (uint32_t)(i0 + b);
      if (i0 + b < DPT && d < (uint32_t)D) {
        float acc = 0.0f;
        if (live) {
          UNROLL for (int w = 0; w < WC; ++w) {
DOWN_DOT
            acc += dsc[b][w / WPG] * ddot + dz[b][w / WPG] * hsum[w];
          }
          if (EB && c == 0) acc += ((const DEVICE float*)(rec + DB_OFF))[d];  // the down bias, once per expert
        }
        dst[d] = wt * acc;
      }
    }
  }
"""
LANE_STEP = r"""
    const int w = (int)lane + 32 * i;
    const bool wl = w < WPR;  // lane-dependent only where WPR is not a multiple of 32
    const uint32_t grp = (uint32_t)(w * CPW / G);  // the word's scale group in its row
    uint32_t gw[RPW], uw[RPW];
    float gs[RPW], us[RPW], gz[RPW], uz[RPW];
    UNROLL for (int rr = 0; rr < RPW; ++rr) {  // every load of the step before any use
      const int r = (int)warp_id + NW * rr;
      gw[rr] = 0u; uw[rr] = 0u; gs[rr] = 0.0f; us[rr] = 0.0f; gz[rr] = 0.0f; uz[rr] = 0.0f;
      if (wl && live && r < FC) {
        const uint64_t f = (uint64_t)c * FC + r;
        const uint64_t si = f * (D / G) + grp;
        gw[rr] = ((const DEVICE uint32_t*)(rec + GC + f * RB))[w];
        uw[rr] = ((const DEVICE uint32_t*)(rec + UC + f * RB))[w];
        if (QK == 0) {
          gs[rr] = nq_s16(rec + GS, si, SBF); us[rr] = nq_s16(rec + US, si, SBF);
          gz[rr] = nq_s16(rec + GZ, si, SBF); uz[rr] = nq_s16(rec + UZ, si, SBF);
        } else {
          gs[rr] = nq_e8m0(rec + GS, si); us[rr] = nq_e8m0(rec + US, si);
        }
      }
    }
    warp_sync();
    if (wl) {
      float xv[CPW];
      UNROLL for (int j = 0; j < CPW; ++j) xv[j] = xsh[XW * w + j];
      const float xs = xsum[w];
      UNROLL for (int rr = 0; rr < RPW; ++rr) {
        if (live && (int)warp_id + NW * rr < FC) {
GATE_DOT
UP_DOT
          ga[rr] += gs[rr] * gdot + gz[rr] * xs;  // gz, uz: 0 for MXFP4 (no biases)
          ua[rr] += us[rr] * udot + uz[rr] * xs;
        }
      }
    }
"""
COMMON = COMMON.replace("LANE_STEP\n", LANE_STEP)
COMMON = (COMMON.replace("GATE_DOT\n", _dot("gw[rr]", "xv[@]", "gdot"))
          .replace("UP_DOT\n", _dot("uw[rr]", "xv[@]", "udot"))
          .replace("DOWN_DOT\n", _dot("dq[b][w]", "(HX ? hxs[CPW * w + @] : hx[CPW * w + @])", "ddot")))

DECLS = r"""
  constexpr int CPW = 32 / BITS;              // codes per uint32 word
  SHARED float hs[HSN];
  SHARED float hsum[FC / CPW];
  SHARED float hxs[FC];
  SHARED float xsh[(D / CPW) * XW];  // routed blocks: x pre-scaled per code; shared blocks: x
  SHARED float xsum[D / CPW];
"""
BRANCH = moe.BRANCH.replace(moe.COMMON, COMMON)
assert BRANCH != moe.BRANCH
SLOTS_SOURCE = KernelSource("strata_moe_native_slots", ("arena", "x", "slots", "weights", "act") + moe.INPUTS_SHARED,
                            ("out", "sout"), moe.SLOTS_PREAMBLE + DECLS + BRANCH, HELPERS)
ROUTE_SOURCE = KernelSource("strata_moe_native_route", ("arena", "x", "z", "slot_base", "act") + moe.INPUTS_SHARED,
                            ("out", "sout"), moe.ROUTE_PREAMBLE + DECLS + BRANCH, HELPERS)
