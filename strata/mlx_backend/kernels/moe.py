"""The fused routed-expert kernel: gate and up GEMVs over the k selected slots, SwiGLU, down
GEMV and the routing weight, reading Q2_0 planes straight out of the arena by slot index.

Work split (no grid-wide sync, so one launch): block (bx, t) takes selected rank i = bx / NCH and
chunk c = bx % NCH of the expert's F hidden units (FC rows of gate and up). It computes
h_f = silu(gate_f . x) * (up_f . x) for its FC rows, then its share of the down projection,
w_i * down[:, chunk] . h[chunk], a partial [D] output. The partials ([T, k*NCH, D]) are summed
by the combine kernel in a fixed order (deterministic; no atomics).

Reads: gate/up rows are read by one warp each, a lane taking uint32 words (16 codes = half a
Q2_0 block) at lane + 32 i, so a warp reads 128 contiguous bytes per step and the lane's slice
of x (16 floats a word) stays in registers for every row. Down: a thread per output row reads its
chunk's FC/16 words. Per 16-code word: d * (sum q_j x_j - 2 sum x_j) = sum d (q_j - 2) x_j.
Plane offsets and sizes come from strata.formats.expert_record.RecordLayout (template ints).

Instruction budget (what bounds it on the H200, measured): a code costs a bit-and, a subtract and
an FMA (`q2_code`: no int-to-float conversion, whose 16/clock/SM rate bounded the first version at
31% of copy bandwidth), and each thread issues all its loads of a row (gate/up) or of its down rows
before the arithmetic, so a block waits for memory about twice rather than once per row. The
results are bit for bit those of the straightforward form (products of exactly scaled values).

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

import mlx.core as mx
import numpy as np

from strata.formats.expert_record import RecordLayout
from strata.formats.quant_types import QuantType, layout
from strata.mlx_backend.kernels.launch import as_f32, index_param, launch
from strata.mlx_backend.kernels.preludes import WARP
from strata.mlx_backend.kernels.source import KernelSource
from strata.model_config import RoutingOrder

Q2 = layout(QuantType.Q2_0)
THREADS = 256
FEW_TOKENS = 4  # from this many tokens per launch, 64 hidden units per block (chunk_rows)
WORD_CODES = 32 // Q2.bits  # 16 codes per uint32 word

SLOTS_PREAMBLE = r"""
  const uint32_t t = by;
  const uint32_t rank = bx / NCH;
  const int32_t slot = slots[t * K + rank];
  const float wt = weights[t * K + rank];
