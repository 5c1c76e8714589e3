"""A Q2_0 tile kernel body (TileForm.BREG of kernels/q2_tiles.py): COLS
(kernels/q2_tiles_cols.py: a warp 64 rows x BN / 4 columns) with B's fragments built in registers
straight from the record's words instead of through shared memory. In COLS a warp's columns are
read by that warp only, so staging them costs shared traffic for no reuse: per block and k-step
of 32 (128 mma) B's 64 store wavefronts and 64 ldmatrix wavefronts go, leaving A's 32 stores and
128 loads (1.25 a mma instead of 2.25). The global words are the same (each row's two words of a
k-step and its scale, now an 8-byte load a lane, the 4 lanes of a column reading the same bytes);
the dequantization is the same byte permute, lane t taking nibbles t and t + 4 of each word (its
fragment's k = 2t, 2t + 1 and 2t + 8, 2t + 9), so the same bits as COLS.

The emulator and Metal multiply through `mma_16816_ar` over the lanes' published registers (a
[NT, 16] word SHARED array: their dot products need other lanes' B); CUDA passes the registers
to `mma` and publishes nothing.

Shapes: as kernels/q2_tiles.py.
"""

from __future__ import annotations

from strata.mlx_backend.kernels import q2_tile_parts
from strata.mlx_backend.kernels.source import KernelSource

_BODY = r"""
  constexpr int LD = BK + PAD;
""" + q2_tile_parts.WARP_GEOMETRY + r"""
  constexpr int ST = @STAGES@;  // A stages: 2 alternate by k-step (one barrier a k-step keeps writes off a stage in use)
  SHARED uint32_t as_all[ST * BM * LD / 2];
  SHARED uint32_t bxch[BREG_XCHG ? ST * NT * 16 : 1];  // the emulator's and Metal's view of the B registers
  const uint32_t g = lane >> 2, t = (lane & 3u) * 2u;
""" + q2_tile_parts.TILE_SETUP + r"""
  // B: a warp's columns are its own (no other warp reads them), so each lane dequantizes its m16n8k16
  // fragments straight from the record's words: column g of n-tile j is block row WN warp + 8 j + g,
  // its k-step's two words and scale in registers; lane t's codes are nibbles t and t + 4 of each word
  uint32_t bq[NJ][2], bd[NJ];
  u16w bf;  // [n-tile][16 of k][b0, b1]: the k-step's fragments, dequantized while the next one loads
  for (int i = 0; i < 16; ++i) bf.v[i] = 0u;
  const uint32_t kend = count > 0 ? (uint32_t)C : 0u;  // block-uniform: an unused tile runs no k-step
  for (uint32_t k0 = 0; k0 <= kend; k0 += BK) {
    const uint32_t stage = ST == 2 ? (k0 / (uint32_t)BK) & 1u : 0u;  // k-step k0 - BK's stage
    SHARED_PTR(uint32_t) as32 = as_all + stage * (uint32_t)(BM * LD / 2);
    SHARED_PTR(uint16_t) as = (SHARED_PTR(uint16_t))as32;
    SHARED_PTR(uint32_t) xw = bxch + (BREG_XCHG ? (stage * (uint32_t)NT + warp_id * 32u) * 16u : 0u);
    if (k0 > 0) {  // registers (k-step k0 - BK) -> shared; B dequantized: d (c - 2) from d's bits, exact
""" + q2_tile_parts.A_TERMS + r"""
      for (int j = 0; j < NJ; ++j) {  // d (c - 2) for c = 0..3 as float16 bits, bytes 2c and 2c + 1 of {hi:lo}
        const uint32_t dbits = bd[j], mag = dbits & 0x7fffu, sgn = dbits & 0x8000u;
        const uint32_t two = (mag < 0x400u ? mag << 1 : mag + 0x400u) | sgn;  // 2d (subnormal d: a shift)
        const uint32_t lo = (two ^ 0x8000u) | ((dbits ^ 0x8000u) << 16), hi = dbits << 16;
        for (int hf = 0; hf < 2; ++hf) {  // b0: k = 2t, 2t + 1 (nibble lane % 4); b1: k + 8 (that nibble + 4)
          // both permute selectors at once: the two nibbles' four codes a byte each, times 0x22 plus 0x10
          // (selector nibbles 2c, 2c + 1), the permute reading the low 16 bits: (c & 3) 0x22 + (c >> 2)
          // 0x2200 + 0x1010 of each nibble c in 6 instructions for two words instead of 12
          const uint32_t w = (bq[j][hf] >> (2u * t)) & 0x000F000Fu;
          const uint32_t sel = ((w | (w << 6)) & 0x03030303u) * 0x22u + 0x10101010u;
          bf.v[4 * j + 2 * hf] = byte_perm(lo, hi, sel);
          bf.v[4 * j + 2 * hf + 1] = byte_perm(lo, hi, sel >> 16);
        }
      }
      breg_publish(xw, bf, lane);
      BARRIER();
    }
    if (k0 < kend) {  // issue the global loads of k-step k0 (rows past the tile's pairs or R read as zeros)
""" + q2_tile_parts.X_LOADS + r"""
      for (int j = 0; j < NJ; ++j) {
        const uint32_t row = warp_id * (uint32_t)WN + (uint32_t)(8 * j) + g, r = n0 + row;
        // HIDDEN: the warp's columns are WN / 2 hidden units as gate rows, then the same units' up rows
        const uint32_t local = row % (uint32_t)WN;
        const uint32_t unit = bx * (uint32_t)(BN / 2) + warp_id * (uint32_t)(WN / 2) + local % (uint32_t)(WN / 2);
        const bool in_a = HIDDEN ? local < (uint32_t)(WN / 2) : r < (uint32_t)RA;
        const uint32_t rr = HIDDEN ? unit : (in_a ? r : r - (uint32_t)RA);
        bq[j][0] = 0u;
        bq[j][1] = 0u;
        bd[j] = 0u;
        if (HIDDEN ? unit < (uint32_t)RA : r < (uint32_t)R) {  // the k-step's two words: 8 bytes, aligned
          const uint2 u = *((const DEVICE uint2*)(rec + (in_a ? CA : CB)) + (rr * (C / 16) + k0 / 16u) / 2u);
          bq[j][0] = u.x;
          bq[j][1] = u.y;
          bd[j] = ((const DEVICE uint16_t*)(rec + (in_a ? SA : SB)))[rr * (C / 32) + k0 / 32u];
        }
      }
    }
    if (k0 > 0) {  // multiply k-step k0 - BK from shared while k0's loads are in flight
      for (uint32_t kk = 0; kk < (uint32_t)BK; kk += 16u) {
        const int hf = (int)(kk / 16u);
        for (int m = 0; m < MI; ++m) {
          const afrag fa = mma_a_ldm(as + (uint32_t)(16 * m) * LD + kk, LD, lane);
          for (int j = 0; j < NJ; ++j) {
            acc[m * NJ + j] = mma_16816_ar(acc[m * NJ + j], fa, bf.v[4 * j + 2 * hf], bf.v[4 * j + 2 * hf + 1], xw,
                                           4 * j + 2 * hf, lane);
          }
        }
      }
      if (ST == 1) BARRIER();  // one stage: the next k-step's stores wait for every warp's multiply
    }
  }
""" + q2_tile_parts.WARP_TILE_STORE + "\n"

SOURCE = KernelSource("strata_q2_tiles_breg", ("x", "src", "dst", "wts", "tiles", "arena"), ("y",),
                      _BODY.replace("@STAGES@", "1"))
