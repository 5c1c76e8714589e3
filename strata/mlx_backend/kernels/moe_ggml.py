"""The fused routed-expert kernel for llama.cpp's types kept as stored (Q4_K, Q5_K, Q6_K, Q3_K, Q2_K,
Q8_0, Q5_1, Q5_0, IQ4_NL, IQ4_XS, IQ3_S, IQ2_XXS and ggml's MXFP4: kernels/ggml_dot.py), read straight out of the arena
by slot index, each projection in its own type (a record's gate, up and down types are template
ints: unsloth's mixes put Q5_1 or IQ4_NL downs under Q4_K or IQ3_S gate/ups, and llama.cpp's
quantizer itself falls back to Q5_0 / Q5_1 / Q8_0 / IQ4_NL for rows that are not whole 256-weight
super-blocks, like a 576- or 640-wide down).

The work split is the Q2_0 kernel's (kernels/moe.py): block (rank i, chunk c, token t) computes FC
= 32 hidden units of one selected expert, h = silu(gate . x) * (up . x), and its share of the down
projection, a partial [D] output the combine kernel sums in a fixed order. Its preambles (host
slots, routing on the device) and the shared expert's blocks are moe.py's, unchanged.

Reads: gate/up: a warp per row, lane l taking the row's 32-weight groups l, l + 32, ... (8
consecutive lanes share one 256-weight super-block: a warp reads 4 super-blocks' contiguous bytes
per step); x in threadgroup memory. Down: a thread per output row, its chunk's one 32-weight group
(FC = 32), h in threadgroup memory (every lane reads the same address: a broadcast). Each group's
sum is `gg_dot32` (kernels/ggml_dot.py), the same decoder the dense GEMV reads.

Not measured on a GPU yet: its share of copy bandwidth is what benchmarks/kernels.py
--expert-type reports (docs/perf.md).

Shapes:
    arena uint8 [S, SLOT], x float32 [T, D] -> partials float32 [T, k*NCH, D]
"""

from __future__ import annotations

import functools

import mlx.core as mx

from strata.errors import ConfigError
from strata.formats.expert_record import PROJECTIONS, RecordLayout
from strata.mlx_backend.kernels import ggml_dot, moe
from strata.mlx_backend.kernels.launch import as_f32, index_const
from strata.mlx_backend.kernels.source import KernelSource
from strata.model_config import RoutingOrder

TYPES = frozenset(ggml_dot.TYPES)
FC = 32  # hidden units per block: one group of every down row
THREADS = 256
MAX_HIDDEN = moe.MAX_HIDDEN  # x in threadgroup memory: D floats (32 KB at 8192)
PREFIX = {"gate": "G", "up": "U", "down": "D"}
DOWN_ROWS = 4  # down rows a thread has in flight (ptxas, sm_90: 4 keeps every type under 128 registers)


def supports(rec: RecordLayout) -> str | None:
    """Why the kernel cannot run these records (None: it can)."""
    if missing := sorted({q.name for q in rec.qtypes if q not in TYPES}):
        return f"no ggml expert kernel for {', '.join(missing)}"
    if rec.biases:
        return "expert biases (the ggml kernel computes the plain SwiGLU)"
    if rec.expert_ffn % FC or rec.hidden % ggml_dot.GROUP:
        return f"hidden {rec.hidden} / expert_ffn {rec.expert_ffn} not multiples of {FC}"
    if rec.hidden > MAX_HIDDEN:
        return f"hidden {rec.hidden} over {MAX_HIDDEN} (x in threadgroup memory)"
    return None