"""

ROUTE_PREAMBLE = r"""
  constexpr int NWR = NT / 32;
  const uint32_t t = by;
  const uint32_t rank = bx / NCH;
  SHARED float zs[E];
  SHARED int32_t top[K];
  SHARED float topw[K];
  SHARED float red[NWR];
  for (uint32_t e = tid; e < (uint32_t)E; e += NT) zs[e] = z[(uint64_t)t * E + e];
  BARRIER();
  for (uint32_t e = tid; e < (uint32_t)E; e += NT) {  // rank by z descending, ties to the lower id
    const float ze = zs[e];
    int32_t r = 0;
    for (int32_t j = 0; j < E; ++j) {
      const float zj = zs[j];
      r += (zj > ze || (zj == ze && j < (int32_t)e)) ? 1 : 0;
    }
    if (r < K) top[r] = (int32_t)e;
  }
  BARRIER();
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
// block -> 15.5 us of I2F per block; 844 us measured per launch). Code j of a word w is put in the
// mantissa of 1.0f: (1 + q 2^(s-23)) - 1 = q 2^(s-23) exactly, with s = 2j for j <= 10 (bits
// 0..21 of w) and s = 2(j-11) for j >= 11 (read from hi = w >> 22). What it multiplies (x or h)
// is pre-scaled by q2_scale(j) = 2^(23-s), exactly, so each product is q * x bit for bit.
INLINE float q2_code(uint32_t w, uint32_t hi, int j) {
  const uint32_t m = j <= 10 ? (w & (3u << (2 * j))) : (hi & (3u << (2 * (j - 11))));
  return bits_f32(m | 0x3F800000u) - 1.0f;
}
INLINE float q2_scale(int j) {
  const int s = j <= 10 ? 2 * j : 2 * (j - 11);
  return bits_f32((uint32_t)(127 + 23 - s) << 23);
}
"""

COMMON = r"""
  constexpr int NW = NT / 32;
  constexpr int WPR = D / 16;                 // uint32 words per gate/up row
  constexpr int WPL = (WPR + 31) / 32;        // words per lane
  constexpr int RPW = (FC + NW - 1) / NW;     // gate/up rows per warp
  constexpr int WC = FC / 16;                 // words of one down row in this chunk
  constexpr int DPT = (D + NT - 1) / NT;      // down rows per thread
  const uint32_t c = bx % NCH;                // chunk of FC hidden units
  const bool live = slot >= 0;
  SHARED float hs[FC];
  SHARED float hsum[FC / 16];
  // this lane's words of x: word w = lane + 32 i holds x[16 w .. 16 w + 15], pre-scaled per code
  float xr[WPL * 16];
  float xs16[WPL];
  UNROLL for (int i = 0; i < WPL; ++i) {
    const int w = (int)lane + 32 * i;
    float s = 0.0f;
    UNROLL for (int j = 0; j < 16; j += 4) {
      f4 v; v.v[0] = 0.0f; v.v[1] = 0.0f; v.v[2] = 0.0f; v.v[3] = 0.0f;
      if (w < WPR) v = load_f4(x + (uint64_t)t * D + 16 * w + j);
      UNROLL for (int q = 0; q < 4; ++q) { xr[i * 16 + j + q] = v.v[q] * q2_scale(j + q); s += v.v[q]; }
    }
    xs16[i] = s;
  }
  const DEVICE uint8_t* rec = arena + (uint64_t)(live ? slot : 0) * (uint64_t)SLOT;  // 64-bit: arenas pass 4 GB
  UNROLL for (int rr = 0; rr < RPW; ++rr) {
    const int r = (int)warp_id + NW * rr;     // warp-uniform
    if (r < FC) {
      const uint64_t f = (uint64_t)c * FC + r;
      const DEVICE uint32_t* gq = (const DEVICE uint32_t*)(rec + GC + f * (D / 4));
      const DEVICE uint32_t* uq = (const DEVICE uint32_t*)(rec + UC + f * (D / 4));
      const DEVICE half_t* gs = (const DEVICE half_t*)(rec + GS) + f * (D / 32);
      const DEVICE half_t* us = (const DEVICE half_t*)(rec + US) + f * (D / 32);
      uint32_t gw[WPL], uw[WPL];
      float gd[WPL], ud[WPL];
      UNROLL for (int i = 0; i < WPL; ++i) {  // every load of the row before any use
        const int w = (int)lane + 32 * i;
        gw[i] = 0u; uw[i] = 0u; gd[i] = 0.0f; ud[i] = 0.0f;
        if (live && w < WPR) { gw[i] = gq[w]; uw[i] = uq[w]; gd[i] = F32(gs[w >> 1]); ud[i] = F32(us[w >> 1]); }
      }
      float ga = 0.0f, ua = 0.0f;
      UNROLL for (int i = 0; i < WPL; ++i) {
        if ((int)lane + 32 * i < WPR) {
          const uint32_t gh = gw[i] >> 22, uh = uw[i] >> 22;
          float gsum = 0.0f, usum = 0.0f;
          UNROLL for (int j = 0; j < 16; ++j) {
            gsum += q2_code(gw[i], gh, j) * xr[i * 16 + j];
            usum += q2_code(uw[i], uh, j) * xr[i * 16 + j];
          }
          ga += gd[i] * (gsum - 2.0f * xs16[i]);
          ua += ud[i] * (usum - 2.0f * xs16[i]);
        }
      }
      ga = warp_sum(ga);
      ua = warp_sum(ua);
      if (lane == 0) hs[r] = ga / (1.0f + exp_f(-ga)) * ua;
    }
  }
  BARRIER();
  if (tid < (uint32_t)(FC / 16)) {
    float s = 0.0f;
    for (int j = 0; j < 16; ++j) s += hs[16 * tid + j];
    hsum[tid] = s;
  }
  BARRIER();
  // down: thread d takes rows d, d + NT, ...; every load first (registers), then the arithmetic
  float hx[FC];  // this chunk's h, pre-scaled per code
  UNROLL for (int f = 0; f < FC; ++f) hx[f] = hs[f] * q2_scale(f % 16);
  uint32_t dq[DPT][WC];
  float dsc[DPT][WC / 2];
  UNROLL for (int i = 0; i < DPT; ++i) {
    const uint32_t d = tid + NT * i;
    UNROLL for (int w = 0; w < WC; ++w) dq[i][w] = 0u;
    UNROLL for (int w = 0; w < WC / 2; ++w) dsc[i][w] = 0.0f;
    if (live && d < (uint32_t)D) {
      const DEVICE uint32_t* q = (const DEVICE uint32_t*)(rec + DC + (uint64_t)d * (F / 4)) + c * WC;
      const DEVICE half_t* sc = (const DEVICE half_t*)(rec + DS) + (uint64_t)d * (F / 32) + c * (WC / 2);
      UNROLL for (int w = 0; w < WC; ++w) dq[i][w] = q[w];
      UNROLL for (int w = 0; w < WC / 2; ++w) dsc[i][w] = F32(sc[w]);
    }
  }
  DEVICE float* dst = out + ((uint64_t)t * (K * NCH) + bx) * D;
  UNROLL for (int i = 0; i < DPT; ++i) {
    const uint32_t d = tid + NT * i;
    if (d < (uint32_t)D) {
      float acc = 0.0f;
      if (live) {
        UNROLL for (int w = 0; w < WC; ++w) {
          const uint32_t qw = dq[i][w], qh = qw >> 22;
          float dd = 0.0f;
          UNROLL for (int j = 0; j < 16; ++j) dd += q2_code(qw, qh, j) * hx[16 * w + j];
          acc += dsc[i][w >> 1] * (dd - 2.0f * hsum[w]);
        }
      }
      dst[d] = wt * acc;
    }
  }
