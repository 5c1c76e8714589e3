"""The routed experts of a decoded token in two launches, the layer's combine folded into the second.

The fused kernel (moe.py) splits an expert's F hidden units into chunks of FC = 32 and gives each
block a chunk's gate, up *and down*: the down step of a chunk is a full D-long partial, so a
decoded token writes k x F/FC = 180 partials (1.8 MB at the seed shape) that a combine launch
reads back, and a block's gate/up walk issues its loads in WPL = 5 dependent steps (one DRAM round
trip each). ncu on the H200 (seed shape, one token): experts 25.7-25.9 us + combine 5.4-5.8 us for
13.8 MB of records, 16% of copy bandwidth. Here the same work is cut where the data dependency is:

- `strata_moe_gateup`: block (rank i, group of UPB hidden units) ranks the logits (moe.py's
  ROUTE_PREAMBLE: the reference's order, the rule's weights), issues *every* gate/up load of its
  units at once (UPW units a warp, WPL words a lane each: 40 words in flight a lane at the seed
  shape), stages x while they fly, then writes h_f = silu(gate_f . x) (up_f . x) (bit for bit the
  fused kernel's h: the same per-lane order and warp sum). Only the first routed block computes
  the rule's weights (after its loads are issued: no block's loads wait on the softmax) and writes
  them with the k slots. Seed shape: 10 x 18 blocks (UPW = 4).
- `strata_moe_down`: a warp per output row d sums w_i down_i[d, :] . h_i over all k experts (a lane
  takes (expert, word) pairs lane + 32 j: 12 words and their scales, loaded before h is staged)
  and writes x_mid[d] + that sum: the combine, with no partials. Seed shape: 320 blocks.
- a shared expert (float16, shared.py's SHARED_BLOCK) rides in the gate/up grid as the fused
  kernel's did (its blocks first, each writing its down partial); the first routed block also
  computes its gate sigmoid(gate_inp . x) once; the down launch adds the partials times the gate.

Predicted at the seed shape (bytes at ~3.4 TB/s plus one launch ramp each): gate/up 9.2 MB, ~6 us
with the ranking; down 4.6 MB, ~5 us: ~11 us a layer against 31 (0.95 ms a token).
Sums differ from the fused kernel's in order only (the down sums over experts inside the warp).

Shapes:
    arena uint8 [S, SLOT], h float32 [T, D] (the router input), z float32 [T, E]
    -> hid float32 [T, K, F], sel int32 [T, K] (slots), wsel float32 [T, K]
    x_mid float32 [T, D], hid, sel, wsel -> out float32 [T, D]
"""

from __future__ import annotations

import functools
from typing import NamedTuple

import mlx.core as mx
import numpy as np

from strata.formats.expert_record import RecordLayout
from strata.formats.quant_types import QuantType
from strata.mlx_backend.kernels import decode_routing as routing
from strata.mlx_backend.kernels import moe
from strata.mlx_backend.kernels import moe_down_warps as down_warps
from strata.mlx_backend.kernels import shared as shared_kernel
from strata.mlx_backend.kernels.folded_outputs import Region
from strata.mlx_backend.kernels.launch import absent, as_f32, index_const, launch
from strata.mlx_backend.kernels.phases import LaunchSpec, run
from strata.mlx_backend.kernels.preludes import WARP
from strata.mlx_backend.kernels.source import KernelSource
from strata.model_config import RoutingOrder

