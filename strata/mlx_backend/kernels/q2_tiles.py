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

One shared stage, the next k-step's global words prefetched into registers (the q2_mma body's
k loop, which the emulator and tests/test_mlx_q2_mma.py hold to the dequantized product).

This file's body is the first of the bodies behind this interface (`TileForm`, picked by
`FORM`): kernels/q2_tiles_cols.py (COLS) and kernels/q2_tiles_breg.py (BREG, BREG2) split the
tile between the warps by columns and cut the shared-memory traffic per mma (docs/mlx_backend.md
counts it), with the same bits (tests/test_mlx_q2_tiles_forms.py).

Shapes:
    x float32 [X, C]; src, dst int32 [N]; wts float32 [N]; tiles int32 [NT, 4]; records uint8 [E, SLOT]
    -> y float32 [N, R]
"""

from __future__ import annotations

import enum

import mlx.core as mx

from strata.formats.expert_record import RecordLayout
from strata.mlx_backend.kernels.launch import launch
from strata.mlx_backend.kernels import q2_tile_parts, q2_tiles_breg, q2_tiles_cols
from strata.mlx_backend.kernels.q2_mma import BK, BN, PAD, THREADS
from strata.mlx_backend.kernels.source import KernelSource

BM = 64  # rows a tile (4 warps of 16): TP = 32 pairs of two terms (P = 2), 64 of one
COLUMNS = BN  # output columns a block (q2_mma's 128: each A tile re-read R / 128 times, from L2)
TILE_INTS = 4  # tiles[j]: expert, first sorted pair, pairs, unused

BODY = r"""
  constexpr int LD = BK + PAD;
  constexpr int BI = 2 * BN / NT;  // B items (one word of 16 codes and its scale) per thread
  constexpr int TP = BM / P;  // pairs a tile
  constexpr int FPT = TP * BK / NT;  // floats of x a thread loads per k-step (8: P = 2, 16: P = 1)
  constexpr int TPP = BK / FPT;  // threads a pair (TP * TPP = NT)
  SHARED uint32_t as32[BM * LD / 2];
  SHARED uint32_t bs32[BN * LD / 2];
  SHARED float lo_rows[P == 2 ? TP * BN : 1];  // the lo terms' products, added to the hi terms' at the end
  SHARED_PTR(uint16_t) as = (SHARED_PTR(uint16_t))as32;
  SHARED_PTR(uint16_t) bs = (SHARED_PTR(uint16_t))bs32;
  const uint32_t n0 = bx * BN;
  const int e = tiles[TILE_INTS * by], first = tiles[TILE_INTS * by + 1], count = tiles[TILE_INTS * by + 2];
  const DEVICE uint8_t* rec = arena + (uint64_t)e * SLOT;
  // A: this thread's pair of the tile and FPT of its k-step's floats; it writes both terms' rows
  const uint32_t my_pair = tid / (uint32_t)TPP, seg = tid % (uint32_t)TPP;
  const bool xok = (int)my_pair < count;
  const uint32_t xrow = xok ? (GATHER ? (uint32_t)src[first + (int)my_pair] : (uint32_t)(first + (int)my_pair)) : 0u;
  const DEVICE float* xp = x + (uint64_t)xrow * (uint32_t)C + seg * (uint32_t)FPT;
  f4 acc[BN / 8];
  for (int j = 0; j < BN / 8; ++j) { acc[j].v[0] = 0.0f; acc[j].v[1] = 0.0f; acc[j].v[2] = 0.0f; acc[j].v[3] = 0.0f; }
  f4 av[FPT / 4];  // the next k-step's floats of x, loaded while this one multiplies
  uint32_t bq[BI], bd[BI];
  const uint32_t kend = count > 0 ? (uint32_t)C : 0u;  // block-uniform: an unused tile runs no k-step
  for (uint32_t k0 = 0; k0 <= kend; k0 += BK) {
    if (k0 > 0) {  // registers (k-step k0 - BK) -> shared; B dequantized: d (c - 2) from d's bits, exact
      for (int q4 = 0; q4 < FPT / 8; ++q4) {  // 8 floats -> hi = f16(v), lo = f16(v - hi): 16-byte stores
        uint32_t hw[4], lw[4];
        for (int i = 0; i < 4; ++i) {
          const float v0 = av[2 * q4 + i / 2].v[(2 * i) % 4], v1 = av[2 * q4 + i / 2].v[(2 * i) % 4 + 1];
          const half_t h0 = to_half(v0), h1 = to_half(v1);
          hw[i] = f16_bits(h0) | (f16_bits(h1) << 16);
          lw[i] = P == 2 ? (f16_bits(to_half(v0 - F32(h0))) | (f16_bits(to_half(v1 - F32(h1))) << 16)) : 0u;
        }
        const uint32_t col = seg * (uint32_t)FPT + 8u * (uint32_t)q4, row = my_pair * (uint32_t)P;
        uint4 u;  // rows are 80 bytes apart and col a multiple of 8 halves: aligned
        u.x = hw[0]; u.y = hw[1]; u.z = hw[2]; u.w = hw[3];
        *((SHARED_PTR(uint4))(as32 + (row * LD + col) / 2u)) = u;
        if (P == 2) {
          u.x = lw[0]; u.y = lw[1]; u.z = lw[2]; u.w = lw[3];
          *((SHARED_PTR(uint4))(as32 + ((row + 1u) * LD + col) / 2u)) = u;
        }
      }
      for (int it = 0; it < BI; ++it) {
        const uint32_t i = tid + (uint32_t)(it * NT), row = i >> 1, half = i & 1u;
        const uint32_t q = bq[it], dbits = bd[it];
        const uint32_t mag = dbits & 0x7fffu, sgn = dbits & 0x8000u;
        const uint32_t two = (mag < 0x400u ? mag << 1 : mag + 0x400u) | sgn;  // 2d (subnormal d: a shift)
        // d (c - 2) for c = 0..3 as float16 bits, bytes 2c and 2c + 1 of {hi:lo}: -2d, -d, 0, d
        const uint32_t lo = (two ^ 0x8000u) | ((dbits ^ 0x8000u) << 16), hi = dbits << 16;
        for (uint32_t j = 0; j < 8u; ++j) {  // two codes a store, picked by one byte permute (the dequantization
          const uint32_t c = (q >> (4u * j)) & 15u;  // was 55% of the k loop's instructions as compares and selects)
          bs32[(row * LD + 16u * half) / 2u + j] = byte_perm(lo, hi, (c & 3u) * 0x22u + (c >> 2) * 0x2200u + 0x1010u);
        }
      }
      BARRIER();
    }
    if (k0 < kend) {  // issue the global loads of k-step k0 (rows past the tile's pairs or R read as zeros)
""" + q2_tile_parts.X_LOADS + r"""
      for (int it = 0; it < BI; ++it) {
        const uint32_t i = tid + (uint32_t)(it * NT), row = i >> 1, half = i & 1u, r = n0 + row;
        // HIDDEN: the block's BN / 2 hidden units as gate rows, then the same units' up rows
        const uint32_t unit = bx * (uint32_t)(BN / 2) + row % (uint32_t)(BN / 2);
        const bool in_a = HIDDEN ? row < (uint32_t)(BN / 2) : r < (uint32_t)RA;
""" + q2_tile_parts.B_WORDS + r"""
      }
    }
    if (k0 > 0) {  // multiply k-step k0 - BK from shared while k0's loads are in flight
      for (uint32_t kk = 0; kk < (uint32_t)BK; kk += 16u) {
        const afrag fa = mma_a_frag(as + (warp_id * 16u) * LD + kk, LD, lane);  // A's registers once for BN / 8 tiles
        for (int j = 0; j < BN / 8; ++j) {
          acc[j] = mma_16816_frag(acc[j], fa, bs + (uint32_t)(8 * j) * LD + kk, LD, lane);
        }
      }
      BARRIER();
    }
  }
  const uint32_t g = lane >> 2, t = (lane & 3u) * 2u;
  if (P == 2) {  // odd rows (lo terms) to shared; the even rows' lanes add them below
    for (int j = 0; j < BN / 8; ++j) {
      for (int h = 0; h < 2; ++h) {
        const uint32_t row = warp_id * 16u + g + 8u * (uint32_t)h;
        if (row & 1u) {
          lo_rows[(row >> 1) * BN + (uint32_t)(8 * j) + t] = acc[j].v[2 * h];
          lo_rows[(row >> 1) * BN + (uint32_t)(8 * j) + t + 1u] = acc[j].v[2 * h + 1];
        }
      }
    }
  }
  BARRIER();
  if (HIDDEN) {  // silu(g) u of the block's units (column tile j: gate, j + BN / 16: up), as the ops write it
    for (int j = 0; j < BN / 16; ++j) {
      const uint32_t col = bx * (uint32_t)(BN / 2) + (uint32_t)(8 * j) + t;
      for (int h = 0; h < 2; ++h) {
        const uint32_t row = warp_id * 16u + g + 8u * (uint32_t)h, pair = row / (uint32_t)P;
        if (row % (uint32_t)P == 0u && (int)pair < count) {
          float g0 = acc[j].v[2 * h], g1 = acc[j].v[2 * h + 1];
          float u0 = acc[j + BN / 16].v[2 * h], u1 = acc[j + BN / 16].v[2 * h + 1];
          if (P == 2) {
            g0 = g0 + lo_rows[pair * BN + (uint32_t)(8 * j) + t];
            g1 = g1 + lo_rows[pair * BN + (uint32_t)(8 * j) + t + 1u];
            u0 = u0 + lo_rows[pair * BN + (uint32_t)(8 * (j + BN / 16)) + t];
            u1 = u1 + lo_rows[pair * BN + (uint32_t)(8 * (j + BN / 16)) + t + 1u];
          }
          const uint64_t o = (uint64_t)(first + (int)pair) * RA + col;
          if (col < (uint32_t)RA) y[o] = g0 / (1.0f + exp_f(-g0)) * u0;  // experts.silu: x / (1 + exp(-x))
          if (col + 1u < (uint32_t)RA) y[o + 1] = g1 / (1.0f + exp_f(-g1)) * u1;
        }
      }
    }
  }
  for (int j = 0; j < (HIDDEN ? 0 : BN / 8); ++j) {
    const uint32_t col = n0 + (uint32_t)(8 * j) + t;
    for (int h = 0; h < 2; ++h) {
      const uint32_t row = warp_id * 16u + g + 8u * (uint32_t)h, pair = row / (uint32_t)P;
      if (row % (uint32_t)P == 0u && (int)pair < count) {
        const int pi = first + (int)pair;
        const uint32_t out = SCATTER ? (uint32_t)dst[pi] : (uint32_t)pi;
        float v0 = acc[j].v[2 * h], v1 = acc[j].v[2 * h + 1];
        if (P == 2) {  // hi + lo, as lowp.join_rows adds them
          v0 = v0 + lo_rows[pair * BN + (uint32_t)(8 * j) + t];
          v1 = v1 + lo_rows[pair * BN + (uint32_t)(8 * j) + t + 1u];
        }
""" + q2_tile_parts.SCATTER_STORE + r"""
      }
    }
  }
