"""A Q2_0 tile kernel body (TileForm.COLS of kernels/q2_tiles.py; the down step's): the same tiles,
inputs, template and launch as the other, the same products bit for bit. Against the first form,
ROWS (deleted: at the tag lab-before-kernel-plan), it cuts the shared-memory traffic per `mma`,
which ncu measured as that form's wall (H200, 2048-token
prompt layer: L1/TEX throughput 92%, tensor pipe far from busy, 124 registers and 31.7 KB of
shared memory a block: 25% occupancy).

Shared-memory wavefronts (128 bytes each, one per cycle per SM) a block spends per k-step of 32
(BM 64 rows x BN 128 columns: 128 m16n8k16 `mma`), counted in the kernel texts:

| | first form (ROWS) | this form (COLS) |
|---|---|---|
| warp tile | 16 rows x 128 columns | 64 rows x 32 columns |
| A fragments (per warp, per 16 of k) | 4 LDS.32 (4) | 4 ldmatrix.x4 (16) |
| B fragments (per warp, per 16 of k) | 32 LDS.32 (32) | 2 ldmatrix.x4 (8) |
| fragment loads, 4 warps x 2 | 288 | 192 |
| B tile stores | 16 STS.32 a thread, rows 80 bytes apart and two threads a row: 4-way conflicts, 256 | 4 STS.128 a thread, 8 lanes of a phase on 8 consecutive rows: 64 |
| A tile stores | 2 STS.128 a thread, 2-way conflicts: 64 | pairs permuted so a phase's rows are 4 apart: 32 |
| per mma | ~4.7 | 2.25 |

so at the same L1 rate the k loop should take about half the time. Also: the lo terms' products
reach their hi rows by one warp shuffle (lane ^ 4 holds row g + 1 of the C fragment) instead of
a 16 KB shared array, so a block's shared memory is 15 KB.

Fragments: A and B by `mma_a_ldm` / `mma_b2_ldm` (preludes.py: one ldmatrix.x4 each on CUDA;
Metal and the emulator read the same values through pointers). Each accumulator still takes its
mma in k order, one per 16 of k, so the products are the first form's bits on every dialect.

HIDDEN: a warp's WN columns are WN / 2 gate rows and the same units' up rows (silu(g) u needs
both in one lane); unit = bx BN / 2 + warp WN / 2 + column % (WN / 2).

Shapes: as kernels/q2_tiles.py.
"""

from __future__ import annotations

from strata.mlx_backend.kernels import q2_tile_parts
from strata.mlx_backend.kernels.source import KernelSource

