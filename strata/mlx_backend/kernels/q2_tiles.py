"""Grouped GEMM over Q2_0 records by tiles of sorted rows: the prompt path's routed experts on the
matrix units with no padded buffer, no host sync and no float16 copy of the experts.

The (token, expert) pairs are sorted by expert; a tile is up to TP = BM / P consecutive sorted
pairs of one expert (`tiles[j] = (expert, first sorted pair, pairs)`, built on the device by
grouped_tiles.py; the host only knows a bound on the tile count, ceil(N / TP) + E, and the unused
tiles have 0 pairs and do nothing). Block (bx, by) multiplies tile by's rows by output columns
bx*BN.. of its expert's W [R, C] (gate | up stacked, or down), dequantized from the record's
Q2_0 blocks into shared memory k-step by k-step (d (q - 2) from d's float16 bits: exact) and
multiplied by `mma_16816` (CUDA's m16n8k16 tensor-core `mma`; Metal and the emulator: the same
four float32 dot products per lane; the Metal form is compile-checked, not run).

What kernels/q2_mma.py (the padded form) costs and this does not: the rows scattered into
[E, P cap, C] (cap the largest group: E x cap rows multiplied whatever the real counts, which
routing imbalance makes up to E x T), the host sync that reads cap, and the gather of the
products back. Here a tile reads its rows where they are:

- A row m of a tile is term m % P of the tile's pair m / P: x is float32 and the kernel splits
  it as it stores the tile (P = 2: hi = f16(x) and lo = f16(x - hi), lowp.py's terms, bit for
  bit; P = 1: hi alone), so no [X, P, C] float16 copy is made by ops. GATHER: the pair's x row
  is src[pair] (the token of a sorted pair: the gate | up step reads h's T rows, never a [T k,
  D] gathered copy); else the pair itself.
- The P terms' products are summed in the block (the lo rows' through shared memory), so y holds
  float32 [.., R] rows: hi + lo, as lowp.join_rows adds them. SCATTER: pair i's row goes to
  y[dst[i]] times wts[dst[i]] (the down step writes each pair's weighted output in (token, rank)
  order: no unsort gather after it); else to y[i].

The bodies behind this interface (`TileForm`; each step takes its fastest, `BEST`):
kernels/q2_tiles_cols.py (COLS) and kernels/q2_tiles_breg.py (BREG, B dequantized in registers)
split the tile between the warps by columns, which cuts the shared-memory traffic per mma
(docs/mlx_backend.md counts it), with the same bits (tests/mlx_backend/test_mlx_q2_tiles_forms.py).

Shapes:
    x float32 [X, C]; src, dst int32 [N]; wts float32 [N]; tiles int32 [NT, 4]; records uint8 [E, SLOT]
    -> y float32 [N, R]
"""

from __future__ import annotations

import enum

import mlx.core as mx

from strata.formats.expert_record import RecordLayout
from strata.mlx_backend.kernels.launch import launch
from strata.mlx_backend.kernels import q2_tiles_breg, q2_tiles_cols
from strata.mlx_backend.kernels.q2_mma import BK, BN, PAD, THREADS

BM = 64  # rows a tile (4 warps of 16): TP = 32 pairs of two terms (P = 2), 64 of one
COLUMNS = BN  # output columns a block (q2_mma's 128: each A tile re-read R / 128 times, from L2)
TILE_INTS = 4  # tiles[j]: expert, first sorted pair, pairs, unused

class TileForm(enum.Enum):
    """The kernel body a launch takes: the same inputs, template, grid and bits (tests hold them
    equal); they differ in how a block's 4 warps split its tile and load their fragments."""

    COLS = "cols"  # kernels/q2_tiles_cols.py: a warp 64 rows x BN / 4 columns, ldmatrix, conflict-free stores
    BREG = "breg"  # kernels/q2_tiles_breg.py: COLS with B's fragments dequantized in registers (no B in shared)