THREADS = 256
# 16 hidden units a block, 360 blocks at the seed shape (64-70 registers: 3 an SM) since the warp
# sorts made a block's ranking cheap: H200 (ncu, one token) 14.3 us against 4 units' 15.5 (180
# blocks of 116 registers: 48 SMs ran two and 84 one, and the two-block SMs set the end)
GATEUP_UNITS_PER_WARP = 2
DOWN_ROWS_PER_WARP = 1  # 320 blocks of 8 rows at D = 2560: ~2.4 per H200 SM
XW = 20  # floats a word of x (or h) takes in threadgroup memory: 16 values, 4 of padding (no bank conflicts)
# the down launch stages every selected expert's h pre-scaled: K F / 16 words of XW + 1 floats
MAX_PAIRS = 448  # 37.6 KB of the 48 KB of threadgroup memory (seed shape: 360)
# the down step is moe_down_warps.py's (a warp per expert, h read as gate/up wrote it pre-scaled)
# where it applies, else DOWN (a warp per row, every expert's h staged in each block): H200 (ncu,
# seed shape, one token) 7.2 us against DOWN's 9.5
GATEUP_THREADS = THREADS  # threads a gate/up block (128: 4 warps of GATEUP_UNITS_PER_WARP units, twice the blocks)
# A lane's gate/up codes are single words (16-byte loads did not win on the H200: docs/perf.md),
# and one token's routed experts stay two launches (chaining them: 26.2 us of GPU time a layer
# against 20.7).