"""

SLOTS_SOURCE = KernelSource("strata_moe_slots", ("arena", "x", "slots", "weights"), ("out",),
                            SLOTS_PREAMBLE + COMMON, HELPERS)
ROUTE_SOURCE = KernelSource("strata_moe_route", ("arena", "x", "z", "slot_base"), ("out",),
                            ROUTE_PREAMBLE + COMMON, HELPERS)


def chunk_rows(rec: RecordLayout, tokens: int) -> int:
    """FC: the hidden units one block takes (a multiple of 32 dividing F). 32 gives the most
    blocks, which a decode token needs (k = 10 at the seed's size: 180 blocks for 132 SMs); with
    several tokens there are blocks enough, and 64 halves the per-block overhead (x loads, the
    barriers, the h exchange) per byte (on the H200: 844 vs 996 us for 64 tokens, first version)."""
    wide = 2 * Q2.block_size
    return wide if tokens >= FEW_TOKENS and rec.expert_ffn % wide == 0 else Q2.block_size


@functools.cache
def _template(rec: RecordLayout, k: int, fc: int) -> tuple[tuple[str, int], ...]:
    if rec.qtype is not QuantType.Q2_0:
        raise ValueError(f"the fused expert kernel reads Q2_0 records, not {rec.qtype.name}")
    d, f = rec.hidden, rec.expert_ffn
    if f % fc or fc % Q2.block_size or d % (Q2.block_size * 4 // 2):
        raise ValueError(f"fused experts: F={f} must be a multiple of FC={fc} (a multiple of 32), D={d} of 16")
    off = {n: rec.codes(n).offset for n in ("gate", "up", "down")}
    sc = {n: rec.scales(n).offset for n in ("gate", "up", "down")}
    return (("D", d), ("F", f), ("FC", fc), ("NCH", f // fc), ("K", k), ("SLOT", rec.padded_bytes),
            ("GC", off["gate"]), ("GS", sc["gate"]), ("UC", off["up"]), ("US", sc["up"]),
            ("DC", off["down"]), ("DS", sc["down"]), ("NT", THREADS))


def moe_slots(arena: mx.array, rec: RecordLayout, x: mx.array, slots, weights, fc: int | None = None) -> mx.array:
    """Kernel path, host-chosen slots. x [T, D], slots int [T, k] (-1 skip), weights [T, k]
    (numpy: padded on the host, no launch; or mx) -> partials float32 [T, k * F/FC, D]"""
    t, k = slots.shape
    if isinstance(slots, np.ndarray):
        slots, weights = np.asarray(slots, np.int32), np.asarray(weights, np.float32)
    else:
        slots = slots if slots.dtype == mx.int32 else slots.astype(mx.int32)
        weights = as_f32(weights)
    fc = fc or chunk_rows(rec, t)
    nch = rec.expert_ffn // fc
    return launch(SLOTS_SOURCE, [arena, as_f32(x), slots, weights],
                  [(t, k * nch, rec.hidden)], [mx.float32], blocks=(k * nch, t, 1), threads=THREADS,
                  template=_template(rec, k, fc))[0]


def moe_route(arena: mx.array, rec: RecordLayout, x: mx.array, z: mx.array, slot_base: int, k: int,
              order: RoutingOrder, norm_topk_prob: bool, fc: int | None = None) -> mx.array:
    """Kernel path, routing on the GPU (the model's own rule; every expert resident at
    slot_base + e). x [T, D], z [T, E] -> partials float32 [T, k * F/FC, D]"""
    t, e = z.shape
    fc = fc or chunk_rows(rec, t)
    nch = rec.expert_ffn // fc
    template = _template(rec, k, fc) + (("E", e), ("ORDER", 0 if order is RoutingOrder.SOFTMAX_TOPK else 1),
                                        ("NORM", int(norm_topk_prob)))
    return launch(ROUTE_SOURCE, [arena, as_f32(x), as_f32(z), index_param(slot_base)],
                  [(t, k * nch, rec.hidden)], [mx.float32], blocks=(k * nch, t, 1), threads=THREADS,
                  template=template)[0]


assert WORD_CODES == 16 and THREADS % WARP == 0
