"""The Q2_0 tile kernel's second body (TileForm.COLS of kernels/q2_tiles.py): the same tiles, the
same inputs, template and launch, the same products bit for bit; what it changes is the
shared-memory traffic per `mma`, which ncu measured as the first form's wall (H200, 2048-token
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

from strata.mlx_backend.kernels.source import KernelSource

BODY = r"""
  constexpr int LD = BK + PAD;
  constexpr int BI = 2 * BN / NT;  // B items (one word of 16 codes and its scale) per thread
  constexpr int TP = BM / P;  // pairs a tile
  constexpr int FPT = TP * BK / NT;  // floats of x a thread loads per k-step (8: P = 2, 16: P = 1)
  constexpr int TPP = BK / FPT;  // threads a pair (TP * TPP = NT)
  constexpr int WN = BN / 4;  // columns a warp (all BM rows of the tile): 32 (BN 128) or 16
  constexpr int NJ = WN / 8;  // n-tiles a warp
  constexpr int MI = BM / 16;  // m-tiles a warp
  SHARED uint32_t as32[BM * LD / 2];
  SHARED uint32_t bs32[BN * LD / 2];
  SHARED_PTR(uint16_t) as = (SHARED_PTR(uint16_t))as32;
  SHARED_PTR(uint16_t) bs = (SHARED_PTR(uint16_t))bs32;
  const uint32_t n0 = bx * BN;
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
  f4 av[FPT / 4];  // the next k-step's floats of x, loaded while this one multiplies
  uint32_t bq[BI], bd[BI];
  const uint32_t kend = count > 0 ? (uint32_t)C : 0u;  // block-uniform: an unused tile runs no k-step
  for (uint32_t k0 = 0; k0 <= kend; k0 += BK) {
    if (k0 > 0) {  // registers (k-step k0 - BK) -> shared; B dequantized: d (c - 2) from d's bits, exact
      for (int q4 = 0; q4 < FPT / 8; ++q4) {  // 8 floats -> hi = f16(v), lo = f16(v - hi): 16-byte stores
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
      }
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
      for (int i = 0; i < FPT / 4; ++i) {  // 16-byte loads (rows of C floats, seg and k0 multiples of 4)
        if (xok) {
          av[i] = load_f4(xp + k0 + 4u * (uint32_t)i);
        } else {
          av[i].v[0] = 0.0f; av[i].v[1] = 0.0f; av[i].v[2] = 0.0f; av[i].v[3] = 0.0f;
        }
      }
      for (int it = 0; it < BI; ++it) {
        const uint32_t i = tid + (uint32_t)(it * NT);
        const uint32_t row = (i & 7u) | ((i >> 4) << 3), half = (i >> 3) & 1u, r = n0 + row;
        // HIDDEN: warp row / WN's columns are WN / 2 hidden units as gate rows, then the same units' up rows
        const uint32_t local = row % (uint32_t)WN;
        const uint32_t unit = bx * (uint32_t)(BN / 2) + (row / (uint32_t)WN) * (uint32_t)(WN / 2) + local % (uint32_t)(WN / 2);
        const bool in_a = HIDDEN ? local < (uint32_t)(WN / 2) : r < (uint32_t)RA;
        const uint32_t rr = HIDDEN ? unit : (in_a ? r : r - (uint32_t)RA);
        bq[it] = 0u;
        bd[it] = 0u;
        if (HIDDEN ? unit < (uint32_t)RA : r < (uint32_t)R) {
          bq[it] = ((const DEVICE uint32_t*)(rec + (in_a ? CA : CB)))[rr * (C / 16) + k0 / 16u + half];
          bd[it] = ((const DEVICE uint16_t*)(rec + (in_a ? SA : SB)))[rr * (C / 32) + k0 / 32u];
        }
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
  // P == 2: row g + 1 (the lo term of row g's pair, g even) is lane ^ 4's; every lane shuffles, the even rows keep
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
          if (SCATTER) {  // the routing weight, as grouped_experts applies it (one float32 product)
            v0 = v0 * wts[out];
            v1 = v1 * wts[out];
          }
          const uint64_t o = (uint64_t)out * R + col;
          if (col < (uint32_t)R) y[o] = v0;
          if (col + 1u < (uint32_t)R) y[o + 1] = v1;
        }
      }
    }
  }
"""

SOURCE = KernelSource("strata_q2_tiles_cols", ("x", "src", "dst", "wts", "tiles", "arena"), ("y",), BODY)