# The first routed block's extra work: the rule's weights (and the slots) and the shared
# expert's gate, after its arithmetic (that block ends ~1-2 us after the others, a softmax over E
# and four barriers; done right after its loads were issued, it did not win).
WEIGH = r"""
  if (bx == (uint32_t)NSB) {                  // block-uniform: the rule's weights, once
""" + routing.WEIGHING + r"""
    if (tid < (uint32_t)K) {
      sel[t * K + tid] = slot_base[0] + top[tid];
      wsel[t * K + tid] = topw[tid];
    }
  }
  if (GATED && bx == (uint32_t)NSB) {         // the shared expert's gate, sigmoid(gate_inp . x), once
    float gdot = 0.0f;
    for (uint32_t d = tid; d < (uint32_t)D; d += NT) gdot += F32(gate_inp[d]) * x[(uint64_t)t * D + d];
    gdot = warp_sum(gdot);
    BARRIER();                                // red's last reader (the weights just above) is done
    if (lane == 0) red[warp_id] = gdot;
    BARRIER();
    if (tid == 0) {
      float tot = 0.0f;
      for (int w = 0; w < NWR; ++w) tot += red[w];
      sgate_out[t * 8] = 1.0f / (1.0f + exp_f(-tot));
    }
  }
"""
GATEUP = r"""
  constexpr int NW = NT / 32;
  constexpr int WPR = D / 16;                 // uint32 words per gate/up row
  constexpr int WPL = (WPR + 31) / 32;        // words a lane
  constexpr int UPB = NW * UPW;               // hidden units a block
  SHARED float xsh[WPR * XW];                 // routed: x pre-scaled per code; shared: x
  SHARED float xsum[WPR];
  SHARED float hs[FCS];                       // shared blocks: their h chunk
  SHARED float hsb[UPB];                      // routed blocks: their units' h (the word sums)
""" + routing.RANKING + routing.SLOT_AT + r"""
  if (bx < (uint32_t)NSB) {                   // the shared expert's blocks (NSB = 0: none), block-uniform
    const uint32_t sb = bx;
""" + shared_kernel.SHARED_BLOCK + r"""
  } else {
  const uint32_t c = rb % NCH;
  const DEVICE uint8_t* rec = arena + (uint64_t)slot * (uint64_t)SLOT;  // 64-bit: arenas pass 4 GB
  // every gate/up load of the warp's UPW units first (nothing here depends on x)
  uint32_t gw[UPW][WPL], uw[UPW][WPL];        // a lane's words lane + 32 i
  half_t gd[UPW][WPL], ud[UPW][WPL];
  UNROLL for (int k = 0; k < UPW; ++k) {
    const uint64_t f = (uint64_t)c * UPB + warp_id * UPW + k;
    const DEVICE uint32_t* gq = (const DEVICE uint32_t*)(rec + GC + f * (D / 4));
    const DEVICE uint32_t* uq = (const DEVICE uint32_t*)(rec + UC + f * (D / 4));
    const DEVICE half_t* gs = (const DEVICE half_t*)(rec + GS) + f * (D / 32);
    const DEVICE half_t* us = (const DEVICE half_t*)(rec + US) + f * (D / 32);
    UNROLL for (int i = 0; i < WPL; ++i) {
      const int w = (int)lane + 32 * i;
      const int wc = w < WPR ? w : WPR - 1;  // past the row: its last word again (unused; no branch)
      gw[k][i] = gq[wc];
      uw[k][i] = uq[wc];
      gd[k][i] = gs[wc >> 1];
      ud[k][i] = us[wc >> 1];
    }
  }
  // x pre-scaled per code and each word's plain sum (moe.py's X_PRESCALE: the fused kernel's text)
""" + moe.X_PRESCALE + r"""  BARRIER();
  float ga[UPW], ua[UPW];
  UNROLL for (int k = 0; k < UPW; ++k) { ga[k] = 0.0f; ua[k] = 0.0f; }
  if (NA) {                                   // a diagnostic (no arithmetic): the loads kept, folded
    uint32_t fold = 0u;
    UNROLL for (int k = 0; k < UPW; ++k) {
      UNROLL for (int i = 0; i < WPL; ++i) fold ^= gw[k][i] ^ uw[k][i] ^ f16_bits(gd[k][i]) ^ f16_bits(ud[k][i]);
    }
    ga[0] = bits_f32(fold & 0x007FFFFFu) + xsum[lane % WPR];
  } else {
  UNROLL for (int i = 0; i < WPL; ++i) {
    const int w = (int)lane + 32 * i;
    if (w < WPR) {
      float xv[16];
      UNROLL for (int j = 0; j < 16; ++j) xv[j] = xsh[XW * w + j];
      const float xs = xsum[w];
      UNROLL for (int k = 0; k < UPW; ++k) {
        if (DN) {
          const uint32_t gh = gw[k][i] >> 22, uh = uw[k][i] >> 22;
          float gsum = 0.0f, usum = 0.0f;
          UNROLL for (int j = 0; j < 16; ++j) {
            gsum = fma_keep(q2_dn(j <= 10 ? gw[k][i] : gh, q2_shift(j)), xv[j], gsum);
            usum = fma_keep(q2_dn(j <= 10 ? uw[k][i] : uh, q2_shift(j)), xv[j], usum);
          }
          ga[k] += F32(gd[k][i]) * fma_keep(gsum, TWO64, -2.0f * xs);
          ua[k] += F32(ud[k][i]) * fma_keep(usum, TWO64, -2.0f * xs);
        } else {
          const uint32_t gl = q2_lo(gw[k][i]), gh = q2_hi(gw[k][i]), ul = q2_lo(uw[k][i]), uh = q2_hi(uw[k][i]);
          float gsum = 0.0f, usum = 0.0f;
          UNROLL for (int j = 0; j < 16; ++j) {
            gsum += q2_code(gl, gh, j) * xv[j];
            usum += q2_code(ul, uh, j) * xv[j];
          }
          ga[k] += F32(gd[k][i]) * (gsum - 2.0f * xs);
          ua[k] += F32(ud[k][i]) * (usum - 2.0f * xs);
        }
      }
    }
  }
  }
  UNROLL for (int k = 0; k < UPW; ++k) {
    const float g = warp_sum(ga[k]), u = warp_sum(ua[k]);
    const uint32_t f = c * UPB + warp_id * UPW + k;
    if (lane == 0) {
      const float hv = g / (1.0f + exp_f(-g)) * u;
      hid[((uint64_t)t * K + rank) * F + f] = hv;
      // h as the down step multiplies it: pre-scaled per code, and (below) each word's plain sum
      hpre[((uint64_t)t * K + rank) * F + f] = hv * (DN ? q2_scale_dn((int)(f % 16)) : q2_scale((int)(f % 16)));
      hsb[warp_id * UPW + k] = hv;
    }
  }
  if (UPB % 16 == 0) {                        // template-uniform: a block holds whole words of h
    BARRIER();
    if (tid < (uint32_t)(UPB / 16)) {
      float s = 0.0f;
      for (int j = 0; j < 16; ++j) s += hsb[16 * tid + j];  // in order: moe_decode DOWN's hsm, bit for bit
      hws[((uint64_t)t * K + rank) * (F / 16) + c * (UPB / 16) + tid] = s;
    }
  }
  {                                           // the weights, after the arithmetic
""" + WEIGH + r"""
  }
  }
"""

