"""The fused routed-expert kernel: gate and up GEMVs over the k selected slots, SwiGLU, down
GEMV and the routing weight, reading Q2_0 planes straight out of the arena by slot index.

Work split (no grid-wide sync, so one launch): block (bx, t) takes selected rank i = bx / NCH and
chunk c = bx % NCH of the expert's F hidden units (FC rows of gate and up). It computes
h_f = silu(gate_f . x) * (up_f . x) for its FC rows, then its share of the down projection,
w_i * down[:, chunk] . h[chunk], a partial [D] output. The partials ([T, k*NCH, D]) are summed
by the combine kernel in a fixed order (deterministic; no atomics).

Reads: gate/up rows are read by one warp each, a lane taking uint32 words (16 codes = half a
Q2_0 block) at lane + 32 i, so a warp reads 128 contiguous bytes per row and step, and the lane's
16 x values of word i serve all the warp's rows in that step. Down: a thread per output row reads its
chunk's FC/16 words in one 8- or 16-byte load (VL). The block shape (FC, threads, where h lives)
comes from the tokens per launch: `block_shape`.
Per 16-code word: d * (sum q_j x_j - 2 sum x_j) = sum d (q_j - 2) x_j.
Plane offsets and sizes come from strata.formats.expert_record.RecordLayout (template ints).

Instruction budget (what bounds it on the H200, measured with ncu): a code costs an AND, a
subtract and an FMA (`q2_code`: no int-to-float conversion, whose 16/clock/SM rate bounded the
first version at 31% of copy bandwidth), and each thread issues a step's loads (the RPW rows of
one word, gate/up; all its down rows) before the arithmetic. The word loop is outside the row
loop, so a lane holds 16 x values rather than all of its row's: 73 registers per thread instead
of 128, 3 blocks per SM instead of 2 (sm_90, FC = 32; ptxas -v). The results are bit for bit
those of the straightforward form (products of exactly scaled values, sums in the same order).

Two entries share the body:
- `moe_slots`: slots [T, k] int32 (-1: skip) and weights [T, k] from the host (streaming);
- `moe_route`: logits z [T, E]; each block ranks the E logits itself (rank = count of larger, ties
  to the lower id: the reference's order), takes the top k and the model rule's weights, and
  reads slot `slot_base + expert` (all experts resident, no host round trip).

Shapes:
    arena uint8 [S, SLOT], x float32 [T, D] -> partials float32 [T, k*NCH, D]
"""

from __future__ import annotations

import functools
from typing import NamedTuple

import mlx.core as mx
import numpy as np

from strata.formats.expert_record import RecordLayout
from strata.formats.quant_types import QuantType, layout
from strata.mlx_backend.kernels import shared as shared_kernel
from strata.mlx_backend.kernels.launch import absent, as_f32, gpu_dialect, index_const, launch
from strata.mlx_backend.kernels.preludes import WARP, Dialect
from strata.mlx_backend.kernels.source import KernelSource
from strata.errors import ConfigError
from strata.model_config import RoutingOrder

Q2 = layout(QuantType.Q2_0)
THREADS = 256
MAX_HIDDEN = 8192  # x pre-scaled in threadgroup memory: 1.25 D floats (40 KB at 8192) of the 48 KB
WORD_CODES = 32 // Q2.bits  # 16 codes per uint32 word

SLOTS_PREAMBLE = r"""
  const uint32_t t = by;
  const uint32_t rb = bx >= (uint32_t)NSB ? bx - NSB : 0u;  // routed block (shared blocks come first)
  const uint32_t rank = rb / NCH;
  const int32_t slot = slots[t * K + rank];
  const float wt = weights[t * K + rank];
"""

# Rank by z descending, ties to the lower id: each thread counts the logits ahead of its own. The
# count takes 8 logits a step, their threadgroup loads issued together: one at a time, each step
# waited ~30 cycles on its load (E = 256: ~4 us of a block's latency, the same in every block).
RANK_LOOP = r"""
  for (uint32_t e = tid; e < (uint32_t)E; e += NT) {  // rank by z descending, ties to the lower id
    const float ze = zs[e];
    int32_t r = 0;
    int32_t j = 0;
    for (; j + 8 <= E; j += 8) {
      float zz[8];
      UNROLL for (int q = 0; q < 8; ++q) zz[q] = zs[j + q];
      UNROLL for (int q = 0; q < 8; ++q) r += (zz[q] > ze || (zz[q] == ze && j + q < (int32_t)e)) ? 1 : 0;
    }
    for (; j < E; ++j) {
      const float zj = zs[j];
      r += (zj > ze || (zj == ze && j < (int32_t)e)) ? 1 : 0;
    }
    if (r < K) top[r] = (int32_t)e;
  }
"""