BODY = r"""
  constexpr int NW = NT / 32;
  constexpr int GPR = D / 32;                 // 32-weight groups of a gate/up row
  constexpr int GPL = (GPR + 31) / 32;        // lane steps over a row's groups
  constexpr int RPW = (FC + NW - 1) / NW;     // gate/up rows per warp
  constexpr int GPC = FC / 32;                // groups of a down row in this chunk
  constexpr int DPT = (D + NT - 1) / NT;      // down rows per thread
  constexpr int DB = DPT < DOWN_ROWS ? DPT : DOWN_ROWS;  // down rows in flight
  const uint32_t c = rb % NCH;                // chunk of FC hidden units
  const bool live = slot >= 0;
  const DEVICE uint8_t* rec = arena + (uint64_t)(live ? slot : 0) * (uint64_t)SLOT;  // 64-bit: arenas pass 4 GB
  for (uint32_t d = tid; d < (uint32_t)D; d += NT) xsh[d] = x[(uint64_t)t * D + d];
  BARRIER();
  // gate/up: the lane steps outside, the warp's RPW rows inside, both unrolled, so a step's 2 RPW
  // groups are independent work whose loads can all be in flight (a loop over a row's groups
  // inside a loop over rows waits for memory once per row and step)
  float ga[RPW], ua[RPW];
  UNROLL for (int rr = 0; rr < RPW; ++rr) { ga[rr] = 0.0f; ua[rr] = 0.0f; }
  UNROLL for (int s = 0; s < GPL; ++s) {
    const int i = (int)lane + 32 * s;
    if (live && i < GPR) {
      UNROLL for (int rr = 0; rr < RPW; ++rr) {
        const int r = (int)warp_id + NW * rr;
        if (r < FC) {
          const uint64_t f = (uint64_t)c * FC + r;
          ga[rr] += gg_dot32(GTY, GBB, rec + GCO + f * GRB, rec + GSO + f * GSR, i, xsh + 32 * i, tables);
          ua[rr] += gg_dot32(UTY, UBB, rec + UCO + f * URB, rec + USO + f * USR, i, xsh + 32 * i, tables);
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
  // down: thread d takes rows d, d + NT, ...; DB of them unrolled at a time (their loads in flight)
  DEVICE float* dst = out + ((uint64_t)t * (K * NCH) + rb) * D;
  for (int i0 = 0; i0 < DPT; i0 += DB) {
    UNROLL for (int b = 0; b < DB; ++b) {
      const uint32_t d = tid + NT * (uint32_t)(i0 + b);
      if (i0 + b < DPT && d < (uint32_t)D) {
        float acc = 0.0f;
        if (live) {
          const DEVICE uint8_t* dr = rec + DCO + (uint64_t)d * DRB;
          const DEVICE uint8_t* ds = rec + DSO + (uint64_t)d * DSR;
          UNROLL for (int q = 0; q < GPC; ++q) acc += gg_dot32(DTY, DBB, dr, ds, (int)c * GPC + q, hs + 32 * q, tables);
        }
        dst[d] = wt * acc;
      }
    }
  }
"""
DECLS = r"""
  SHARED float hs[HSN];
  SHARED float xsh[D];  // routed blocks and shared blocks alike: token t's x
"""
BRANCH = moe.BRANCH.replace(moe.COMMON, BODY)
assert BRANCH != moe.BRANCH
SLOTS_SOURCE = KernelSource("strata_moe_ggml_slots", ("arena", "x", "slots", "weights", "tables") + moe.INPUTS_SHARED,
                            ("out", "sout"), moe.SLOTS_PREAMBLE + DECLS + BRANCH, ggml_dot.HELPERS)
ROUTE_SOURCE = KernelSource("strata_moe_ggml_route", ("arena", "x", "z", "slot_base", "tables") + moe.INPUTS_SHARED,
                            ("out", "sout"), moe.ROUTE_PREAMBLE + DECLS + BRANCH, ggml_dot.HELPERS)


@functools.cache
def _template(rec: RecordLayout, k: int, slot_bytes: int) -> tuple[tuple[str, int], ...]:
    """slot_bytes: the arena's stride, the largest layer's record where a file's layers differ."""
    if (why := supports(rec)) is not None:
        raise ValueError(f"fused ggml experts: {why}")
    ints = []
    for proj in PROJECTIONS:
        rows, cols = rec.shape(proj)
        q = rec.qtype_of(proj)
        p = PREFIX[proj]
        ints += ggml_dot.projection_ints(p, q, cols, rec.codes(proj).offset, rec.scales(proj).offset)
    return (("D", rec.hidden), ("F", rec.expert_ffn), ("FC", FC), ("NCH", rec.expert_ffn // FC), ("K", k),
            ("SLOT", slot_bytes), ("NT", THREADS), ("DOWN_ROWS", DOWN_ROWS), *ints)


def moe_slots(arena: mx.array, rec: RecordLayout, x: mx.array, slots, weights, *, shared=None):
    """Kernel path, host-chosen slots (moe.moe_slots for llama.cpp's types). x [T, D], slots int
    [T, k] (-1 skip), weights [T, k] -> partials float32 [T, k * F/32, D]; with shared (gate, up,
    down float16), (routed partials, shared partials [T, Fs/FCS, D]) from one launch."""
    t, k = slots.shape
    slots, weights = moe.slot_inputs(slots, weights)
    out, sout = moe._launch(SLOTS_SOURCE, rec, [arena, as_f32(x), slots, weights, ggml_dot.tables()], t, k, FC,
                            _template(rec, k, arena.shape[1]), shared, THREADS)
    return out if shared is None else (out, sout)


def moe_route(arena: mx.array, rec: RecordLayout, x: mx.array, z: mx.array, slot_base: int, k: int,
              order: RoutingOrder, norm_topk_prob: bool, *, shared=None):
    """Kernel path, routing on the GPU (moe.moe_route for llama.cpp's types; every expert resident
    at slot_base + e). x [T, D], z [T, E] -> partials float32 [T, k * F/32, D] (with shared: a pair)."""
    if order not in (RoutingOrder.SOFTMAX_TOPK, RoutingOrder.TOPK_SOFTMAX):
        raise ConfigError(f"moe_route: the routing kernel has no rule {order.value} (route with routing.select_device)")
    e = z.shape[1]
    routing = (("E", e), ("ORDER", 0 if order is RoutingOrder.SOFTMAX_TOPK else 1), ("NORM", int(norm_topk_prob)))
    out, sout = moe._launch(ROUTE_SOURCE, rec, [arena, as_f32(x), as_f32(z), index_const(slot_base), ggml_dot.tables()],
                            x.shape[0], k,
                            FC, _template(rec, k, arena.shape[1]) + routing, shared, THREADS)
    return out if shared is None else (out, sout)