DOWN = r"""
  constexpr int NW = NT / 32;
  constexpr int WF = F / 16;                  // words of one expert's down row
  constexpr int NP = K * WF;                  // (expert, word) pairs of one output row
  constexpr int PPL = (NP + 31) / 32;         // pairs a lane
  constexpr int SPL = NSB > 0 ? (NSB + 31) / 32 : 1;  // shared partials a lane
  const uint32_t t = by;
  SHARED float hsh[NP * XW];                  // pair p's 16 h values, pre-scaled per code
  SHARED float hsm[NP];                       // ... and their plain sum
  SHARED float swt[K];
  const uint32_t r0 = (bx * NW + warp_id) * RW;
  // the warp's rows: every load first (the slots from L2, then codes and scales from the records)
  uint32_t dq[RW][PPL];
  half_t dsc[RW][PPL];
  float sp[RW][SPL];                          // the shared expert's partials of the warp's rows
  UNROLL for (int r = 0; r < RW; ++r) {
    const uint32_t d = r0 + r < (uint32_t)D ? r0 + r : (uint32_t)(D - 1);
    UNROLL for (int j = 0; j < SPL; ++j) {
      const int s = (int)lane + 32 * j;
      sp[r][j] = s < NSB ? sout[((uint64_t)t * NSB + s) * D + d] : 0.0f;
    }
  }
  UNROLL for (int j = 0; j < PPL; ++j) {
    const int p = (int)lane + 32 * j;
    const int pc = p < NP ? p : NP - 1;  // past the pairs: the last one again (unused; no branch)
    const int i = pc / WF, w = pc % WF;
    const DEVICE uint8_t* rec = arena + (uint64_t)sel[t * K + i] * (uint64_t)SLOT;
    UNROLL for (int r = 0; r < RW; ++r) {
      const uint64_t d = r0 + r < (uint32_t)D ? r0 + r : (uint32_t)(D - 1);  // past D: a real row, stored nowhere
      dq[r][j] = ((const DEVICE uint32_t*)(rec + DC + d * (F / 4)))[w];
      dsc[r][j] = ((const DEVICE half_t*)(rec + DS))[d * (F / 32) + (w >> 1)];
    }
  }
  for (uint32_t p = tid; p < (uint32_t)NP; p += NT) {
    const DEVICE float* hp = hid + ((uint64_t)t * K + p / WF) * F + 16 * (p % WF);
    float s = 0.0f;
    UNROLL for (int j = 0; j < 16; j += 4) {
      const f4 v = load_f4(hp + j);
      UNROLL for (int q = 0; q < 4; ++q) {
        hsh[XW * p + j + q] = v.v[q] * (DN ? q2_scale_dn(j + q) : q2_scale(j + q));
        s += v.v[q];
      }
    }
    hsm[p] = s;
  }
  if (tid < (uint32_t)K) swt[tid] = wsel[t * K + tid];
  BARRIER();
  UNROLL for (int r = 0; r < RW; ++r) {
    float acc = 0.0f;
    UNROLL for (int j = 0; j < PPL; ++j) {
      const int p = (int)lane + 32 * j;
      if (p < NP) {
        float dd = 0.0f;
        if (DN) {
          const uint32_t qw = dq[r][j], qh = qw >> 22;
          UNROLL for (int q = 0; q < 16; ++q) dd = fma_keep(q2_dn(q <= 10 ? qw : qh, q2_shift(q)), hsh[XW * p + q], dd);
          acc += swt[p / WF] * (F32(dsc[r][j]) * fma_keep(dd, TWO64, -2.0f * hsm[p]));
        } else {
          const uint32_t ql = q2_lo(dq[r][j]), qh = q2_hi(dq[r][j]);
          UNROLL for (int q = 0; q < 16; ++q) dd += q2_code(ql, qh, q) * hsh[XW * p + q];
          acc += swt[p / WF] * (F32(dsc[r][j]) * (dd - 2.0f * hsm[p]));
        }
      }
    }
    acc = warp_sum(acc);
    float ss = 0.0f;
    UNROLL for (int j = 0; j < SPL; ++j) ss += sp[r][j];
    ss = NSB > 0 ? warp_sum(ss) : 0.0f;
    const float sg = GATED ? gate_val[t * 8] : 1.0f;
    const uint32_t d = r0 + r;
    if (lane == 0 && d < (uint32_t)D) out[(uint64_t)t * D + d] = x_mid[(uint64_t)t * D + d] + (acc + ss * sg);
  }
"""

