"""A prompt's (token, expert) pairs grouped by expert, by a counting sort in two launches that
writes the tile kernel's inputs directly (kernels/q2_tiles.py: the sorted pairs, their tokens and
the tile table), instead of MLX's argsort of the N = T k expert ids and ~25 small ops building
the table (grouped_tiles.tile_table).

Why (H200, ncu, one layer of the seed shape at 2048 tokens: N = 20480 pairs, E = 256): MLX's
argsort of 20480 int32 is a multi-block merge sort, 7 launches and ~245 us (one partition
launch of 6 threads took 180 us), and the table's ops are ~25 launches of 2-4 us each. Here:

1. `COUNTS`: block e counts expert e's pairs (every block reads the N ids: 80 KB from L2 each,
   ~21 MB in all, a few us);
2. `SCATTER`: block e sums the counts before it (its first sorted pair and its first tile),
   then each thread takes a contiguous segment of the pairs, counts its expert's pairs there, a
   block-wide prefix sum gives each thread where its pairs go, and a second read of the segment
   writes them: pair i (token i / K) at `order[start + ...]`, in ascending i (a stable sort, so
   the order is numpy's stable argsort). Block e writes its own tiles; the last block also the
   empty tiles up to the host's bound (grouped_tiles.tile_bound), as `tile_table` fills them.

No atomics (the preludes have none for every dialect): the bodies are plain loads, stores and
barriers, the same on CUDA, Metal (compile-checked, not run) and the emulator.

Shapes: N pairs (T tokens x K ranks, in (token, rank) order), E experts, NTB tiles (the bound).
"""

from __future__ import annotations

import mlx.core as mx
import numpy as np

from strata.mlx_backend.kernels.launch import absent, block_threads, index_param, launch
from strata.mlx_backend.kernels.source import KernelSource

THREADS = 256  # a block: one expert's pairs; a power of two (the tree sums and the prefix sum)
TILE_INTS = 4  # kernels/q2_tiles.py's tile row: record (expert or its slot), first sorted pair, pairs, unused

COUNTS_BODY = r"""
  SHARED int32_t red[NT];
  const int32_t n = pairs_n[0], e = (int32_t)bx;
  int32_t c = 0;
  for (int32_t i = (int32_t)tid; i < n; i += NT) c += experts[i] == e ? 1 : 0;
  red[tid] = c;
  BARRIER();
  for (uint32_t s = NT / 2; s > 0u; s >>= 1) {
    if (tid < s) red[tid] += red[tid + s];
    BARRIER();
  }
  if (tid == 0u) counts[e] = red[0];
"""

SCATTER_BODY = r"""
  SHARED int32_t red_pairs[NT];
  SHARED int32_t red_tiles[NT];
  SHARED int32_t scan[NT];
  const int32_t n = pairs_n[0], ntb = tiles_n[0], e = (int32_t)bx;
  // the experts before e: its first sorted pair and its first tile
  int32_t pairs_before = 0, tiles_before = 0;
  for (int32_t j = (int32_t)tid; j < e; j += NT) {
    const int32_t c = counts[j];
    pairs_before += c;
    tiles_before += (c + TP - 1) / TP;
  }
  red_pairs[tid] = pairs_before;
  red_tiles[tid] = tiles_before;
  BARRIER();
  for (uint32_t s = NT / 2; s > 0u; s >>= 1) {
    if (tid < s) { red_pairs[tid] += red_pairs[tid + s]; red_tiles[tid] += red_tiles[tid + s]; }
    BARRIER();
  }
  const int32_t start = red_pairs[0], first_tile = red_tiles[0];
  // this thread's segment of the pairs: how many are expert e's, then an inclusive prefix sum over the threads
  const int32_t seg = (n + NT - 1) / NT;
  const int32_t lo = (int32_t)tid * seg < n ? (int32_t)tid * seg : n;
  const int32_t hi = lo + seg < n ? lo + seg : n;
  int32_t mine = 0;
  for (int32_t i = lo; i < hi; ++i) mine += experts[i] == e ? 1 : 0;
  scan[tid] = mine;
  BARRIER();
  for (uint32_t s = 1; s < (uint32_t)NT; s <<= 1) {
    const int32_t v = tid >= s ? scan[tid - s] : 0;
    BARRIER();
    scan[tid] += v;
    BARRIER();
  }
  int32_t at = start + scan[tid] - mine;
  for (int32_t i = lo; i < hi; ++i) {
    if (experts[i] == e) {
      order[at] = i;
      src[at] = i / K;
      ++at;
    }
  }
  const int32_t count = scan[NT - 1];
  const int32_t last = e == E - 1 ? ntb : first_tile + (count + TP - 1) / TP;  // the last block: the empty tiles too
  const int32_t record = HAS_SLOTS ? slots[e] : e;
  for (int32_t j = first_tile + (int32_t)tid; j < last; j += NT) {
    const int32_t local = (j - first_tile) * TP;  // expert e's pairs before tile j
    const int32_t left = count - local;
    tiles[TILE_INTS * j] = record;
    tiles[TILE_INTS * j + 1] = start + local;
    tiles[TILE_INTS * j + 2] = left < 0 ? 0 : (left > TP ? TP : left);
    tiles[TILE_INTS * j + 3] = 0;
  }
"""

COUNTS = KernelSource("strata_pair_counts", ("experts", "pairs_n"), ("counts",), COUNTS_BODY)
SCATTER = KernelSource("strata_pair_scatter", ("experts", "counts", "slots", "pairs_n", "tiles_n"),
                       ("order", "src", "tiles"), SCATTER_BODY)


def sort_pairs(experts: mx.array, n_experts: int, per_tile: int, n_tiles: int,
               slots: mx.array | None = None) -> tuple[mx.array, mx.array, mx.array]:
    """The pairs of `experts` grouped by expert (ascending pair index inside a group), their
    tokens, and the tiles of up to `per_tile` pairs of one expert over them: what
    `mx.argsort(flat)`, `order // k` and `grouped_tiles.tile_table(flat[order], ...)` give, the
    same values (a kernel path only).

    Shapes:
        experts int32 [T, K] (< n_experts); slots int32 [n_experts] -> (order int32 [T K],
        src int32 [T K] (order // K), tiles int32 [n_tiles, TILE_INTS])
    """
    t, k = experts.shape
    n, nt = t * k, block_threads(THREADS)
    flat = experts.reshape(-1).astype(mx.int32)
    # N and the tile bound: runtime ints as views of the device arange (no host write:
    # kernels/launch.py), not template values (a compile per prompt length)
    pairs_n, tiles_n = index_param(n), index_param(n_tiles)
    (counts,) = launch(COUNTS, [flat, pairs_n], [(n_experts,)], [mx.int32], blocks=(n_experts, 1, 1),
                       threads=nt, template=(("NT", nt),))
    template = (("E", n_experts), ("K", k), ("TP", per_tile), ("HAS_SLOTS", int(slots is not None)),
                ("TILE_INTS", TILE_INTS), ("NT", nt))
    order, src, tiles = launch(SCATTER, [flat, counts, absent(np.int32) if slots is None else slots.astype(mx.int32),
                                         pairs_n, tiles_n], [(n,), (n,), (n_tiles, TILE_INTS)], [mx.int32] * 3,
                               blocks=(n_experts, 1, 1), threads=nt, template=template)
    return order, src, tiles