"""

SOURCE = KernelSource("strata_q2_tiles", ("x", "src", "dst", "wts", "tiles", "arena"), ("y",), BODY)


class TileForm(enum.Enum):
    """The kernel body a launch takes: the same inputs, template, grid and bits (tests hold them
    equal); they differ in how a block's 4 warps split its tile and load their fragments."""

    ROWS = "rows"  # this file's body: a warp 16 rows x BN columns, fragments by 32-bit shared loads
    COLS = "cols"  # kernels/q2_tiles_cols.py: a warp 64 rows x BN / 4 columns, ldmatrix, conflict-free stores
    BREG = "breg"  # kernels/q2_tiles_breg.py: COLS with B's fragments dequantized in registers (no B in shared)
    BREG2 = "breg2"  # BREG with two A stages: one barrier a k-step
    BREG_DEEP = "bregdeep"  # BREG with its global loads two k-steps ahead (two register sets)


# Which body runs: None, BEST's for the step; a TileForm, that one for every step (benchmarks/
# prompt_probe.py --tile-forms and benchmarks/q2_tiles_forms.py time them side by side).
FORM: TileForm | None = None
# The fastest body by step, measured on the H200 (q2_tiles_forms.py: the seed shape's 2048-token
# launches, ms): gate | up with silu(g) u ROWS 2.37, COLS 1.77, BREG 1.68; down ROWS 1.36, COLS 0.87,
# BREG 0.97 (whole prompt of 2048 tokens: ROWS 258.0, COLS 222.6, BREG 214.8 ms)
BEST = {("gate", "up"): TileForm.BREG, ("down",): TileForm.COLS}
SOURCES = {TileForm.ROWS: SOURCE, TileForm.COLS: q2_tiles_cols.SOURCE, TileForm.BREG: q2_tiles_breg.SOURCE,
           TileForm.BREG2: q2_tiles_breg.SOURCE_2, TileForm.BREG_DEEP: q2_tiles_breg.SOURCE_DEEP}