ROUTE_PREAMBLE = r"""
  constexpr int NWR = NT / 32;
  const uint32_t t = by;
  const uint32_t rb = bx >= (uint32_t)NSB ? bx - NSB : 0u;  // routed block (shared blocks come first)
  const uint32_t rank = rb / NCH;
  SHARED float zs[E];
  SHARED int32_t top[K];
  SHARED float topw[K];
  SHARED float red[NWR];
  for (uint32_t e = tid; e < (uint32_t)E; e += NT) zs[e] = z[(uint64_t)t * E + e];
  BARRIER();
""" + RANK_LOOP.lstrip("\n") + r"""  BARRIER();
  const float zmax = zs[top[0]];
  float part = 0.0f;
  if (ORDER == 0) {
    for (uint32_t e = tid; e < (uint32_t)E; e += NT) part += exp_f(zs[e] - zmax);
  } else {
    for (uint32_t e = tid; e < (uint32_t)K; e += NT) part += exp_f(zs[top[e]] - zmax);
  }
  part = warp_sum(part);
  if (lane == 0) red[warp_id] = part;
  BARRIER();
  if (tid == 0) {
    float total = 0.0f;
    for (int w = 0; w < NWR; ++w) total += red[w];
    float kept = 0.0f;
    for (int i = 0; i < K; ++i) { topw[i] = exp_f(zs[top[i]] - zmax) / total; kept += topw[i]; }
    if (ORDER == 0 && NORM) for (int i = 0; i < K; ++i) topw[i] = topw[i] / kept;
  }
  BARRIER();
  const int32_t slot = slot_base[0] + top[rank];
  const float wt = topw[rank];
"""

HELPERS = r"""
// A Q2_0 code as a float without an int-to-float conversion: I2F issues at 16 per clock per SM on
// the H200 (sm_90), a quarter of the rate of the bit operations used instead, and the first
// version of this kernel, one I2F per code, was bound by it (64 tokens x k=10: 491K codes per
// block -> 15.5 us of I2F per block; 844 us measured per launch). Per word, once: lo holds codes
// 0..10 (bits 0..21 of w) and hi codes 11..15 (w >> 22), each under the exponent of 1.0f. Per
// code j, one AND leaves 1.0f's exponent and the code: (1 + q 2^(s-23)) - 1 = q 2^(s-23) exactly,
// s = 2j (j <= 10) or 2(j-11) (j >= 11). What it multiplies (x or h) is pre-scaled by
// q2_scale(j) = 2^(23-s), exactly, so each product is q * x bit for bit. (A code costs an AND, a
// subtract and an FMA; as first written, an AND and an OR per code, two LOP3.)
// (`opaque`: else the compiler folds the per-word OR back into every code, two LOP3 per code.)
INLINE uint32_t q2_lo(uint32_t w) { return opaque((w & 0x003FFFFFu) | 0x3F800000u); }
INLINE uint32_t q2_hi(uint32_t w) { return opaque((w >> 22) | 0x3F800000u); }
INLINE float q2_code(uint32_t lo, uint32_t hi, int j) {
  const uint32_t m = j <= 10 ? (lo & (0xFF800000u | (3u << (2 * j)))) : (hi & (0xFF800000u | (3u << (2 * (j - 11)))));
  return bits_f32(m) - 1.0f;
}
INLINE float q2_scale(int j) {
  const int s = j <= 10 ? 2 * j : 2 * (j - 11);
  return bits_f32((uint32_t)(127 + 23 - s) << 23);
}
// DN = 1: an AND and an FMA per code, no subtract. Code j masked in place, with no exponent
// bits, is the subnormal float q 2^(s-149); what it multiplies is pre-scaled by
// q2_scale_dn(j) = 2^(85-s), so each product is q x 2^-64, exactly the DN = 0 product scaled by
// a power of two, and the word's sum times TWO64 (exact) is the DN = 0 sum bit for bit while
// every |x| and |h| is in [2^-62, 2^43] (outside it, products under- or overflow). fma_keep is
// an FMA that keeps subnormals whatever the compiler's flush mode. (ncu, H200, 64 tokens x
// k = 10: 204M of the 387M warp instructions were FP32, half of them the subtract.)
#define TWO64 18446744073709551616.0f
INLINE float q2_dn(uint32_t w, int s) { return bits_f32(w & (3u << s)); }
INLINE float q2_scale_dn(int j) {
  const int s = j <= 10 ? 2 * j : 2 * (j - 11);
  return bits_f32((uint32_t)(127 + 85 - s) << 23);
}
INLINE int q2_shift(int j) { return j <= 10 ? 2 * j : 2 * (j - 11); }  // code j's bit position in w or w >> 22
"""

