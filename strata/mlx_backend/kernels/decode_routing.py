"""The routing preamble (moe.ROUTE_PREAMBLE: the top k of the logits by the model's rule, ties to
the lower id, and the rule's weights) as the decode launches take it (kernels/moe_decode.py): cut
into its ranking, which every block needs before its loads (its rank's slot), and its weighing,
which only the block that writes the weights runs; the ranking by the preamble's count loop or by
argmax rounds (RANK_ROUNDS, a template switch: ROUNDS). The text is moe.py's, cut where it says;
an edit there that moves the cuts fails at import.
"""

from __future__ import annotations

from strata.mlx_backend.kernels import moe

# The top k by K rounds of a block-wide argmax (the largest z, ties to the lower id: the order the
# fused kernel's ranking gives) instead of every thread ranking its logit against all E: at E =
# 256 that loop is ~1.5K instructions a thread, ~1.7 us of issue a block at 1.4 blocks an SM
# (180 blocks), against ~40 a round here (two warp reductions, two barriers). RANK_ROUNDS: the
# form the gate/up launch takes (the benchmarks time both).
RANK_ROUNDS = False
ROUNDS_OR_LOOP = r"""
  SHARED float cand_v[NT / 32];
  SHARED int32_t cand_i[NT / 32];
  if (ROUNDS) {
    constexpr int EJ = (E + NT - 1) / NT;     // logits a thread
    const float minus_inf = -bits_f32(0x7F800000u);
    bool taken[EJ];
    UNROLL for (int j = 0; j < EJ; ++j) taken[j] = false;
    for (int r = 0; r < K; ++r) {
      float bv = minus_inf;
      int32_t bi = E;                         // E: no candidate
      UNROLL for (int j = 0; j < EJ; ++j) {
        const int32_t e = (int32_t)tid + NT * j;
        if (e < E && !taken[j] && (bi == E || zs[e] > bv)) { bv = zs[e]; bi = e; }  // ascending e: ties keep the lower
      }
      const float wm = warp_max(bv);
      const float wi = warp_max(bi < E && bv == wm ? -(float)bi : -(float)(2 * E));  // the lowest id holding it
      if (lane == 0) { cand_v[warp_id] = wm; cand_i[warp_id] = (int32_t)(-wi); }
      BARRIER();
      float best = cand_v[0];
      int32_t bid = cand_i[0];
      for (int w = 1; w < NT / 32; ++w) {
        const int32_t ci = cand_i[w];
        if (ci < E && (bid >= E || cand_v[w] > best || (cand_v[w] == best && ci < bid))) { best = cand_v[w]; bid = ci; }
      }
      if (tid == 0) top[r] = bid;
      UNROLL for (int j = 0; j < EJ; ++j) if ((int32_t)tid + NT * j == bid) taken[j] = true;
      BARRIER();                              // cand_v / cand_i are written again next round
    }
  } else {
""" + moe.RANK_LOOP.lstrip("\n") + r"""
  }
"""
RANK_LOOP_TEXT = moe.RANK_LOOP.lstrip("\n")  # as ROUTE_PREAMBLE holds it
if moe.ROUTE_PREAMBLE.count(RANK_LOOP_TEXT) != 1:
    raise AssertionError("decode_routing: moe.ROUTE_PREAMBLE no longer has its ranking loop")
PREAMBLE = moe.ROUTE_PREAMBLE.replace(RANK_LOOP_TEXT, ROUNDS_OR_LOOP)
# The preamble's two parts: the ranking (every block: its rank's slot) and the rule's weights,
# which the gate/up launch does not use (the down launch applies them): only the block that writes
# them computes them, after its loads are issued, so no block's loads wait on the softmax.
WEIGHTS_AT = "  const float zmax = zs[top[0]];\n"
SLOT_AT = "  const int32_t slot = slot_base[0] + top[rank];\n"
if PREAMBLE.count(WEIGHTS_AT) != 1 or PREAMBLE.count(SLOT_AT) != 1:
    raise AssertionError("decode_routing: moe.ROUTE_PREAMBLE no longer ranks, then weighs, then picks the slot")
RANKING = PREAMBLE[:PREAMBLE.index(WEIGHTS_AT)]
WEIGHING = PREAMBLE[PREAMBLE.index(WEIGHTS_AT):PREAMBLE.index(SLOT_AT)]