GATEUP_SOURCE = KernelSource("strata_moe_gateup", ("arena", "x", "z", "slot_base", "sgate", "sup", "sdown",
                                                  "gate_inp"),
                             ("hid", "sel", "wsel", "sout", "sgate_out", "hpre", "hws"), GATEUP, moe.HELPERS)
DOWN_SOURCE = KernelSource("strata_moe_down", ("arena", "x_mid", "hid", "sel", "wsel", "sout", "gate_val"), ("out",), DOWN,
                           moe.HELPERS)


class GateUp(NamedTuple):
    """The gate/up launch's outputs. hpre and hws: h as the down step multiplies it (each unit
    times its code's scale, moe.q2_scale_dn / q2_scale) and each 16-unit word's plain sum; hws is
    written where a block holds whole words (32 hidden units a block: the default)."""

    hid: mx.array  # float32 [T, k, F]
    sel: mx.array  # int32 [T, k]: slots
    wsel: mx.array  # float32 [T, k]: the rule's weights
    sout: mx.array  # float32 [T, max(NSB, 1), D]: the shared expert's partials
    sgate: mx.array  # float32 [T, 8]: element 0, the shared expert's gate
    hpre: mx.array  # float32 [T, k, F]
    hws: mx.array  # float32 [T, k, F / 16]