# Token t's x into threadgroup memory, pre-scaled per code (xsh, row stride XW), and each 16-value
# word's plain sum (xsum), in one order: the fused kernel (COMMON) and moe_decode.py's gate/up
# launch both take this text, so their hidden activations agree bit for bit. Needs tid, NT, WPR,
# XW, D, DN, x, t, xsh, xsum in scope.
X_PRESCALE = r"""
  for (uint32_t w = tid; w < (uint32_t)WPR; w += NT) {
    float s = 0.0f;
    UNROLL for (int j = 0; j < 16; j += 4) {
      const f4 v = load_f4(x + (uint64_t)t * D + 16 * w + j);
      UNROLL for (int q = 0; q < 4; ++q) {
        xsh[XW * w + j + q] = v.v[q] * (DN ? q2_scale_dn(j + q) : q2_scale(j + q));
        s += v.v[q];
      }
    }
    xsum[w] = s;
  }
"""

COMMON = r"""
  constexpr int NW = NT / 32;
  constexpr int WPR = D / 16;                 // uint32 words per gate/up row
  constexpr int WPL = (WPR + 31) / 32;        // words per lane
  constexpr int RPW = (FC + NW - 1) / NW;     // gate/up rows per warp
  constexpr int WC = FC / 16;                 // words of one down row in this chunk
  constexpr int DPT = (D + NT - 1) / NT;      // down rows per thread
  const uint32_t c = rb % NCH;                // chunk of FC hidden units
  const bool live = slot >= 0;
  const DEVICE uint8_t* rec = arena + (uint64_t)(live ? slot : 0) * (uint64_t)SLOT;  // 64-bit: arenas pass 4 GB
  // x, once per block: pre-scaled per code into threadgroup memory (word w's 16 values at
  // XW * w: the 16-byte reads of 8 lanes then meet 8 different bank quads) and each word's plain
  // sum, in the order the arithmetic below used when it read x itself. That version loaded x
  // from L2 and summed it at every step before issuing the step's weight loads, so each step
  // waited for an L2 round trip and then a DRAM one (SASS, sm_90), and spent 32 of its ~520
  // instructions re-scaling x.
""" + X_PRESCALE + r"""  BARRIER();
  // gate/up: warp warp_id takes rows warp_id + NW rr; lane word w = lane + 32 i of each row, so a
  // warp reads 128 contiguous bytes per row and step. The word loop is outside the row loop: the
  // lane's 16 x values of word w live only through step i (fewer registers, more blocks per SM).
  // Each step issues the RPW rows' loads together; warp_sync() keeps ptxas from sinking them
  // into the arithmetic.
  float ga[RPW], ua[RPW];
  UNROLL for (int rr = 0; rr < RPW; ++rr) { ga[rr] = 0.0f; ua[rr] = 0.0f; }
  UNROLL for (int i = 0; i < WPL; ++i) {
    const int w = (int)lane + 32 * i;
    const bool wl = w < WPR;  // lane-dependent only where WPR is not a multiple of 32
    uint32_t gw[RPW], uw[RPW];
    float gd[RPW], ud[RPW];
    UNROLL for (int rr = 0; rr < RPW; ++rr) {  // every load of the step before any use
      const int r = (int)warp_id + NW * rr;
      gw[rr] = 0u; uw[rr] = 0u; gd[rr] = 0.0f; ud[rr] = 0.0f;
      if (wl && live && r < FC) {
        const uint64_t f = (uint64_t)c * FC + r;
        gw[rr] = ((const DEVICE uint32_t*)(rec + GC + f * (D / 4)))[w];
        uw[rr] = ((const DEVICE uint32_t*)(rec + UC + f * (D / 4)))[w];
        gd[rr] = F32(((const DEVICE half_t*)(rec + GS))[f * (D / 32) + (w >> 1)]);
        ud[rr] = F32(((const DEVICE half_t*)(rec + US))[f * (D / 32) + (w >> 1)]);
      }
    }
    warp_sync();
    if (wl) {
      float xv[16];
      UNROLL for (int j = 0; j < 16; ++j) xv[j] = xsh[XW * w + j];
      const float xs = xsum[w];
      UNROLL for (int rr = 0; rr < RPW; ++rr) {
        if (live && (int)warp_id + NW * rr < FC) {
          if (DN) {
            const uint32_t gh = gw[rr] >> 22, uh = uw[rr] >> 22;
            float gsum = 0.0f, usum = 0.0f;
            UNROLL for (int j = 0; j < 16; ++j) {
              gsum = fma_keep(q2_dn(j <= 10 ? gw[rr] : gh, q2_shift(j)), xv[j], gsum);
              usum = fma_keep(q2_dn(j <= 10 ? uw[rr] : uh, q2_shift(j)), xv[j], usum);
            }
            ga[rr] += gd[rr] * fma_keep(gsum, TWO64, -2.0f * xs);
            ua[rr] += ud[rr] * fma_keep(usum, TWO64, -2.0f * xs);
          } else {
            const uint32_t gl = q2_lo(gw[rr]), gh = q2_hi(gw[rr]), ul = q2_lo(uw[rr]), uh = q2_hi(uw[rr]);
            float gsum = 0.0f, usum = 0.0f;
            UNROLL for (int j = 0; j < 16; ++j) {
              gsum += q2_code(gl, gh, j) * xv[j];
              usum += q2_code(ul, uh, j) * xv[j];
            }
            ga[rr] += gd[rr] * (gsum - 2.0f * xs);
            ua[rr] += ud[rr] * (usum - 2.0f * xs);
          }
        }
      }
    }
  }
  UNROLL for (int rr = 0; rr < RPW; ++rr) {
    const int r = (int)warp_id + NW * rr;  // warp-uniform
    if (r < FC) {
      const float g = warp_sum(ga[rr]), u = warp_sum(ua[rr]);
      if (lane == 0) hs[r] = g / (1.0f + exp_f(-g)) * u;
    }
  }
  BARRIER();
  if (tid < (uint32_t)(FC / 16)) {
    float s = 0.0f;
    for (int j = 0; j < 16; ++j) s += hs[16 * tid + j];
    hsum[tid] = s;
  }
  for (uint32_t f = tid; f < (uint32_t)FC; f += NT) hxs[f] = hs[f] * (DN ? q2_scale_dn((int)(f % 16)) : q2_scale((int)(f % 16)));
  BARRIER();
  // down: thread d takes rows d, d + NT, ...; every load first (registers), then the arithmetic.
  // This chunk's h, pre-scaled per code: in registers (HX = 0: FC of them per thread) or read from
  // threadgroup memory as used (HX = 1: every lane reads the same address, a broadcast).
  float hx[FC];
  if (!HX) { UNROLL for (int f = 0; f < FC; ++f) hx[f] = hxs[f]; }
  uint32_t dq[DPT][WC];
  float dsc[DPT][WC / 2];
  UNROLL for (int i = 0; i < DPT; ++i) {
    const uint32_t d = tid + NT * i;
    UNROLL for (int w = 0; w < WC; ++w) dq[i][w] = 0u;
    UNROLL for (int w = 0; w < WC / 2; ++w) dsc[i][w] = 0.0f;
    if (live && d < (uint32_t)D) {
      const DEVICE uint32_t* q = (const DEVICE uint32_t*)(rec + DC + (uint64_t)d * (F / 4)) + c * WC;
      const DEVICE half_t* sc = (const DEVICE half_t*)(rec + DS) + (uint64_t)d * (F / 32) + c * (WC / 2);
      if (VL && WC % 4 == 0 && (F / 4) % 16 == 0) {  // 16-byte loads (rows and chunks 16-byte aligned)
        UNROLL for (int w = 0; w < WC; w += 4) {
          const uint4 v = *(const DEVICE uint4*)(q + w);
          dq[i][w] = v.x; dq[i][w + 1] = v.y; dq[i][w + 2] = v.z; dq[i][w + 3] = v.w;
        }
      } else if (VL && WC % 2 == 0) {  // 8-byte loads (F is a multiple of 32: rows 8-byte aligned)
        UNROLL for (int w = 0; w < WC; w += 2) {
          const uint2 v = *(const DEVICE uint2*)(q + w);
          dq[i][w] = v.x; dq[i][w + 1] = v.y;
        }
      } else {
        UNROLL for (int w = 0; w < WC; ++w) dq[i][w] = q[w];
      }
      UNROLL for (int w = 0; w < WC / 2; ++w) dsc[i][w] = F32(sc[w]);
    }
  }
  DEVICE float* dst = out + ((uint64_t)t * (K * NCH) + rb) * D;
  UNROLL for (int i = 0; i < DPT; ++i) {
    const uint32_t d = tid + NT * i;
    if (d < (uint32_t)D) {
      float acc = 0.0f;
      if (live) {
        UNROLL for (int w = 0; w < WC; ++w) {
          if (DN) {
            const uint32_t qw = dq[i][w], qh = qw >> 22;
            float dd = 0.0f;
            UNROLL for (int j = 0; j < 16; ++j) dd = fma_keep(q2_dn(j <= 10 ? qw : qh, q2_shift(j)), HX ? hxs[16 * w + j] : hx[16 * w + j], dd);
            acc += dsc[i][w >> 1] * fma_keep(dd, TWO64, -2.0f * hsum[w]);
          } else {
            const uint32_t ql = q2_lo(dq[i][w]), qh = q2_hi(dq[i][w]);
            float dd = 0.0f;
            UNROLL for (int j = 0; j < 16; ++j) dd += q2_code(ql, qh, j) * (HX ? hxs[16 * w + j] : hx[16 * w + j]);
            acc += dsc[i][w >> 1] * (dd - 2.0f * hsum[w]);
          }
        }
      }
      dst[d] = wt * acc;
    }
  }
"""

