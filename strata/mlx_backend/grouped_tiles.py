"""A prompt's routed experts through the Q2_0 tile kernel (kernels/q2_tiles.py), GroupedGemm.Q2_TILES.

What the padded forms (grouped.py PADDED, Q2_MMA) spend per layer at the seed shape's 2048
tokens (N = 20480 (token, expert) pairs, E = 256, D 2560, F 576), and what this form keeps:

- the experts' weights: PADDED writes and reads a float16 copy (2.26 GB; 4.1 ms measured); here
  Q2_0 tiles are dequantized in shared memory;
- the largest group cap: one host sync a layer (`counts.max().item()`); here a bound the host
  knows, ceil(N / TP) + E tiles;
- rows multiplied: E x P cap whatever the counts (routing imbalance: up to E x P T); here P N in
  tiles of TP pairs, at most E of them part-filled;
- the rows' copies: a [N, D] float32 gather (210 MB), [E, P cap, D] zeros and a scatter, [E cap,
  R] gathers back, a second argsort and [N, D] gather to unsort; here none: the kernel reads h's
  float32 rows by token (splitting them into float16 terms as it stores its tile) and writes the
  down step's weighted rows in (token, rank) order.

The tile table and the sorted pairs come from a counting sort in two launches
(kernels/pair_sort.py: ~245 us of MLX's merge-sort launches and ~25 small launches less a
2048-token layer, ncu); `tile_table` is its ops twin (a few [E] and [NT] ops: counts,
cumulative sums, one [NT, E] comparison, after an argsort), which the tests hold it to. SwiGLU's
silu(g) u is the gate | up kernel's epilogue (no [N, 2F] float32 product written and read, no
five elementwise launches: ~150 us of a 2048-token layer). Nothing reaches the host.

Shapes: T tokens, k selected, N = T k pairs, E experts, D hidden, F expert ffn, P terms (lowp.py).
"""

from __future__ import annotations

import mlx.core as mx

from strata.formats.expert_record import RecordLayout
from strata.mlx_backend.experts import gated_hidden
from strata.mlx_backend.kernels.pair_sort import sort_pairs
from strata.mlx_backend.kernels.q2_tiles import BM, q2_tiles
from strata.model_config import ExpertKind
from strata.reference.experts import SWIGLU, ExpertAct

__all__ = ["tile_table", "tile_bound", "q2_tile_experts"]


def tile_bound(n: int, e: int, per_tile: int) -> int:
    """Tiles the host allocates for n sorted pairs over e experts: sum_e ceil(count_e / per_tile)
    is at most ceil(n / per_tile) + e (each expert's last tile the only part-filled one)."""
    return -(-n // per_tile) + e


def tile_table(by_expert: mx.array, e: int, per_tile: int, slots: mx.array | None = None) -> mx.array:
    """The tiles of pairs sorted by expert: up to `per_tile` consecutive pairs of one expert each.
    Tile j beyond the real ones has 0 pairs. slots: the record of expert e is slots[e] (the first
    column holds it instead of e).

    Shapes:
        by_expert int32 [N] (ascending); slots int32 [e] -> int32 [tile_bound(N, e, per_tile), 4]:
        expert (or its slot), first pair, pairs, 0
    """
    n = by_expert.shape[0]
    counts = mx.zeros((e,), mx.int32).at[by_expert].add(1)  # [E]
    starts = mx.cumsum(counts) - counts  # [E] the expert's first sorted pair
    ntiles = (counts + per_tile - 1) // per_tile
    first_tile = mx.cumsum(ntiles) - ntiles  # [E]
    j = mx.arange(tile_bound(n, e, per_tile), dtype=mx.int32)  # [NT]
    # tile j's expert: the last one whose first tile is <= j (experts without tiles share the next one's
    # first tile and come before it, so the last is the one that has tile j); past the real tiles: E - 1, 0 pairs
    ej = (first_tile[None, :] <= j[:, None]).astype(mx.int32).sum(axis=1) - 1  # [NT]
    local = (j - first_tile[ej]) * per_tile  # pairs of the expert before tile j
    pairs = mx.clip(counts[ej] - local, 0, per_tile)
    record = ej if slots is None else slots.astype(mx.int32)[ej]
    return mx.stack([record, starts[ej] + local, pairs, mx.zeros_like(ej)], axis=1)


def q2_tile_experts(records: mx.array, rec: RecordLayout, h: mx.array, experts: mx.array, weights: mx.array, *,
                    act: ExpertAct = SWIGLU, slots: mx.array | None = None) -> mx.array:
    """`grouped.grouped_experts` through the tile kernel (the GPU or emulated kernel path): the
    same products (P float16 terms a row, float32 sums), the same weighting and sum over ranks.
    slots: expert e's record is records[slots[e]] (a streaming arena: no copy of the used slots);
    None: records[e].

    Shapes:
        records uint8 [S, SLOT]; h float32 [T, D]; experts int32 [T, k] (< E); weights float32 [T, k];
        slots int32 [E] -> float32 [T, D]
    """
    t, k = experts.shape
    n, e, f = t * k, (records if slots is None else slots).shape[0], rec.expert_ffn
    p = 2  # float16 terms a row: the kernel splits the float32 rows (lowp.py's terms)
    order, tokens, tiles = sort_pairs(experts, e, BM // p, tile_bound(n, e, BM // p), slots)
    w = weights.reshape(-1).astype(mx.float32)  # [N] (token, rank) order, as dst indexes it
    if act.kind is ExpertKind.SWIGLU:  # silu(g) u in the gate | up kernel's epilogue
        hid = q2_tiles(h, tokens, order, w, tiles, n, records, rec, ("gate", "up"), gather=True,
                       scatter=False, terms=p, hidden=True)  # [N, F] float32, sorted order
    else:
        gu = q2_tiles(h, tokens, order, w, tiles, n, records, rec, ("gate", "up"), gather=True,
                      scatter=False, terms=p)
        hid = gated_hidden(act, gu[:, :f], gu[:, f:])  # [N, F] float32, sorted order
    y = q2_tiles(hid, order, order, w, tiles, n, records, rec, ("down",), gather=False, scatter=True, terms=p)
    return y.reshape(t, k, -1).sum(axis=1)  # y [N, D]: weighted rows in (token, rank) order