def applies(rec: RecordLayout, k: int, threads: int = THREADS, upw: int = GATEUP_UNITS_PER_WARP) -> bool:
    """Whether the two launches take these records: Q2_0 without biases, F a multiple of the
    block's hidden units (and of 32), D of 16 and at most moe.MAX_HIDDEN, h of the k experts in
    threadgroup memory (k F / 16 <= MAX_PAIRS)."""
    d, f = rec.hidden, rec.expert_ffn
    return (rec.qtype is QuantType.Q2_0 and not rec.biases and d % 16 == 0 and d <= moe.MAX_HIDDEN
            and f % 32 == 0 and f % ((threads // WARP) * upw) == 0 and k * (f // 16) <= MAX_PAIRS)


@functools.cache
def _planes(rec: RecordLayout) -> tuple[tuple[str, int], ...]:
    return (("D", rec.hidden), ("F", rec.expert_ffn), ("SLOT", rec.padded_bytes),
            ("GC", rec.codes("gate").offset), ("GS", rec.scales("gate").offset),
            ("UC", rec.codes("up").offset), ("US", rec.scales("up").offset),
            ("DC", rec.codes("down").offset), ("DS", rec.scales("down").offset), ("XW", XW))


def _shared_parts(rec: RecordLayout, shared) -> tuple[list, tuple, int]:
    """The shared expert's inputs (gate, up, down float16, gate_inp float16 or None), its template
    ints and block count (NSB = 0: none)."""
    if shared is None:
        none = absent(np.float16)
        return [none, none, none, none], (("FS", 8), ("FCS", 8), ("NSB", 0), ("GATED", 0)), 0
    gate, up, down, gate_inp = shared
    shared_kernel.check_hidden(rec.hidden)
    tpl = shared_kernel.template(gate.shape[0])
    gated = gate_inp is not None
    return ([gate, up, down, gate_inp if gated else absent(np.float16)], tpl + (("GATED", int(gated)),),
            dict(tpl)["NSB"])


def gateup(arena: mx.array, rec: RecordLayout, x: mx.array, z: mx.array, slot_base: int, k: int,
           order: RoutingOrder, norm_topk_prob: bool, *, shared=None, threads: int | None = None,
           upw: int | None = None, denormals: bool | None = None, rounds: routing.Ranking | bool | None = None,
           no_arithmetic: bool = False, unread: tuple[str, ...] = (), pack: bool = False):
    """Kernel path: rank z by the model's rule (moe.routes_on_kernel), the selected experts'
    hidden activations; with shared (gate, up, down, gate_inp or None: float16), the shared
    expert's blocks in the same grid (its down partials and its gate). denormals: the code form
    (default moe.subnormal_codes()); rounds: how the top k is found (decode_routing.Ranking;
    default decode_routing.RANK_FORM, LOOP where BITONIC would take k > 32; a bool: LOOP or ROUNDS);
    no_arithmetic: a diagnostic (the loads and their chain only; hid is not h); unread: names of
    `GateUp` fields the caller will not read (None there: they share one buffer, launch's fold);
    pack: every field in that one buffer, a `folded_outputs.Region` each, for the down step's
    launch to read (`routed_residual`).

    Shapes:
        x float32 [T, D], z float32 [T, E] -> hid float32 [T, k, F], sel int32 [T, k], wsel float32 [T, k],
        sout float32 [T, max(NSB, 1), D] (shared partials), sgate_out float32 [T, 8] (element 0: the gate),
        hpre float32 [T, k, F], hws float32 [T, k, F / 16] (`GateUp`)
    """
    t, e = z.shape
    upw = GATEUP_UNITS_PER_WARP if upw is None else upw  # read per call: the benchmarks switch them
    threads = GATEUP_THREADS if threads is None else threads
    if not applies(rec, k, threads, upw):
        raise ValueError(f"moe_decode: records {rec} with k={k} do not fit the decode launches (applies)")
    dn = moe.subnormal_codes() if denormals is None else denormals
    nch = rec.expert_ffn // ((threads // WARP) * upw)
    sh_inputs, sh_template, nsb = _shared_parts(rec, shared)
    ranking = _ranking(rounds, k)
    template = _planes(rec) + (("K", k), ("E", e), ("NCH", nch), ("UPW", upw), ("NT", threads), ("DN", int(dn)),
                               ("ORDER", 0 if order is RoutingOrder.SOFTMAX_TOPK else 1),
                               ("NORM", int(norm_topk_prob)),
                               ("ROUNDS", int(ranking)),
                               ("NA", int(no_arithmetic))) + sh_template
    f = rec.expert_ffn
    x, z = (a if isinstance(a, Region) else as_f32(a) for a in (x, z))  # a Region: float32 by construction
    one = LaunchSpec(GATEUP_SOURCE, tuple([arena, x, z, index_const(slot_base)] + sh_inputs),
                     ((t, k, f), (t, k), (t, k), (t, max(nsb, 1), rec.hidden), (t, 8), (t, k, f), (t, k, f // 16)),
                     (mx.float32, mx.int32, mx.float32, mx.float32, mx.float32, mx.float32, mx.float32),
                     (nsb + k * nch, t, 1), threads, template,
                     tuple(range(len(GateUp._fields))) if pack else tuple(GateUp._fields.index(n) for n in unread),
                     pack)
    return GateUp(*run(one))


def _ranking(rounds, k: int) -> routing.Ranking:
    """The ranking form: the default's BITONIC sorts a warp's 32 logits and keeps its top k, so it
    needs k <= 32 (else LOOP); asked for explicitly with a larger k, a ValueError."""
    if rounds is None:
        form = routing.RANK_FORM
        return routing.Ranking.LOOP if form is routing.Ranking.BITONIC and k > routing.WARP_TOPK_MAX else form
    form = routing.Ranking(int(rounds))
    if form is routing.Ranking.BITONIC and k > routing.WARP_TOPK_MAX:
        raise ValueError(f"moe_decode: the bitonic ranking keeps a warp's top {routing.WARP_TOPK_MAX}, not {k}")
    return form


def down(arena: mx.array, rec: RecordLayout, x_mid: mx.array, hid: mx.array, sel: mx.array, wsel: mx.array,
         sout: mx.array | None = None, sgate: mx.array | None = None, *, threads: int = THREADS,
         rw: int = DOWN_ROWS_PER_WARP, denormals: bool | None = None) -> mx.array:
    """Kernel path: x_mid + (sum_i wsel_i down_i . hid_i + sgate * sum of the shared partials).
    sout None: no shared expert; sgate None: ungated.

    Shapes:
        x_mid float32 [T, D], hid float32 [T, k, F], sel int32 [T, k], wsel float32 [T, k],
        sout float32 [T, NSB, D], sgate float32 [T, 8] -> float32 [T, D]
    """
    t, k, _ = hid.shape
    dn = moe.subnormal_codes() if denormals is None else denormals
    rows = (threads // WARP) * rw
    nsb = 0 if sout is None else sout.shape[1]
    none = absent(np.float32)
    template = _planes(rec) + (("K", k), ("RW", rw), ("NT", threads), ("DN", int(dn)), ("NSB", nsb),
                               ("GATED", int(sgate is not None and nsb > 0)))
    return launch(DOWN_SOURCE, [arena, as_f32(x_mid), hid, sel, wsel, none if sout is None else sout,
                                none if sgate is None else sgate], [(t, rec.hidden)], [mx.float32],
                  blocks=((rec.hidden + rows - 1) // rows, t, 1), threads=threads, template=template)[0]


def routed_residual(arena: mx.array, rec: RecordLayout, x_mid: mx.array, h: mx.array, z: mx.array, slot_base: int,
                    k: int, order: RoutingOrder, norm_topk_prob: bool, *, shared=None, **kw) -> mx.array:
    """Kernel path: x_mid + the routed experts of h, routed by z, (+ the shared expert of h, gated)
    in two launches. shared: (gate, up, down, gate_inp or None), float16. kw: `gateup`'s threads /
    upw / denormals / rounds, `down`'s rw, down_rows moe_down_warps' rows a block (benchmarks).

    Where moe_down_warps' down step applies, the gate/up launch writes every output into one
    folded buffer (`pack`) and the down step reads them from it as one input: each output and input
    is MLX host work (on the H200 a token's host share went 2.37 -> 2.11 ms, peers.py's decode at 8
    2.81 -> 2.48 ms). h and z may be `Region`s of the attention launch's buffer (handed on, the
    same way): gate/up reads them from it.

    Shapes:
        x_mid float32 [T, D], h float32 [T, D], z float32 [T, E] -> float32 [T, D]
    """
    rw = kw.pop("rw", DOWN_ROWS_PER_WARP)
    rows = kw.pop("down_rows", down_warps.ROWS)
    has, gated = shared is not None, shared is not None and shared[3] is not None
    units = ((kw.get("threads") or GATEUP_THREADS) // WARP) * (kw.get("upw") or GATEUP_UNITS_PER_WARP)
    in_warps = units % 16 == 0 and down_warps.applies(rec, k, rows)  # hws: whole words of h a block
    # the outputs the down step will not read: one buffer for them (launch's fold)
    unread = (("hid",) if in_warps else ("hpre", "hws")) + (() if has else ("sout",)) + (() if gated else ("sgate",))
    g = gateup(arena, rec, h, z, slot_base, k, order, norm_topk_prob, shared=shared, unread=unread, pack=in_warps,
               **kw)
    sout, sgate = (g.sout if has else None), (g.sgate if gated else None)
    if in_warps:
        return down_warps.down(arena, rec, x_mid, g.hpre, g.hws, g.sel, g.wsel, sout, sgate, rows=rows,
                               denormals=kw.get("denormals"))
    return down(arena, rec, x_mid, g.hid, g.sel, g.wsel, sout, sgate, threads=kw.get("threads", THREADS), rw=rw,
                denormals=kw.get("denormals"))