BODY = r"""
  constexpr int LD = BK + PAD;
  constexpr int BI = 2 * BN / NT;  // B items (one word of 16 codes and its scale) per thread
""" + q2_tile_parts.WARP_GEOMETRY + r"""
  SHARED uint32_t as32[BM * LD / 2];
  SHARED uint32_t bs32[BN * LD / 2];
  SHARED_PTR(uint16_t) as = (SHARED_PTR(uint16_t))as32;
  SHARED_PTR(uint16_t) bs = (SHARED_PTR(uint16_t))bs32;
""" + q2_tile_parts.TILE_SETUP + r"""
  uint32_t bq[BI], bd[BI];
  const uint32_t kend = count > 0 ? (uint32_t)C : 0u;  // block-uniform: an unused tile runs no k-step
  for (uint32_t k0 = 0; k0 <= kend; k0 += BK) {
    if (k0 > 0) {  // registers (k-step k0 - BK) -> shared; B dequantized: d (c - 2) from d's bits, exact
""" + q2_tile_parts.A_TERMS + r"""
      for (int it = 0; it < BI; ++it) {  // item i: row (i & 7) + 8 (i >> 4), half (i >> 3) & 1: a phase's 8 lanes
        const uint32_t i = tid + (uint32_t)(it * NT);  // on 8 consecutive rows, 8 distinct bank groups
        const uint32_t row = (i & 7u) | ((i >> 4) << 3), half = (i >> 3) & 1u;
        const uint32_t qw = bq[it], dbits = bd[it];
        const uint32_t mag = dbits & 0x7fffu, sgn = dbits & 0x8000u;
        const uint32_t two = (mag < 0x400u ? mag << 1 : mag + 0x400u) | sgn;  // 2d (subnormal d: a shift)
        // d (c - 2) for c = 0..3 as float16 bits, bytes 2c and 2c + 1 of {hi:lo}: -2d, -d, 0, d
        const uint32_t lo = (two ^ 0x8000u) | ((dbits ^ 0x8000u) << 16), hi = dbits << 16;
        uint32_t w[8];
        for (uint32_t j = 0; j < 4u; ++j) {  // two codes a word, picked by one byte permute; words j and j + 4's
          // selectors at once: nibbles j and j + 4's four codes a byte each, times 0x22 plus 0x10 (selector
          // nibbles 2c, 2c + 1; the permute reads the low 16 bits): (c & 3) 0x22 + (c >> 2) 0x2200 + 0x1010
          const uint32_t nib = (qw >> (4u * j)) & 0x000F000Fu;
          const uint32_t sel = ((nib | (nib << 6)) & 0x03030303u) * 0x22u + 0x10101010u;
          w[j] = byte_perm(lo, hi, sel);
          w[j + 4u] = byte_perm(lo, hi, sel >> 16);
        }
        SHARED_PTR(uint4) dstb = (SHARED_PTR(uint4))(bs32 + (row * LD + 16u * half) / 2u);  // 16-byte aligned
        uint4 u;
        u.x = w[0]; u.y = w[1]; u.z = w[2]; u.w = w[3];
        dstb[0] = u;
        u.x = w[4]; u.y = w[5]; u.z = w[6]; u.w = w[7];
        dstb[1] = u;
      }
      BARRIER();
    }
    if (k0 < kend) {  // issue the global loads of k-step k0 (rows past the tile's pairs or R read as zeros)
""" + q2_tile_parts.X_LOADS + r"""
      for (int it = 0; it < BI; ++it) {
        const uint32_t i = tid + (uint32_t)(it * NT);
        const uint32_t row = (i & 7u) | ((i >> 4) << 3), half = (i >> 3) & 1u, r = n0 + row;
        // HIDDEN: warp row / WN's columns are WN / 2 hidden units as gate rows, then the same units' up rows
        const uint32_t local = row % (uint32_t)WN;
        const uint32_t unit = bx * (uint32_t)(BN / 2) + (row / (uint32_t)WN) * (uint32_t)(WN / 2) + local % (uint32_t)(WN / 2);
        const bool in_a = HIDDEN ? local < (uint32_t)(WN / 2) : r < (uint32_t)RA;
""" + q2_tile_parts.B_WORDS + r"""
      }
    }
    if (k0 > 0) {  // multiply k-step k0 - BK from shared while k0's loads are in flight
      for (uint32_t kk = 0; kk < (uint32_t)BK; kk += 16u) {
        bfrag2 fb[NJ / 2];  // the warp's B fragments once for its MI m-tiles
        for (int jj = 0; jj < NJ / 2; ++jj) {
          fb[jj] = mma_b2_ldm(bs + (warp_id * (uint32_t)WN + (uint32_t)(16 * jj)) * LD + kk, LD, lane);
        }
        for (int m = 0; m < MI; ++m) {
          const afrag fa = mma_a_ldm(as + (uint32_t)(16 * m) * LD + kk, LD, lane);
          for (int j = 0; j < NJ; ++j) acc[m * NJ + j] = mma_16816_ab(acc[m * NJ + j], fa, fb[j / 2], j % 2, lane);
        }
      }
      BARRIER();
    }
  }
  const uint32_t g = lane >> 2, t = (lane & 3u) * 2u;
""" + q2_tile_parts.WARP_TILE_STORE + "\n"

SOURCE = KernelSource("strata_q2_tiles_cols", ("x", "src", "dst", "wts", "tiles", "arena"), ("y",), BODY)
