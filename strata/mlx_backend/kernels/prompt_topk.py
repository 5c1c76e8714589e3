"""The k best experts of every prompt position in one launch: grouped.top_k's selection (score
descending, equal scores to the lower id, -0.0 equal to 0.0) without building and sorting a
uint64 key per (token, expert).

Why (H200, ncu, one layer of the seed shape at 2048 tokens, E = 256, k = 10): the key took 11
elementwise launches (~115 us: shifts, ORs, a compare and a select over [T, E] uint32 / uint64)
and its sort 26 us; the slice to k and the int32 cast one more. Here block t loads position t's E
scores into shared memory and each thread ranks its entries against all E by the decode
preamble's own ranking loop (moe.RANK_LOOP: the fused expert kernel ranks a token the same way),
~E compares a thread read from shared memory: ~2048 blocks of ~1.5K instructions a thread.

Float comparisons order every non-NaN score as the key does (the key maps -0.0 to 0.0; -inf, a
group the sigmoid rule masked, ranks below every finite score, ties to the lower id). A NaN
score ranks nowhere: its row's unfilled ranks hold expert 0 (ids stay in range for the kernels
that index by them; a NaN layer's output is NaN whatever it routes to).

Shapes: T positions, E experts, K selected.
"""

from __future__ import annotations

import mlx.core as mx

from strata.mlx_backend.kernels import decode_routing, moe
from strata.mlx_backend.kernels.launch import block_threads, launch
from strata.mlx_backend.kernels.source import KernelSource
from strata.model_config import RoutingOrder

MAX_THREADS = 256  # a block: one position's E scores (E > 256: a thread ranks several)

BODY = r"""
  constexpr int NWR = NT / 32;
  SHARED float zs[E];
  SHARED int32_t top[K];
  SHARED float topw[K];
  SHARED float red[NWR];
  const uint64_t row = (uint64_t)bx;
  for (uint32_t e = tid; e < (uint32_t)E; e += NT) zs[e] = score[row * E + e];
  for (uint32_t r = tid; r < (uint32_t)K; r += NT) top[r] = 0;  // a NaN row's unfilled ranks: expert 0
  BARRIER();
""" + moe.RANK_LOOP.lstrip("\n") + r"""  BARRIER();
  for (uint32_t r = tid; r < (uint32_t)K; r += NT) experts[row * K + r] = top[r];
  if (WEIGHTS) {  // the softmax rules' weights from the same scores (the logits), as the decode's preamble weighs them
""" + decode_routing.WEIGHING + r"""    for (uint32_t r = tid; r < (uint32_t)K; r += NT) weights[row * K + r] = topw[r];
  }
"""

SOURCE = KernelSource("strata_prompt_topk", ("score",), ("experts", "weights"), BODY)

# The rules whose weights the kernel computes (from the logits it ranks: the softmax orders rank
# z itself), as the decode preamble's ORDER values; the sigmoid rule's come from ops.
WEIGHED_ORDERS = {RoutingOrder.SOFTMAX_TOPK: 0, RoutingOrder.TOPK_SOFTMAX: 1}


def topk_kernel(score: mx.array, k: int, *, order: RoutingOrder | None = None, norm: bool = False
                ) -> mx.array | tuple[mx.array, mx.array]:
    """The k best experts per row in rank order (a kernel path only); with `order` (a softmax
    rule: WEIGHED_ORDERS; score is then its logits z) also the rule's weights, as
    routing.combine_weights computes them (norm: norm_topk_prob), in the same launch.
    float32 [T, E] -> int32 [T, k] (, float32 [T, k])"""
    t, e = score.shape
    threads = block_threads(min(MAX_THREADS, -(-e // 32) * 32))
    weighed = order is not None
    template = (("E", e), ("K", k), ("WEIGHTS", int(weighed)), ("ORDER", WEIGHED_ORDERS[order] if weighed else 0),
                ("NORM", int(norm)), ("NT", threads))
    experts, weights = launch(SOURCE, [score.astype(mx.float32)], [(t, k), (t, k) if weighed else (8,)],
                              [mx.int32, mx.float32], blocks=(t, 1, 1), threads=threads, template=template)
    return (experts, weights) if weighed else experts
