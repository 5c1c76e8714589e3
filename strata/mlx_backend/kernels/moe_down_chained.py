"""A decoded token's down step as the second phase of one launch with its gate/up step
(phases.chain_all): moe_down_warps.py's sums, in the gate/up launch's block shape, its loads
issued before it waits for the gate/up blocks.

Why: at one token the routed experts are two launches a layer (moe_decode.py's gate/up, then
moe_down_warps.py's down with the residual), and on the H200 each launch costs ~3.5 us of GPU
time at the kernel boundary and ~12 us of host dispatch (docs/perf.md: a decoded token is bound by
the host on one machine, by the GPU's time at 146 boundaries on another).
Chained, a layer is 2 launches instead of 3 (the QKV GEMV + attention + router chain, then this):
98 a token instead of 146 at the seed shape (48 layers, plus the embedding and the head).

What the phase does, against moe_down_warps' launch (whose text it is, cut where it says: an edit
there that moves a cut fails at import):

- threads: every block of a chain has the same threads, so the down blocks take the gate/up
  blocks' 256 (8 warps) where moe_down_warps gives a warp an expert (32 K: 320 at K = 10). Warp w
  takes experts w, w + 8, ... (at K = 10 warps 0 and 1 two, the others one); each expert's row
  sums are moe_down_warps' (the same lanes, words, shuffles and text), written to the same
  part_r / part_s places, and the row threads add them in rank order as there: the output is bit
  for bit the two launches'.
- slots: a down block ranks z itself (decode_routing.RANKING, the form the gate/up blocks rank
  by: the same top k), so it reads slot_base + top[i] where moe_down_warps reads the gate/up
  launch's sel (or reads the top k ranked once, where the gate/up launch does: Ranking.GIVEN),
  and its code and scale loads (14.4 KB a block, 4.6 MB in all at the seed shape)
  go out *before* it waits for the gate/up blocks' count. Only
  what the gate/up blocks write waits (`WAIT_AT`): h as hpre / hws, the rule's weights wsel,
  the shared expert's partials and gate.

Predicted at the seed shape (D 2560, F 576, K 10, E 256; one token): 360 gate/up blocks then 320
down blocks of 256 threads. The down blocks' ranking costs ~1.7K warp instructions a block
(0.55M in all, against the gate/up blocks' ~5.6M), in the shadow of the gate/up phase; the down
blocks that start while gate/up blocks run hold their codes and wait; the rest start as gate/up
blocks end, without the ~3.5 us boundary. So ~2-4 us of GPU time a layer less than the two
launches' ~21.5 (ncu: gate/up 14.3, down 7.2) and one host dispatch less: ~0.6 ms a token of host
time at ~12 us a launch. Registers: a phase's live values are its own, so the chained kernel takes
about the more of the two (gate/up alone 70; the down phase holds 2 experts' codes, 2 x 9 words and
9 scales a lane, across the wait): nvcc sm_90 gives 67 a thread, 17.3 KB
of shared memory (both phases' arrays), 3 blocks an SM as the gate/up launch alone
(benchmarks/ptxas_regs.py). The down phase so runs 24 warps an SM where moe_down_warps ran 40 (4
blocks of 10): fewer loads in flight to hide its DRAM round trip, which its early loads cover.

Measured on the H200 (ncu, a decoded token of a 4-layer seed-shape model, docs/perf.md): the
chained launch 26.2 us a layer against 13.2 + 7.5 for the two launches: 5.6 us *more*, not 2-4
less. Most down blocks start only as gate/up blocks leave (the 360 gate/up blocks hold 360 of
the 396 block slots at 3 an SM), so their ranking and their loads' round trip come after the
gate/up phase instead of in its shadow, at 24 warps an SM. In the graph (host_cost.py, 98 launches
a token against 146) 3.97 ms a token against 3.70-4.52 for the default on one host, and slower in
decode_context.py's rows: so CHAIN_EXPERTS stays off.

Shapes (one token):
    arena uint8 [S, SLOT], z float32 [1, E], x_mid float32 [1, D], and from the gate/up phase
    hpre float32 [1, K, F], hws float32 [1, K, F/16], wsel float32 [1, K], sout float32 [1, NSB, D],
    gate_val float32 [1, 8] -> out float32 [1, D]
Grid: D / RB blocks of NT threads (NT: the gate/up phase's).
"""

