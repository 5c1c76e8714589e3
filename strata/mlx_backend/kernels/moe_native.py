"""The fused routed-expert kernel for MLX's own record types: the affine 4- and 8-bit types (group
32 or 64, float16 or bfloat16 scales and biases; strata/formats/mlx_affine.py) and MXFP4
(strata/formats/mxfp4.py), read straight out of the arena by slot index, with gpt-oss's expert
biases and clamped SwiGLU (`ExpertAct`) where the records and the model have them.

The work split is the Q2_0 kernel's (kernels/moe.py: read its docstring): block (rank i, chunk c,
token t) computes FC hidden units of one selected expert and its share of the down projection, a
partial [D] output; the combine kernel sums the partials in a fixed order. Its preambles (host
slots, routing on the device) and the shared expert's blocks are moe.py's, unchanged; the Q2_0
body stays its own (its code forms are tuned to 2-bit words, and this file leaves it bit for bit
as it was).

Per code type, one decoder (template ints QK, BITS, DN), each product exact:
- affine, q unsigned: a uint32 word holds CPW = 32 / BITS codes; those below bit 23 (NLO of
  them) are masked in place, the rest in w >> (BITS * NLO). DN = 1 (CUDA, the emulator): the
  masked code with no exponent bits is the subnormal q 2^(s-149), x pre-scaled by 2^(85-s), so
  a product is q x 2^-64 and the word's sum times 2^64 is Σ q x (an AND and an FMA per code).
  DN = 0 (Metal, which may flush subnormals): the code under 1.0f's exponent, minus 1, is
  q 2^(s-23), x pre-scaled by 2^(23-s). Per word: scale * Σ q x + bias * Σ x (a word lies in
  one group: CPW divides the group).
- MXFP4, sign-magnitude e2m1 nibbles: DN = 1: the nibble's magnitude at bits 22-24 and its sign
  at bit 31 is the float e2m1 * 2^-126 (e2m1 is a float with 2 exponent bits, bias 1: subnormal
  below 1), x pre-scaled by 2^64, the word's sum times 2^62 (a shift, two ANDs, an OR and an
  FMA per code); DN = 0: the same bits with the exponent rebased, normal floats only. Per word:
  2^(e-127) * Σ e2m1 x.

Reads: a warp per gate/up row, each lane a uint32 word at lane + 32 i (128 contiguous bytes per
row and step), its group's scale (and bias) beside it; down: a thread per output row, its chunk's
FC * BITS / 8 bytes in 8- or 16-byte loads, at most DWORDS words per thread in flight (an 8-bit
row chunk is 32 bytes: holding all of a thread's rows at once would take 96 registers at D = 2880).

Shapes:
    arena uint8 [S, SLOT], x float32 [T, D] -> partials float32 [T, k*NCH, D]
"""

from __future__ import annotations

import functools

import mlx.core as mx
import numpy as np

from strata.errors import ConfigError
from strata.formats.expert_record import RecordLayout
from strata.formats.mlx_affine import AFFINE_SPECS
from strata.formats.mxfp4 import BLOCK as MXFP4_BLOCK
from strata.formats.quant_types import QuantType
from strata.mlx_backend.kernels import moe
from strata.mlx_backend.kernels.launch import as_f32, float_params, index_param, launch
from strata.mlx_backend.kernels.source import KernelSource
from strata.model_config import ExpertKind, RoutingOrder
from strata.reference.experts import SWIGLU, ExpertAct

TYPES = frozenset(AFFINE_SPECS) | {QuantType.MXFP4}
DWORDS = 16  # down-step code words a thread holds in flight (64 bytes; 32 took 159 registers, sm_90)
SHARED_BYTES = 40 << 10  # x pre-scaled + its word sums in threadgroup memory: Q2_0's bound (moe.MAX_HIDDEN)


def _bits(qtype: QuantType) -> int:
    return 4 if qtype is QuantType.MXFP4 else AFFINE_SPECS[qtype].bits


def _group(qtype: QuantType) -> int:
    return MXFP4_BLOCK if qtype is QuantType.MXFP4 else AFFINE_SPECS[qtype].group


