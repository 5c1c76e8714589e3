"""The routing preamble (moe.ROUTE_PREAMBLE: the top k of the logits by the model's rule, ties to
the lower id, and the rule's weights) as the decode launches take it (kernels/moe_decode.py): cut
into its ranking, which every block needs before its loads (its rank's slot), and its weighing,
which only the block that writes the weights runs; the ranking by the preamble's count loop, by
argmax rounds or by warp sorts (`Ranking`, the template int ROUNDS; RANK_FORM the default). The text is moe.py's, cut where it says;
an edit there that moves the cuts fails at import.
"""

from __future__ import annotations

import enum

from strata.mlx_backend.kernels import moe


class Ranking(enum.IntEnum):
    """How a decode launch's block finds the top k (the template int ROUNDS)."""

    LOOP = 0  # moe.RANK_LOOP: each thread counts the logits ahead of its own (E compares a thread)
    ROUNDS = 1  # K rounds of a block-wide argmax (two warp reductions, two barriers a round)
    BITONIC = 2  # each warp sorts 32 logits by shuffles; the warps' top k merged by one count
    NONE = 3  # a diagnostic, not a routing: the first k experts, no ranking (what the ranking costs)


# Ranking.ROUNDS: the top k by K rounds of a block-wide argmax (the largest z, ties to the lower
# id: the order the fused kernel's ranking gives) instead of every thread ranking its logit against
# all E: at E = 256 that loop is ~1.5K instructions a thread, ~1.7 us of issue a block at 1.4
# blocks an SM (180 blocks), against ~40 a round here (two warp reductions, two barriers). H200
# (ncu, gate/up at the seed shape): 15.4 us against the loop's 17.2.
# Ranking.BITONIC: the same top k with ~1/7 of the loop's instructions and no per-round barriers.
# At E = 256 and K = 10: each of 8 warps sorts its 32 logits (value descending, ties to the lower
# id) in 15 xor-shuffle steps (~35 cycles each: ~0.3 us, ~120 instructions a lane), writes its
# top K (80 candidates), one barrier, then each of 80 threads counts the candidates ahead of its
# own (80 compares): ~1.7K warp instructions a block against the loop's ~12K (E compares by all
# 256 threads), so 180 blocks issue ~0.3M instead of ~2.2M before any weight load (ncu, H200:
# the gate/up launch issued ~5.6M in all). The top k of the union of every chunk's top k is the
# top k (whatever beats a chunk's k-th is in that chunk's top k), and the keys (value, id) are
# distinct, so the counts are the exact ranks.
ROUTING_FORMS = (Ranking.LOOP, Ranking.ROUNDS, Ranking.BITONIC)  # the forms that rank (NONE does not)
WARP_TOPK_MAX = 32  # BITONIC: a warp's 32 sorted logits hold at most its top 32
# Its compares are written with | and & on bools, not || and &&: short-circuited, nvcc made each
# of the count's 80 compares three divergent branches (PTX), and on the H200 the count took 6.6
# kcycles of the gate/up launch's ~24 (a chain's timeline) where its ~600
# instructions a warp should take ~1; the same ranks either way.
# the form the gate/up launch takes (the benchmarks time every form). BITONIC since the H200
# measured it (ncu, seed shape, one token): gate/up 15.5 us against the loop's 18.1
RANK_FORM = Ranking.BITONIC
BITONIC_TOPK = r"""
    constexpr int NCH32 = (E + 31) / 32;      // chunks of 32 logits, a warp each (in turn past NT / 32)
    for (int c0 = 0; c0 < NCH32; c0 += NT / 32) {
      const int c = c0 + (int)warp_id;        // warp-uniform
      if (c < NCH32) {
        const int32_t e = 32 * c + (int)lane;
        float v = e < E ? zs[e] : -bits_f32(0x7F800000u);
        float fi = (float)e;                  // past E: id >= E, behind every real logit of equal value
        UNROLL for (int kk = 2; kk <= 32; kk <<= 1) {
          UNROLL for (int j = kk >> 1; j > 0; j >>= 1) {
            const float pv = shfl_xor_f(v, (uint32_t)j), pi = shfl_xor_f(fi, (uint32_t)j);
            const bool pbeats = (pv > v) | ((pv == v) & (pi < fi));  // no short circuit: no branches
            const bool keep_better = ((lane & (uint32_t)j) == 0u) == ((lane & (uint32_t)kk) == 0u);
            if (keep_better == pbeats) { v = pv; fi = pi; }   // descending: lane l ends holding the l-th
          }
        }
        if ((int)lane < K) { cand_bv[c * K + (int)lane] = v; cand_bi[c * K + (int)lane] = (int32_t)fi; }
      }
    }
    BARRIER();
    constexpr int NCAND = NCH32 * K;
    for (uint32_t q = tid; q < (uint32_t)NCAND; q += NT) {
      const float qv = cand_bv[q];
      const int32_t qi = cand_bi[q];
      int32_t r = 0;
      int p = 0;
      for (; p + 8 <= NCAND; p += 8) {        // 8 candidates' loads issued together (one at a time, each
        float pv[8];                          // compare waited ~30 cycles on its load: 80 of them ~1 us)
        int32_t pi[8];
        UNROLL for (int u = 0; u < 8; ++u) { pv[u] = cand_bv[p + u]; pi[u] = cand_bi[p + u]; }
        UNROLL for (int u = 0; u < 8; ++u) r += (int)((pv[u] > qv) | ((pv[u] == qv) & (pi[u] < qi)));
      }
      for (; p < NCAND; ++p) r += (int)((cand_bv[p] > qv) | ((cand_bv[p] == qv) & (cand_bi[p] < qi)));
      if (r < K && qi < E) top[r] = qi;
    }
"""
ROUNDS_OR_LOOP = r"""
  SHARED float cand_v[NT / 32];
  SHARED int32_t cand_i[NT / 32];
  SHARED float cand_bv[((E + 31) / 32) * K];
  SHARED int32_t cand_bi[((E + 31) / 32) * K];
  if (ROUNDS == 3) {
    if (tid < (uint32_t)K) top[tid] = (int32_t)tid;  // Ranking.NONE: a diagnostic
  } else if (ROUNDS == 2) {
""" + BITONIC_TOPK + r"""
  } else if (ROUNDS) {
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