# The fastest body by step, measured on the H200 (the seed shape's 2048-token launches, ms): gate |
# up with silu(g) u COLS 1.77, BREG 1.68; down COLS 0.87, BREG 0.97 (a whole prompt of 2048
# tokens: COLS 222.6, BREG 214.8 ms). The bodies that lost (ROWS: a warp 16 rows x BN columns,
# gate | up 2.37, down 1.36 ms; BREG with two A stages; BREG with its loads two k-steps ahead) are
# at the tag lab-before-kernel-plan.
BEST = {("gate", "up"): TileForm.BREG, ("down",): TileForm.COLS}
SOURCES = {TileForm.COLS: q2_tiles_cols.SOURCE, TileForm.BREG: q2_tiles_breg.SOURCE}


def q2_tiles(x: mx.array, src: mx.array, dst: mx.array, wts: mx.array, tiles: mx.array, n: int, records: mx.array,
             rec: RecordLayout, planes: tuple[str, ...], *, gather: bool, scatter: bool, terms: int = 2,
             hidden: bool = False, bn: int | None = None, form: TileForm | None = None) -> mx.array:
    """y[i] = sum_p term_p(x[row(i)]) W^T for every sorted pair i of every tile (terms: 2, hi and
    lo float16 terms of each float32 row; 1, hi alone), W the `planes` of the
    tile's expert's record (("gate", "up"): [2F, D], gate rows first; ("down",): [D, F]);
    row(i) = src[i] (gather) or i; the row goes to y[dst[i]] times wts[dst[i]] (scatter) or y[i].
    src / dst / wts are not read where gather / scatter is off (pass any int32 / float32 array).
    bn: output columns a block (None: COLUMNS; 64 halves the accumulators, re-reads A twice as often).
    hidden (planes ("gate", "up") only): y[i] = silu(gate) * up, [n, F], each block's columns half
    gate rows and half the same units' up rows (no [n, 2F] product and no ops after it).
    form: the body (None: BEST's for the step; the tests hold the bodies to one another).

    Shapes:
        x float32 [X, C]; src, dst int32 [n]; wts float32 [n]; tiles int32 [NT, TILE_INTS];
        records uint8 [E, SLOT] -> float32 [n, R]
    """
    (_, c), p = x.shape, terms
    bn = bn or COLUMNS
    if bn not in (64, 128):
        raise ValueError(f"q2_tiles: {bn} columns a block (64 or 128)")
    shapes = [rec.shape(pl) for pl in planes]
    if any(cols != c for _, cols in shapes) or c % BK or p not in (1, 2):
        raise ValueError(f"q2_tiles: planes {planes} of {shapes} against x's {c} columns (a multiple of {BK}), "
                         f"{p} terms (1 or 2)")
    ra = shapes[0][0]
    r = sum(rows for rows, _ in shapes)
    a, b = planes[0], planes[-1]
    if hidden and planes != ("gate", "up"):
        raise ValueError(f"q2_tiles: hidden is silu(gate) * up, not of planes {planes}")
    template = (("C", c), ("R", r), ("RA", ra), ("CA", rec.codes(a).offset), ("SA", rec.scales(a).offset),
                ("CB", rec.codes(b).offset), ("SB", rec.scales(b).offset), ("SLOT", records.shape[1]),
                ("P", p), ("GATHER", int(gather)), ("SCATTER", int(scatter)), ("HIDDEN", int(hidden)),
                ("TILE_INTS", TILE_INTS),
                ("BM", BM), ("BN", bn), ("BK", BK), ("PAD", PAD), ("NT", THREADS))
    cols, per_block = (ra, bn // 2) if hidden else (r, bn)
    form = form or BEST.get(tuple(planes), TileForm.COLS)
    return launch(SOURCES[form], [x.astype(mx.float32), src, dst, wts, tiles, records], [(n, cols)], [mx.float32],
                  blocks=(-(-cols // per_block), tiles.shape[0], 1), threads=THREADS, template=template)[0]