def _x_bytes(hidden: int, cpw: int, stride: int) -> int:
    return 4 * (hidden // cpw) * (stride + 1)  # x pre-scaled per code, and each word's sum


def x_stride(qtype: QuantType, hidden: int) -> int:
    """XW, floats per x word in threadgroup memory: CPW values, padded by 4 where a word is 8 or
    more codes (16-byte reads of 8 lanes then meet 8 different bank quads) and the padding fits
    (4-bit at hidden 7168 does not: dense rows, 2-way bank conflicts); 4 codes are 16 bytes, dense."""
    cpw = 32 // _bits(qtype)
    padded = cpw + 4 if cpw >= 8 else cpw
    return padded if _x_bytes(hidden, cpw, padded) <= SHARED_BYTES else cpw


def x_shared_bytes(qtype: QuantType, hidden: int) -> int:
    """Threadgroup bytes of x pre-scaled per code and its per-word sums."""
    return _x_bytes(hidden, 32 // _bits(qtype), x_stride(qtype, hidden))


def supports(rec: RecordLayout) -> str | None:
    """Why the kernel cannot run these records (None: it can)."""
    if rec.qtype not in TYPES:
        return f"{rec.qtype.name} is not an MLX type"
    if rec.expert_ffn % 32:
        return f"expert_ffn {rec.expert_ffn} is not a multiple of 32 (FC)"
    if (n := x_shared_bytes(rec.qtype, rec.hidden)) > SHARED_BYTES:
        return f"hidden {rec.hidden} needs {n} bytes of threadgroup memory (at most {SHARED_BYTES})"
    return None


# Block shapes. Decode: moe.py's (FC = 32, 256 threads, h in registers). Many tokens: FC = 64 as
# moe.py (half the down planes' L2 sectors per byte) but 256 threads, not 512: MLX's custom
# kernels cannot bound registers (__launch_bounds__), and 512 threads allow 128 a thread, which
# the 8-bit body passes (ptxas, sm_90).
MANY_TOKENS_SHAPE = moe.BlockShape(64, 256, True)


def block_shape(rec: RecordLayout, tokens: int) -> moe.BlockShape:
    if tokens >= moe.MANY_TOKENS and rec.expert_ffn % MANY_TOKENS_SHAPE.fc == 0:
        return MANY_TOKENS_SHAPE
    return moe.BlockShape(32, moe.THREADS, moe.HX_SHARED)


def _shape(rec: RecordLayout, tokens: int, fc: int | None, threads: int | None, hx: bool | None) -> moe.BlockShape:
    """`block_shape` with what the caller chose put in (an FC of its own gets 256 threads, h in registers)."""
    shape = block_shape(rec, tokens)
    if fc is not None and fc != shape.fc:
        shape = moe.BlockShape(fc, moe.THREADS, moe.HX_SHARED)
    return moe.BlockShape(shape.fc, threads or shape.threads, shape.hx_shared if hx is None else hx)


# Unroll the gate/up lane steps (ULS) where the unrolled body stays small: an estimate of its
# instructions, steps x rows per warp x (codes x decode cost + ~10 per word). H200 (wall time, D =
# F = 2880): 4-bit affine FC = 64 (est. 2496, 175 KB of code) 57% of copy unrolled; MXFP4 FC = 32
# (2400) 43%, MXFP4 FC = 64 (4800, 215 KB) 22%: past this budget the steps are a loop.
UNROLL_BUDGET = 3000
DECODE_COST = {0: 2, 1: 5}  # instructions per code: affine (AND, FMA), MXFP4 (shift, 2 AND, OR, FMA)


def unroll_steps(rec: RecordLayout, fc: int, threads: int) -> bool:
    cpw = 32 // _bits(rec.qtype)
    steps = -(-(rec.hidden // cpw) // 32)
    rows = -(-fc // (threads // 32))
    cost = DECODE_COST[int(rec.qtype is QuantType.MXFP4)]
    return steps * rows * (cpw * cost + 10) <= UNROLL_BUDGET


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
  // ULS: the lane steps unrolled or a loop. Unrolled (12 steps at D = 2880, 4-bit), FC = 64's
  // body was 215 KB of sm_90 code for MXFP4 and ran at 22% of copy, FC = 32's (121 KB) at 43%;
  // 4-bit affine's 175 KB at 57% (H200, wall time): `unroll_steps` chooses
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


@functools.cache
def _template(rec: RecordLayout, k: int, fc: int, threads: int, denormals: bool, hx_shared: bool,
              vector_loads: bool, act_kind: int, unroll: bool) -> tuple[tuple[str, int], ...]:
    if (why := supports(rec)) is not None or rec.expert_ffn % fc:
        raise ValueError(f"fused native experts: {why or f'F={rec.expert_ffn} is not a multiple of FC={fc}'}")
    q = rec.qtype
    off = {n: rec.codes(n).offset for n in ("gate", "up", "down")}
    sc = {n: rec.scales(n) for n in ("gate", "up", "down")}
    zp = {n: s.offset + s.nbytes // 2 for n, s in sc.items()}  # affine: the biases follow the scales
    assert all(v % 4 == 0 for v in zp.values())  # nq_s16 reads bfloat16 from aligned uint32 words (rows even)
    bias = {n: rec.bias(n).offset if rec.biases else 0 for n in ("gate", "up", "down")}
    return (("D", rec.hidden), ("F", rec.expert_ffn), ("FC", fc), ("NCH", rec.expert_ffn // fc), ("K", k),
            ("SLOT", rec.padded_bytes), ("XW", x_stride(q, rec.hidden)), ("QK", int(q is QuantType.MXFP4)), ("BITS", _bits(q)), ("G", _group(q)),
            ("SBF", int(q in AFFINE_SPECS and AFFINE_SPECS[q].bfloat16)),
            ("GC", off["gate"]), ("GS", sc["gate"].offset), ("GZ", zp["gate"]),
            ("UC", off["up"]), ("US", sc["up"].offset), ("UZ", zp["up"]),
            ("DC", off["down"]), ("DS", sc["down"].offset), ("DZ", zp["down"]),
            ("EB", int(rec.biases)), ("GB", bias["gate"]), ("UB", bias["up"]), ("DB_OFF", bias["down"]),
            ("ACT", act_kind), ("NT", threads), ("DN", int(denormals)), ("HX", int(hx_shared)),
            ("VL", int(vector_loads)), ("DWORDS", DWORDS), ("ULS", int(unroll)))


ACT_KINDS = {ExpertKind.SWIGLU: 0, ExpertKind.CLAMPED_SWIGLU: 1}  # ACT: the activations the body computes


def _act(act: ExpertAct) -> tuple[int, mx.array]:
    """(ACT, the act input: alpha and limit as a device constant)."""
    if act.kind not in ACT_KINDS:
        raise ConfigError(f"fused native experts: expert_kind {act.kind.value} has no kernel form")
    if act.kind is ExpertKind.SWIGLU:
        return 0, float_params(0.0, 0.0)
    return 1, float_params(float(act.alpha), float(act.limit))


def moe_slots(arena: mx.array, rec: RecordLayout, x: mx.array, slots, weights, *, act: ExpertAct = SWIGLU,
              fc: int | None = None, shared=None, threads: int | None = None, denormals: bool | None = None,
              hx_shared: bool | None = None, vector_loads: bool = moe.VECTOR_LOADS, unroll: bool | None = None):
    """Kernel path, host-chosen slots (moe.moe_slots for MLX's types). x [T, D], slots int [T, k]
    (-1 skip), weights [T, k] -> partials float32 [T, k * F/FC, D]; with shared (gate, up, down
    float16), (routed partials, shared partials [T, Fs/FCS, D]) from one launch. unroll: the gate/up
    lane steps unrolled (default `unroll_steps`)."""
    t, k = slots.shape
    if isinstance(slots, np.ndarray):
        slots, weights = np.asarray(slots, np.int32), np.asarray(weights, np.float32)
    else:
        slots = slots if slots.dtype == mx.int32 else slots.astype(mx.int32)
        weights = as_f32(weights)
    fc, threads, hx_shared = _shape(rec, t, fc, threads, hx_shared)
    kind, act_in = _act(act)
    dn = moe.subnormal_codes() if denormals is None else denormals
    unroll = unroll_steps(rec, fc, threads) if unroll is None else unroll
    template = _template(rec, k, fc, threads, dn, hx_shared, vector_loads, kind, unroll)
    out, sout = moe._launch(SLOTS_SOURCE, rec, [arena, as_f32(x), slots, weights, act_in], t, k, fc, template,
                            shared, threads)
    return out if shared is None else (out, sout)


def moe_route(arena: mx.array, rec: RecordLayout, x: mx.array, z: mx.array, slot_base: int, k: int,
              order: RoutingOrder, norm_topk_prob: bool, *, act: ExpertAct = SWIGLU, fc: int | None = None,
              shared=None):
    """Kernel path, routing on the GPU (moe.moe_route for MLX's types; every expert resident at
    slot_base + e). x [T, D], z [T, E] -> partials float32 [T, k * F/FC, D] (with shared: a pair)."""
    if order not in (RoutingOrder.SOFTMAX_TOPK, RoutingOrder.TOPK_SOFTMAX):
        raise ConfigError(f"moe_route: the routing kernel has no rule {order.value} (route with routing.select_device)")
    t, e = z.shape
    fc, threads, hx = _shape(rec, t, fc, None, None)
    kind, act_in = _act(act)
    routing = (("E", e), ("ORDER", 0 if order is RoutingOrder.SOFTMAX_TOPK else 1), ("NORM", int(norm_topk_prob)))
    template = _template(rec, k, fc, threads, moe.subnormal_codes(), hx, moe.VECTOR_LOADS, kind,
                         unroll_steps(rec, fc, threads)) + routing
    out, sout = moe._launch(ROUTE_SOURCE, rec, [arena, as_f32(x), as_f32(z), index_param(slot_base), act_in], t, k,
                            fc, template, shared, threads)
    return out if shared is None else (out, sout)
