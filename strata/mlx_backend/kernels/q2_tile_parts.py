"""Text the Q2_0 tile kernel's bodies share (kernels/q2_tiles_cols.py COLS,
q2_tiles_breg.py BREG), so a fix to one piece reaches every body that takes it.
Each is a run of statements inside the bodies' k loop or around it, in the bodies' own names
(tid, lane, warp_id, bx, by; the template constants BM, BN, BK, P, C, R, RA, LD, FPT, TPP, WN, NJ,
MI; as32, av, acc, xok, xp, kend, g, t; B_WORDS the loop's it, r, half, unit, in_a, bq, bd;
SCATTER_STORE the store's v0, v1, col, out), and the tests hold the bodies' bits to one another.
A piece starts at its first line's indent and ends without its last newline: a body writes it
between two lines of its own.

- WARP_GEOMETRY: the k-step's pairs and floats a thread, and a warp's columns and tiles (COLS, BREG);
- B_WORDS: a thread's B item of a k-step, the record's code word and scale, zeros past the rows
  (COLS);
- SCATTER_STORE: two accumulators to y, times the routing weight where the rows scatter
  (WARP_TILE_STORE below);
- TILE_SETUP: the block's tile (expert, first sorted pair, pairs), this thread's pair of x and its
  FPT floats a k-step, bank-conflict-free by a swap of two bits of tid / TPP (COLS, BREG);
- A_TERMS: that thread's floats of the last k-step as two float16 terms' rows of A (COLS, BREG);
- X_LOADS: the next k-step's floats of x, 16-byte loads, zeros past the tile's pairs (every body);
- WARP_TILE_STORE: a warp's BM rows x WN columns of accumulators to y: hi + lo joined by a lane
  exchange, silu(g) u (HIDDEN) or the routing weight and the scatter (COLS, BREG)."""

from __future__ import annotations

import textwrap

WARP_GEOMETRY = r"""  constexpr int TP = BM / P;  // pairs a tile
  constexpr int FPT = TP * BK / NT;  // floats of x a thread loads per k-step (8: P = 2, 16: P = 1)
  constexpr int TPP = BK / FPT;  // threads a pair (TP * TPP = NT)
  constexpr int WN = BN / 4;  // columns a warp (all BM rows of the tile): 32 (BN 128) or 16
  constexpr int NJ = WN / 8;  // n-tiles a warp
  constexpr int MI = BM / 16;  // m-tiles a warp"""

B_WORDS = r"""        const uint32_t rr = HIDDEN ? unit : (in_a ? r : r - (uint32_t)RA);
        bq[it] = 0u;
        bd[it] = 0u;
        if (HIDDEN ? unit < (uint32_t)RA : r < (uint32_t)R) {
          bq[it] = ((const DEVICE uint32_t*)(rec + (in_a ? CA : CB)))[rr * (C / 16) + k0 / 16u + half];
          bd[it] = ((const DEVICE uint16_t*)(rec + (in_a ? SA : SB)))[rr * (C / 32) + k0 / 32u];
        }"""

SCATTER_STORE = r"""        if (SCATTER) {  // the routing weight, as grouped_experts applies it (one float32 product)
          v0 = v0 * wts[out];
          v1 = v1 * wts[out];
        }
        const uint64_t o = (uint64_t)out * R + col;
        if (col < (uint32_t)R) y[o] = v0;
        if (col + 1u < (uint32_t)R) y[o + 1] = v1;"""

TILE_SETUP = r"""  const uint32_t n0 = bx * BN;
  const int e = tiles[TILE_INTS * by], first = tiles[TILE_INTS * by + 1], count = tiles[TILE_INTS * by + 2];
  const DEVICE uint8_t* rec = arena + (uint64_t)e * SLOT;
  // A: this thread's pair and FPT of its k-step's floats. Row r's four 16-byte units sit at 5r mod 8
  // of the 8 bank groups (rows of 80 bytes), and a 16-byte store's phase is 8 lanes: swapping two bits
  // of tid / TPP puts a phase on rows 4 apart (P = 2) or {0, 1, 4, 5} (P = 1), 8 distinct groups
  const uint32_t q = tid / (uint32_t)TPP, sb = P == 2 ? 0u : 1u;
  const uint32_t my_pair = (q & ~(3u << sb)) | (((q >> sb) & 1u) << (sb + 1u)) | (((q >> (sb + 1u)) & 1u) << sb);
  const uint32_t seg = tid % (uint32_t)TPP;
  const bool xok = (int)my_pair < count;
  const uint32_t xrow = xok ? (GATHER ? (uint32_t)src[first + (int)my_pair] : (uint32_t)(first + (int)my_pair)) : 0u;
  const DEVICE float* xp = x + (uint64_t)xrow * (uint32_t)C + seg * (uint32_t)FPT;
  f4 acc[MI * NJ];  // [m-tile][n-tile]
  for (int j = 0; j < MI * NJ; ++j) { acc[j].v[0] = 0.0f; acc[j].v[1] = 0.0f; acc[j].v[2] = 0.0f; acc[j].v[3] = 0.0f; }
  f4 av[FPT / 4];  // the next k-step's floats of x, loaded while this one multiplies"""