# Threadgroup memory at the kernel's scope (Metal allows it nowhere else): the routed blocks'
# h chunk and its per-word sums, x pre-scaled and its per-word sums; the shared blocks' x and h chunk.
DECLS = r"""
  constexpr int XW = 20;  // floats per x word in threadgroup memory (16 values, 4 of padding)
  SHARED float hs[HSN];
  SHARED float hsum[FC / 16];
  SHARED float hxs[FC];
  SHARED float xsh[(D / 16) * XW];  // routed blocks: x pre-scaled per code; shared blocks: x
  SHARED float xsum[D / 16];
"""
# shared-expert blocks first (bx < NSB): they are the larger ones, so they start first
BRANCH = r"""
  if (bx < (uint32_t)NSB) {
    const uint32_t sb = bx;
""" + shared_kernel.SHARED_BLOCK + r"""
  } else {
""" + COMMON + r"""
  }
"""
INPUTS_SHARED = ("sgate", "sup", "sdown")
SLOTS_SOURCE = KernelSource("strata_moe_slots", ("arena", "x", "slots", "weights") + INPUTS_SHARED, ("out", "sout"),
                            SLOTS_PREAMBLE + DECLS + BRANCH, HELPERS)
ROUTE_SOURCE = KernelSource("strata_moe_route", ("arena", "x", "z", "slot_base") + INPUTS_SHARED, ("out", "sout"),
                            ROUTE_PREAMBLE + DECLS + BRANCH, HELPERS)