from __future__ import annotations

import mlx.core as mx

from strata.formats.expert_record import RecordLayout
from strata.mlx_backend.kernels import decode_routing as routing
from strata.mlx_backend.kernels import moe
from strata.mlx_backend.kernels import moe_down_warps as down_warps
from strata.mlx_backend.kernels.launch import as_f32
from strata.mlx_backend.kernels.phases import LaunchSpec, Pending
from strata.mlx_backend.kernels.preludes import WARP
from strata.mlx_backend.kernels.source import KernelSource


def _cut(text: str, start: str, end: str | None, what: str) -> str:
    """text from its one `start` to its one `end` (None: to the end); an AssertionError naming
    `what` where either is missing or repeated."""
    for mark in (start, end):
        if mark is not None and text.count(mark) != 1:
            raise AssertionError(f"moe_down_chained: {what} no longer has exactly one {mark.strip()!r}")
    return text[text.index(start):] if end is None else text[text.index(start):text.index(end)]


def _drop(text: str, line: str, what: str) -> str:
    """text without its one `line`; an AssertionError naming `what` where it is missing or repeated."""
    if text.count(line) != 1:
        raise AssertionError(f"moe_down_chained: {what} no longer has exactly one {line.strip()!r}")
    return text.replace(line, "")


_WARPS = down_warps.BODY
_EXPERT_LINE = "  const uint32_t t = by, i = warp_id;\n"  # moe_down_warps: warp i is expert i
_REC_LINE = "  const DEVICE uint8_t* rec = arena + (uint64_t)sel[t * K + i] * (uint64_t)SLOT;\n"
# moe_down_warps' pieces: its sizes and threadgroup arrays; a lane's row and piece; the loads of
# an expert row's codes and scales (into q, sc); the shared partials, h and the row sums (into
# part_r, part_s); the row threads' sums over experts. Left out: the expert of a warp, the slot
# from sel and the q / sc arrays (here one per expert of the warp)
SIZES = _cut(_WARPS, "  constexpr int WF = ", _EXPERT_LINE, "moe_down_warps.BODY")
LANE = _cut(_WARPS, "  const uint32_t row = ", _REC_LINE, "moe_down_warps.BODY")
ROW_LOADS = _cut(_WARPS, "  const DEVICE uint32_t* qrow = ", "  float sp[SPW];\n", "moe_down_warps.BODY")
ROW_SUMS = _cut(_WARPS, "  float sp[SPW];\n", "  BARRIER();\n", "moe_down_warps.BODY")
EXPERT_SUMS = _cut(_WARPS, "  BARRIER();\n", None, "moe_down_warps.BODY")
if "hpre" in ROW_LOADS or "wsel" in ROW_LOADS or "sout" in ROW_LOADS:
    raise AssertionError("moe_down_chained: moe_down_warps' code loads read what the gate/up phase writes")

# the gate/up blocks' ranking, without their own block's rank and slot (rb, rank: gate/up units)
_ROUTED_BLOCK = "  const uint32_t rb = bx >= (uint32_t)NSB ? bx - NSB : 0u;  // routed block (shared blocks come first)\n"
RANKING = _drop(_drop(routing.RANKING, _ROUTED_BLOCK, "decode_routing.RANKING"), "  const uint32_t rank = rb / NCH;\n",
                "decode_routing.RANKING")