def q2_tiles(x: mx.array, src: mx.array, dst: mx.array, wts: mx.array, tiles: mx.array, n: int, records: mx.array,
             rec: RecordLayout, planes: tuple[str, ...], *, gather: bool, scatter: bool, terms: int = 2,
             hidden: bool = False, bn: int | None = None) -> mx.array:
    """y[i] = sum_p term_p(x[row(i)]) W^T for every sorted pair i of every tile (terms: 2, hi and
    lo float16 terms of each float32 row; 1, hi alone), W the `planes` of the
    tile's expert's record (("gate", "up"): [2F, D], gate rows first; ("down",): [D, F]);
    row(i) = src[i] (gather) or i; the row goes to y[dst[i]] times wts[dst[i]] (scatter) or y[i].
    src / dst / wts are not read where gather / scatter is off (pass any int32 / float32 array).
    bn: output columns a block (None: COLUMNS; 64 halves the accumulators, re-reads A twice as often).
    hidden (planes ("gate", "up") only): y[i] = silu(gate) * up, [n, F], each block's columns half
    gate rows and half the same units' up rows (no [n, 2F] product and no ops after it).

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
    form = FORM or BEST.get(tuple(planes), TileForm.COLS)
    return launch(SOURCES[form], [x.astype(mx.float32), src, dst, wts, tiles, records], [(n, cols)], [mx.float32],
                  blocks=(-(-cols // per_block), tiles.shape[0], 1), threads=THREADS, template=template)[0]