def subnormal_codes() -> bool:
    """DN, the code form: subnormal codes (an AND and an FMA per code) on CUDA and the emulator,
    whose FMAs keep subnormals (fma_keep: PTX fma.rn.f32, std::fma); Metal keeps the exponent
    form (three instructions per code) until the subnormal form is measured on a Mac: Metal's
    fast math may flush subnormals to zero."""
    return gpu_dialect() is not Dialect.METAL


class BlockShape(NamedTuple):
    """FC hidden units per block, NT threads per block, and where the down step reads h (HX)."""

    fc: int
    threads: int
    hx_shared: bool


# A decoded token's shape: FC = 32, h of the down step in registers (76 registers, 3 blocks per SM
# on sm_90) rather than threadgroup memory (58, 4 blocks per SM). H200, run C: 529 vs 549 us of GPU
# time (ncu), 578 vs 604 us wall.
DECODE_SHAPE = BlockShape(Q2.block_size, THREADS, False)


# The multi-token shape: FC = 64 halves the down planes' L2 sectors per byte (a block reads 16
# bytes of codes and 4 of scales per down row instead of 8 and 2, each from its own 32-byte
# sector: at FC = 32 those reads were 76% of a block's sectors and L2 the busiest unit, 70%);
# NT = 512 keeps (32, 256)'s gate/up rows per warp and down rows per thread, h comes from
# threadgroup memory (in registers it takes 113 and 1 block per SM). H200, 64 tokens x k = 10
# (ncu, one run): 483 us against 533 us for (32, 256) — docs/perf.md, third session.
MANY_TOKENS_SHAPE = BlockShape(64, 512, True)
# from this many tokens per launch: a decode token keeps FC = 32, whose k = 10 x 18 blocks fill
# the H200's 132 SMs (FC = 64 would leave 42 idle)
MANY_TOKENS = 8


