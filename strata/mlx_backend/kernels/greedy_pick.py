"""Greedy selection of one position's logits in one launch: greedy.py's packed selection (the
first index of the maximum, its log-probability, whether the logits are finite) as two phases of
a chain instead of MLX's ~13 graph nodes of reductions and elementwise ops.

- `strata_greedy_part`: block b takes logits [b CH, (b + 1) CH): its maximum and the first index
  holding it (ascending indices a thread, ties to the lower index across threads), whether it met
  a NaN, and the sum of exp(z - its maximum) over its logits; four floats a block.
- `strata_greedy_join` (one block, after every part block has counted): the blocks' maxima in
  block order (the first block holding the maximum holds its first index), the sum
  S = sum_b s_b exp(m_b - M), the log-probability -log(S) (log1p(S - 1): S >= 1, the maximum's own
  term is exp(0)), finite = no NaN and M finite; written as greedy.py's layout.

Why: on the H200 a decoded token's GPU time inside MLX's graphs is its kernels plus ~3 us at each
of its graph nodes (benchmarks/graph_time.py), and MLX's host work is ~3.5 us a node; the selection
was 13 of a token's 159 nodes. Predicted: ~12 nodes fewer, ~35-40 us of GPU time and ~25 us of host
work a token (the part blocks read 0.6 MB at a 152k vocabulary: ~1-2 us).

Exact where the host's choice is defined: the token is numpy's argmax of the same float32 logits;
the log-probability differs from greedy.py's MLX form in float32 summation order only (both
within DEVICE_LOGPROB_ATOL of the host's float64 log_softmax).

Shapes: logits float32 [V] -> int32 [MIN_INPUT_SIZE] (greedy.py's layout)
Grid: ceil(V / CH) part blocks, then one join block, 256 threads; CUDA and the emulator as one
launch (phases.chain_all), elsewhere as two.
"""

from __future__ import annotations

import mlx.core as mx

from strata.mlx_backend.kernels import phases
from strata.mlx_backend.kernels.launch import as_f32
from strata.mlx_backend.kernels.phases import LaunchSpec, Pending, run
from strata.mlx_backend.kernels.source import MIN_INPUT_SIZE, KernelSource

THREADS = 256
PER_THREAD = 8  # logits a thread of a part block: CH = 2048, 75 blocks at a 152k vocabulary
CH = THREADS * PER_THREAD

PART = r"""
  constexpr int NW = NT / 32;
  SHARED float wv[NW];
  SHARED float wi[NW];
  SHARED float wn[NW];
  SHARED float ws[NW];
  SHARED float bm;
  const float minus_inf = -bits_f32(0x7F800000u);
  const int32_t lo = (int32_t)bx * CH;
  const int32_t hi = lo + CH < V ? lo + CH : V;
  float bv = minus_inf;
  int32_t bi = V;                             // V: no logit yet
  float nan = 0.0f;
  for (int32_t i = lo + (int32_t)tid; i < hi; i += NT) {  // ascending: a tie keeps the first
    const float v = z[i];
    if (v != v) nan = 1.0f;
    else if (bi == V || v > bv) { bv = v; bi = i; }
  }
  const float m = warp_max(bv);
  const float fi = warp_max(bi < V && bv == m ? -(float)bi : -(float)(2 * V));  // the lowest index holding it
  nan = warp_max(nan);
  if (lane == 0) { wv[warp_id] = m; wi[warp_id] = -fi; wn[warp_id] = nan; }
  BARRIER();
  if (tid == 0) {
    float best = wv[0], at = wi[0], any = wn[0];
    for (int w = 1; w < NW; ++w) {
      any = any > wn[w] ? any : wn[w];
      if (wi[w] < (float)V && (at >= (float)V || wv[w] > best || (wv[w] == best && wi[w] < at))) {
        best = wv[w];
        at = wi[w];
      }
    }
    bm = best;
    parts[4 * bx] = best;
    parts[4 * bx + 1] = at;                   // >= V: the block held no logit but NaNs
    parts[4 * bx + 2] = any;
  }
  BARRIER();
  const float mb = bm;
  float s = 0.0f;
  if (mb > minus_inf) {                       // -inf: every logit -inf (or NaN); nothing to add
    for (int32_t i = lo + (int32_t)tid; i < hi; i += NT) {
      const float v = z[i];
      if (v == v) s += exp_f(v - mb);
    }
  }
  s = warp_sum(s);
  if (lane == 0) ws[warp_id] = s;
  BARRIER();
  if (tid == 0) {
    float tot = 0.0f;
    for (int w = 0; w < NW; ++w) tot += ws[w];
    parts[4 * bx + 3] = tot;
  }
"""

JOIN = r"""
  const float minus_inf = -bits_f32(0x7F800000u);
  if (tid == 0) {
    float best = minus_inf, at = (float)V, any = 0.0f;
    for (int b = 0; b < NB; ++b) {            // block order: the first block holding M has its first index
      const float v = parts[4 * b], i = parts[4 * b + 1];
      any = any > parts[4 * b + 2] ? any : parts[4 * b + 2];
      if (i < (float)V && (at >= (float)V || v > best)) { best = v; at = i; }
    }
    float sum = 0.0f;
    if (best > minus_inf) {
      for (int b = 0; b < NB; ++b) {
        const float v = parts[4 * b];
        if (parts[4 * b + 1] < (float)V && v > minus_inf) sum += parts[4 * b + 3] * exp_f(v - best);
      }
    }
    const bool finite = any == 0.0f && best > minus_inf && best < -minus_inf;
    const float logprob = finite ? -log1p_f(sum - 1.0f) : 0.0f;
    picked[0] = at < (float)V ? (int32_t)at : 0;
    picked[1] = (int32_t)f32_bits(logprob);
    picked[2] = finite ? 1 : 0;
    for (int q = 3; q < PICKED; ++q) picked[q] = 0;
  }
"""

PART_SOURCE = KernelSource("strata_greedy_part", ("z",), ("parts",), PART)
JOIN_SOURCE = KernelSource("strata_greedy_join", ("parts",), ("picked",), JOIN)
# the chain's counters: one site for every selection (a launch leaves them zero)
_SITE = mx.zeros((1,))


def pick(logits: mx.array) -> mx.array:
    """greedy.py's packed selection of one position's float32 logits [V] (or [1, V]).

    Shapes:
        logits float32 [V] -> int32 [MIN_INPUT_SIZE]
    """
    z = as_f32(logits.reshape(-1))
    v = z.shape[0]
    if not 1 <= v < 1 << 24:  # indices travel as float32 between the phases: exact below 2^24
        raise ValueError(f"greedy_pick: a vocabulary of 1 to 2^24 - 1 logits, got {v}")
    nb = (v + CH - 1) // CH
    part = LaunchSpec(PART_SOURCE, (z,), ((nb, 4),), (mx.float32,), (nb, 1, 1), THREADS,
                      (("V", v), ("NT", THREADS), ("CH", CH)))
    chained = phases.available()  # else two launches, the join reading the parts as made
    parts = Pending((nb, 4), mx.float32) if chained else run(part)[0]
    join = LaunchSpec(JOIN_SOURCE, (parts,), ((MIN_INPUT_SIZE,),), (mx.int32,), (1, 1, 1), THREADS,
                      (("V", v), ("NT", THREADS), ("NB", nb), ("PICKED", MIN_INPUT_SIZE)))
    if chained:
        return phases.chain_all((part, join), ({}, {"parts": (0, 0)}), key=_SITE, use="greedy")[-1]
    return run(join)[0]