A_TERMS = r"""      for (int q4 = 0; q4 < FPT / 8; ++q4) {  // 8 floats -> hi = f16(v), lo = f16(v - hi): 16-byte stores
        uint32_t hw[4], lw[4];
        for (int i = 0; i < 4; ++i) {
          const float v0 = av[2 * q4 + i / 2].v[(2 * i) % 4], v1 = av[2 * q4 + i / 2].v[(2 * i) % 4 + 1];
          const uint2 terms = split_h2(v0, v1);
          hw[i] = terms.x;
          lw[i] = P == 2 ? terms.y : 0u;
        }
        const uint32_t col = seg * (uint32_t)FPT + 8u * (uint32_t)q4, row = my_pair * (uint32_t)P;
        uint4 u;
        u.x = hw[0]; u.y = hw[1]; u.z = hw[2]; u.w = hw[3];
        *((SHARED_PTR(uint4))(as32 + (row * LD + col) / 2u)) = u;
        if (P == 2) {
          u.x = lw[0]; u.y = lw[1]; u.z = lw[2]; u.w = lw[3];
          *((SHARED_PTR(uint4))(as32 + ((row + 1u) * LD + col) / 2u)) = u;
        }
      }"""

X_LOADS = r"""      for (int i = 0; i < FPT / 4; ++i) {  // 16-byte loads (rows of C floats, seg and k0 multiples of 4)
        if (xok) {
          av[i] = load_f4(xp + k0 + 4u * (uint32_t)i);
        } else {
          av[i].v[0] = 0.0f; av[i].v[1] = 0.0f; av[i].v[2] = 0.0f; av[i].v[3] = 0.0f;
        }
      }"""

WARP_TILE_STORE = r"""  // P == 2: row g + 1 (the lo term of row g's pair, g even) is lane ^ 4's; every lane shuffles, the even rows keep
  for (int m = 0; m < MI; ++m) {
    fx16 hv;  // the m-tile's accumulators, [n-tile][4] (NJ <= 4)
    for (int i = 0; i < 16; ++i) hv.v[i] = 0.0f;
    for (int j = 0; j < NJ; ++j) for (int i = 0; i < 4; ++i) hv.v[4 * j + i] = acc[m * NJ + j].v[i];
    if (P == 2) {  // hi + lo, as lowp.join_rows adds them
      const fx16 lv = shfl_xor_fx16(hv, 4u);
      for (int i = 0; i < 4 * NJ; ++i) hv.v[i] = hv.v[i] + lv.v[i];
    }
    for (int h = 0; h < 2; ++h) {
      const uint32_t row = (uint32_t)(16 * m) + g + 8u * (uint32_t)h, pair = row / (uint32_t)P;
      const bool keep = row % (uint32_t)P == 0u && (int)pair < count;
      float v[NJ][2];
      for (int j = 0; j < NJ; ++j) { v[j][0] = hv.v[4 * j + 2 * h]; v[j][1] = hv.v[4 * j + 2 * h + 1]; }
      if (!keep) continue;
      if (HIDDEN) {  // silu(g) u of the warp's units (n-tile j: gate, j + NJ / 2: up), as the ops write it
        for (int j = 0; j < NJ / 2; ++j) {
          const uint32_t col = bx * (uint32_t)(BN / 2) + warp_id * (uint32_t)(WN / 2) + (uint32_t)(8 * j) + t;
          const float g0 = v[j][0], g1 = v[j][1], u0 = v[j + NJ / 2][0], u1 = v[j + NJ / 2][1];
          const uint64_t o = (uint64_t)(first + (int)pair) * RA + col;
          if (col < (uint32_t)RA) y[o] = g0 / (1.0f + exp_f(-g0)) * u0;  // experts.silu: x / (1 + exp(-x))
          if (col + 1u < (uint32_t)RA) y[o + 1] = g1 / (1.0f + exp_f(-g1)) * u1;
        }
      } else {
        const int pi = first + (int)pair;
        const uint32_t out = SCATTER ? (uint32_t)dst[pi] : (uint32_t)pi;
        for (int j = 0; j < NJ; ++j) {
          const uint32_t col = n0 + warp_id * (uint32_t)WN + (uint32_t)(8 * j) + t;
          float v0 = v[j][0], v1 = v[j][1];
""" + textwrap.indent(SCATTER_STORE, "  ") + r"""
        }
      }
    }
  }"""
