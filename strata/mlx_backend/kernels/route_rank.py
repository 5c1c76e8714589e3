"""A decoded token's top k experts ranked once, as the last phase of the attention's chained
launch (kernels/attend_project.py, `qkv_attend_route(rank_k=)`), so the expert launches after it
read them (decode_routing.Ranking.GIVEN) instead of every block ranking the router's logits again.

Why: at the seed shape each of a layer's 360 gate/up blocks (and, deferred or chained, each down
block) stages the 256 logits and sorts them before its first code load: on the H200 the ranking
chain was ~4 us of the gate/up launch's ~13 (ncu diagnostics, docs/perf.md). Here one block ranks
them as the router's blocks finish, ~0.5 us at the end of the attention launch; the expert blocks
then read k ids (one L2 round trip) and issue their loads. Predicted ~2-3 us a layer.

The body is the decode launches' own ranking text (decode_routing.RANKING_ITSELF: the warp sorts
by default, ties to the lower id), so the ids are the ones each block found itself: the expert
launches' outputs are bit for bit the same.

Shapes:
    z float32 [T, E] -> top int32 [T, K] (expert ids in rank order)
Grid: a block a token (the grid's y, as the expert launches); CUDA, Metal and the emulator
(alone, or a phase of a chain where chains run).
"""

from __future__ import annotations

import mlx.core as mx

from strata.mlx_backend.kernels import decode_routing as routing
from strata.mlx_backend.kernels.launch import as_f32
from strata.mlx_backend.kernels.phases import LaunchSpec, Pending, run
from strata.mlx_backend.kernels.source import KernelSource

THREADS = 256

BODY = routing.RANKING_ITSELF + r"""
  if (tid < (uint32_t)K) ranked[(uint64_t)t * K + tid] = top[tid];
"""
SOURCE = KernelSource("strata_route_rank", ("z",), ("ranked",), BODY)


def form(k: int) -> routing.Ranking:
    """The ranking the phase runs: the gate/up launch's default (decode_routing.RANK_FORM), LOOP
    where the warp sorts would need k > 32."""
    f = routing.RANK_FORM
    return routing.Ranking.LOOP if f is routing.Ranking.BITONIC and k > routing.WARP_TOPK_MAX else f


def rank(z: mx.array | Pending, k: int, *, threads: int = THREADS, spec: bool = False):
    """The top k of each row of z (z descending, ties to the lower id), by `form(k)`; spec: the
    launch's `phases.LaunchSpec` (a chain's phase) instead of its output.

    Shapes:
        z float32 [T, E] -> int32 [T, k]
    """
    t, e = z.shape
    if not 1 <= k <= e:
        raise ValueError(f"route_rank: k={k} of {e} logits")
    template = (("K", k), ("E", e), ("NT", threads), ("ROUNDS", int(form(k))), ("NSB", 0), ("NCH", 1))
    one = LaunchSpec(SOURCE, (z if isinstance(z, Pending) else as_f32(z),), ((t, k),), (mx.int32,), (1, t, 1),
                     threads, template)
    return one if spec else run(one)[0]