def block_shape(rec: RecordLayout, tokens: int) -> BlockShape:
    """The block shape for a launch of `tokens` tokens. FC = 32 (a multiple of 32 dividing F,
    the most blocks and the fewest registers) for decode; FC = 64 with 512 threads for many
    tokens where 64 divides F. (The first kernel took 843 us with FC = 32 and 1704 with FC = 64
    at 256 threads, 152 registers, 1 block per SM: the gate/up rows per warp doubled.)"""
    if tokens >= MANY_TOKENS and rec.expert_ffn % MANY_TOKENS_SHAPE.fc == 0:
        return MANY_TOKENS_SHAPE
    return DECODE_SHAPE


@functools.cache
def _template(rec: RecordLayout, k: int, fc: int, threads: int = THREADS, denormals: bool | None = None,
              hx_shared: bool = False, vector_loads: bool = True) -> tuple[tuple[str, int], ...]:
    denormals = subnormal_codes() if denormals is None else denormals
    if rec.qtype is not QuantType.Q2_0:
        raise ValueError(f"the fused expert kernel reads Q2_0 records, not {rec.qtype.name}")
    d, f = rec.hidden, rec.expert_ffn
    if f % fc or fc % Q2.block_size or d % (Q2.block_size * 4 // 2) or d > MAX_HIDDEN:
        raise ValueError(f"fused experts: F={f} must be a multiple of FC={fc} (a multiple of 32), D={d} of 16 "
                         f"and at most {MAX_HIDDEN}")
    off = {n: rec.codes(n).offset for n in ("gate", "up", "down")}
    sc = {n: rec.scales(n).offset for n in ("gate", "up", "down")}
    return (("D", d), ("F", f), ("FC", fc), ("NCH", f // fc), ("K", k), ("SLOT", rec.padded_bytes),
            ("GC", off["gate"]), ("GS", sc["gate"]), ("UC", off["up"]), ("US", sc["up"]),
            ("DC", off["down"]), ("DS", sc["down"]), ("NT", threads), ("DN", int(denormals)), ("HX", int(hx_shared)),
            ("VL", int(vector_loads)))


def _with_shared(rec: RecordLayout, fc: int, shared) -> tuple[list, tuple, int]:
    """The shared expert's inputs, template ints and block count (NSB = 0: none)."""
    if shared is None:
        none = absent(np.float16)
        return [none, none, none], (("FS", 8), ("FCS", 8), ("NSB", 0), ("HSN", fc)), 0
    gate, up, down = shared
    shared_kernel.check_hidden(rec.hidden)
    tpl = shared_kernel.template(gate.shape[0])
    fcs, nsb = dict(tpl)["FCS"], dict(tpl)["NSB"]
    return [gate, up, down], tpl + (("HSN", max(fc, fcs)),), nsb


def full_template(rec: RecordLayout, k: int, fc: int, shared=None) -> tuple[tuple[str, int], ...]:
    """Every template int of the host-slots kernel at (FC, 256 threads) (tests that run the body directly)."""
    return _template(rec, k, fc) + _with_shared(rec, fc, shared)[1]


def _shape(rec: RecordLayout, tokens: int, fc: int | None, threads: int | None, hx: bool | None) -> BlockShape:
    """`block_shape`, with what the caller chose put in; an FC other than the chosen shape's
    gets 256 threads and h in registers unless they are given too."""
    shape = block_shape(rec, tokens)
    if fc is not None and fc != shape.fc:
        shape = BlockShape(fc, THREADS, False)
    return BlockShape(shape.fc, threads or shape.threads, shape.hx_shared if hx is None else hx)


def _launch(src: KernelSource, rec: RecordLayout, head: list, t: int, k: int, fc: int, template: tuple,
            shared, threads: int) -> tuple[mx.array, mx.array | None]:
    nch = rec.expert_ffn // fc
    sh_inputs, sh_template, nsb = _with_shared(rec, fc, shared)
    out, sout = launch(src, head + sh_inputs, [(t, k * nch, rec.hidden), (t, max(nsb, 1), rec.hidden)],
                       [mx.float32, mx.float32], blocks=(nsb + k * nch, t, 1), threads=threads,
                       template=template + sh_template)
    return out, (sout if nsb else None)


def slot_inputs(slots, weights):
    """The kernels' slot inputs: slots int32 [T, k] and weights float32 [T, k], numpy kept numpy
    (padded on the host, no launch) and mx arrays cast only where their dtype differs."""
    if isinstance(slots, np.ndarray):
        return np.asarray(slots, np.int32), np.asarray(weights, np.float32)
    return (slots if slots.dtype == mx.int32 else slots.astype(mx.int32)), as_f32(weights)


def moe_slots(arena: mx.array, rec: RecordLayout, x: mx.array, slots, weights, fc: int | None = None,
              shared=None, threads: int | None = None, denormals: bool | None = None,
              hx_shared: bool | None = None, vector_loads: bool = True) -> mx.array | tuple[mx.array, mx.array]:
    """Kernel path, host-chosen slots. x [T, D], slots int [T, k] (-1 skip), weights [T, k]
    (numpy: padded on the host, no launch; or mx) -> partials float32 [T, k * F/FC, D].
    shared (gate, up, down float16): the shared expert's blocks ride in the same launch and the
    result is (routed partials, shared partials [T, Fs/FCS, D]). fc / threads: other block shapes
    (the benchmarks compare them); denormals: the code form (default `subnormal_codes()`);
    hx_shared: where the down step reads h (defaults: `block_shape`); vector_loads: the down
    step's codes as one 8- or 16-byte load per row (FC = 32 / 64), not FC/16 4-byte loads, each of
    which a warp issues as 32 sectors (the rows are F/4 bytes apart)."""
    t, k = slots.shape
    slots, weights = slot_inputs(slots, weights)
    fc, threads, hx_shared = _shape(rec, t, fc, threads, hx_shared)
    out, sout = _launch(SLOTS_SOURCE, rec, [arena, as_f32(x), slots, weights], t, k, fc,
                        _template(rec, k, fc, threads, denormals, hx_shared, vector_loads), shared, threads)
    return out if shared is None else (out, sout)


def routes_on_kernel(rule) -> bool:
    """Whether the routing kernel implements the rule: the two softmax orders. A sigmoid rule
    (selection bias, groups) routes with MLX ops on the device (routing.select_device) and runs
    its experts through the slots kernel."""
    return rule.order in (RoutingOrder.SOFTMAX_TOPK, RoutingOrder.TOPK_SOFTMAX)


def moe_route(arena: mx.array, rec: RecordLayout, x: mx.array, z: mx.array, slot_base: int, k: int,
              order: RoutingOrder, norm_topk_prob: bool, fc: int | None = None,
              shared=None) -> mx.array | tuple[mx.array, mx.array]:
    """Kernel path, routing on the GPU (the model's own rule; every expert resident at
    slot_base + e). x [T, D], z [T, E] -> partials float32 [T, k * F/FC, D]; with shared (gate,
    up, down), (routed partials, shared partials [T, Fs/FCS, D]) from one launch."""
    if order not in (RoutingOrder.SOFTMAX_TOPK, RoutingOrder.TOPK_SOFTMAX):
        raise ConfigError(f"moe_route: the routing kernel has no rule {order.value} (route with routing.select_device)")
    t, e = z.shape
    fc, threads, hx = _shape(rec, t, fc, None, None)
    routing = (("E", e), ("ORDER", 0 if order is RoutingOrder.SOFTMAX_TOPK else 1), ("NORM", int(norm_topk_prob)))
    template = _template(rec, k, fc, threads, None, hx) + routing
    out, sout = _launch(ROUTE_SOURCE, rec, [arena, as_f32(x), as_f32(z), index_const(slot_base)], t, k, fc,
                        template, shared, threads)
    return out if shared is None else (out, sout)


assert WORD_CODES == 16 and THREADS % WARP == 0