BEFORE_WAIT = SIZES + RANKING + LANE + r"""
  constexpr int NWD = NT / 32;                // warps a block
  constexpr int EPW = (K + NWD - 1) / NWD;    // experts a warp: warp_id, warp_id + NWD, ...
  // every code and scale load of the warp's experts first: the slots come from this block's
  // ranking, so none of this waits for the gate/up phase
  uint32_t q_of[EPW][WPN];
  half_t sc_of[EPW][WPN];
  UNROLL for (int ie = 0; ie < EPW; ++ie) {
    const uint32_t i = warp_id + (uint32_t)(NWD * ie);
    if (i < (uint32_t)K) {                    // warp-uniform
      const DEVICE uint8_t* rec = arena + (uint64_t)(slot_base[0] + top[i]) * (uint64_t)SLOT;  // the gate/up sel[i]
      uint32_t (&q)[WPN] = q_of[ie];
      half_t (&sc)[WPN] = sc_of[ie];
""" + ROW_LOADS + r"""
    }
  }
"""
# where the phase first reads what the gate/up phase writes (the shared partials, then h): the
# chain's wait goes here
WAIT_AT = len(BEFORE_WAIT)
BODY = BEFORE_WAIT + r"""
  UNROLL for (int ie = 0; ie < EPW; ++ie) {
    const uint32_t i = warp_id + (uint32_t)(NWD * ie);
    if (i < (uint32_t)K) {                    // warp-uniform: the shuffles below see the whole warp
      const uint32_t (&q)[WPN] = q_of[ie];
      const half_t (&sc)[WPN] = sc_of[ie];
""" + ROW_SUMS + r"""
    }
  }
""" + EXPERT_SUMS

SOURCE = KernelSource("strata_moe_down_chained",
                      ("arena", "z", "slot_base", "given", "x_mid", "hpre", "hws", "wsel", "sout", "gate_val"),
                      ("out",),
                      BODY, moe.HELPERS, metal=False)
# what the phase reads from the gate/up phase: its input -> the gate/up launch's output
FROM_GATEUP = {"hpre": "hpre", "hws": "hws", "wsel": "wsel", "sout": "sout", "gate_val": "sgate_out"}


def applies(rec: RecordLayout, k: int, rows: int, threads: int) -> bool:
    """Whether this phase takes the records at `threads` a block: moe_down_warps' conditions (it
    runs its sums), whole warps."""
    return down_warps.applies(rec, k, rows) and threads % WARP == 0 and threads >= WARP


def down_phase(gateup: LaunchSpec, rec: RecordLayout, x_mid: mx.array, k: int, *, rows: int = down_warps.ROWS,
               vector_loads: bool | None = None, made: dict[str, mx.array] | None = None) -> LaunchSpec:
    """The down phase's `LaunchSpec` after the gate/up launch `gateup` (moe_decode.gateup's
    spec=True, one token): the arena, z, slot base and given top k it ranks and reads by, its
    threads, code form (DN), ranking form (ROUNDS) and shared blocks (NSB, GATED) are the gate/up
    launch's; what it reads from that phase (FROM_GATEUP) is a `Pending` there, for the chain's
    links, or, with `made` (the gate/up launch's outputs by name, already launched), those arrays:
    then the phase waits for nothing and may lead another chain (moe_decode.DeferredDown). rows,
    vector_loads: as moe_down_warps.down.

    Shapes:
        x_mid float32 [1, D] -> out float32 [1, D]
    """
    g = dict(gateup.template)
    args = dict(zip(gateup.src.inputs, gateup.inputs))
    made_shapes = dict(zip(gateup.src.outputs, zip(gateup.output_shapes, gateup.output_dtypes)))
    t, nt = x_mid.shape[0], gateup.threads
    if t != 1 or gateup.blocks[1] != 1 or not applies(rec, k, rows, nt):
        raise ValueError(f"moe_down_chained: records {rec} with k={k}, {rows} rows a block, {nt} threads, "
                         f"{t} tokens do not fit (applies, one token)")
    template = (("D", rec.hidden), ("F", rec.expert_ffn), ("SLOT", rec.padded_bytes), ("DC", rec.codes("down").offset),
                ("DS", rec.scales("down").offset), ("K", k), ("RB", rows), ("DN", g["DN"]), ("NSB", g["NSB"]),
                ("GATED", g["GATED"]), ("VL", int(down_warps.VECTOR_LOADS if vector_loads is None else vector_loads)),
                ("E", g["E"]), ("ROUNDS", g["ROUNDS"]), ("NT", nt))
    values = {"arena": args["arena"], "z": args["z"], "slot_base": args["slot_base"], "given": args["given"],
              "x_mid": as_f32(x_mid),
              **{c: Pending(*made_shapes[out]) if made is None else made[out] for c, out in FROM_GATEUP.items()}}
    return LaunchSpec(SOURCE, tuple(values[n] for n in SOURCE.inputs), ((t, rec.hidden),), (mx.float32,),
                      (rec.hidden // rows, t, 1), nt, template)
