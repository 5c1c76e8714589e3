"""Grouped GEMM over Q2_0 arena records on the matrix units: Y[e] = X[e] W_e^T, W_e's Q2_0 blocks
dequantized tile by tile into shared memory (never a float16 copy of the layer's experts in
global memory, which is what the ops form writes and reads again: 2.26 GB a layer at the seed
shape, ~107 ms of a 2048-token prompt's ~48 layers).

Work split: block (bx, by, e) computes rows by*BM.. of expert e's padded rows (X [E, M, C],
float16, the prompt path's [E, P cap, C] buffer) against output columns bx*BN.. of W_e [R, C],
whose rows come from one or two record planes (gate | up stacked: rows < RA from plane a, the
rest from plane b). Per k-step of BK = 32 (one Q2_0 block per row): 128 threads copy the A tile
(64 x 32 halves) and dequantize the B tile (128 rows x 32 codes: a uint32 word of 16 codes per
item; d (q - 2) built from d's float16 bits, exact), then each of the 4 warps multiplies its 16
rows by the 128 columns: 2 x 16 `mma_16816` (preludes.py: CUDA's m16n8k16 tensor-core `mma`; Metal
and the emulator compute the same four dot products per lane in float32).

One shared stage; the next k-step's global words are loaded into registers while this one
multiplies (no cp.async yet): a first form whose H200 time says what the next step is
(benchmarks/prompt.py --mlx times it beside the ops forms).

Shapes:
    x float16 [E, M, C]; arena uint8 [S, SLOT]; slots int32 [E] (expert e's record) -> y float32 [E, M, R]
"""

from __future__ import annotations

import mlx.core as mx

from strata.formats.expert_record import RecordLayout
from strata.mlx_backend.kernels.launch import launch
from strata.mlx_backend.kernels.source import KernelSource

THREADS = 128
BM, BN, BK = 64, 128, 32  # BN: each A tile is re-read R / BN times (from L2): 9 for gate | up at the seed shape
PAD = 8  # halves of padding per shared row: rows 80 bytes apart, not 64 (fewer bank conflicts)

BODY = r"""
  constexpr int LD = BK + PAD;
  constexpr int AI = 2 * BM / NT;  // A items (8 words of one row) per thread per k-step
  constexpr int BI = 2 * BN / NT;  // B items (one word of 16 codes and its scale) per thread
  SHARED uint32_t as32[BM * LD / 2];  // words (4-byte aligned: the fragments' loads, two halves a store)
  SHARED uint32_t bs32[BN * LD / 2];
  SHARED_PTR(uint16_t) as = (SHARED_PTR(uint16_t))as32;  // the same tiles as float16 bits, rows of LD
  SHARED_PTR(uint16_t) bs = (SHARED_PTR(uint16_t))bs32;
  const uint32_t n0 = bx * BN, m0 = by * BM, e = bz;
  const DEVICE uint8_t* rec = arena + (uint64_t)slots[e] * SLOT;
  const DEVICE uint32_t* xr = (const DEVICE uint32_t*)x;
  f4 acc[BN / 8];
  for (int j = 0; j < BN / 8; ++j) { acc[j].v[0] = 0.0f; acc[j].v[1] = 0.0f; acc[j].v[2] = 0.0f; acc[j].v[3] = 0.0f; }
  uint32_t aw[AI][8];  // the next k-step's global words, loaded while this one multiplies
  uint32_t bq[BI], bd[BI];
  for (uint32_t k0 = 0; k0 <= (uint32_t)C; k0 += BK) {
    if (k0 > 0) {  // registers (k-step k0 - BK) -> shared; B dequantized: d (c - 2) from d's bits, exact
      for (int it = 0; it < AI; ++it) {
        const uint32_t i = tid + (uint32_t)(it * NT), row = i >> 1, part = i & 1u;
        for (uint32_t j = 0; j < 8u; ++j) as32[(row * LD + 16u * part) / 2u + j] = aw[it][j];
      }
      for (int it = 0; it < BI; ++it) {
        const uint32_t i = tid + (uint32_t)(it * NT), row = i >> 1, part = i & 1u;
        const uint32_t q = bq[it], dbits = bd[it];
        const uint32_t mag = dbits & 0x7fffu, sgn = dbits & 0x8000u;
        const uint32_t two = (mag < 0x400u ? mag << 1 : mag + 0x400u) | sgn;  // 2d (subnormal d: a shift)
        for (uint32_t j = 0; j < 8u; ++j) {  // two codes a store: the halves of one word
          const uint32_t c0 = (q >> (4u * j)) & 3u, c1 = (q >> (4u * j + 2u)) & 3u;
          const uint32_t v0 = c0 == 3u ? dbits : c0 == 2u ? 0u : c0 == 1u ? (dbits ^ 0x8000u) : (two ^ 0x8000u);
          const uint32_t v1 = c1 == 3u ? dbits : c1 == 2u ? 0u : c1 == 1u ? (dbits ^ 0x8000u) : (two ^ 0x8000u);
          bs32[(row * LD + 16u * part) / 2u + j] = v0 | (v1 << 16);
        }
      }
      BARRIER();
    }
    if (k0 < (uint32_t)C) {  // issue the global loads of k-step k0 (rows past M or R read as zeros)
      for (int it = 0; it < AI; ++it) {
        const uint32_t i = tid + (uint32_t)(it * NT), row = i >> 1, part = i & 1u, m = m0 + row;
        for (uint32_t j = 0; j < 8u; ++j) {
          aw[it][j] = m < (uint32_t)M ? xr[(((uint64_t)e * M + m) * C + k0 + 16u * part) / 2u + j] : 0u;
        }
      }
      for (int it = 0; it < BI; ++it) {
        const uint32_t i = tid + (uint32_t)(it * NT), row = i >> 1, part = i & 1u, r = n0 + row;
        bq[it] = 0u;
        bd[it] = 0u;
        if (r < (uint32_t)R) {
          const bool first = r < (uint32_t)RA;
          const uint32_t rr = first ? r : r - (uint32_t)RA;
          bq[it] = ((const DEVICE uint32_t*)(rec + (first ? CA : CB)))[rr * (C / 16) + k0 / 16u + part];
          bd[it] = ((const DEVICE uint16_t*)(rec + (first ? SA : SB)))[rr * (C / 32) + k0 / 32u];
        }
      }
    }
    if (k0 > 0) {  // multiply k-step k0 - BK from shared while k0's loads are in flight
      for (uint32_t kk = 0; kk < (uint32_t)BK; kk += 16u) {
        for (int j = 0; j < BN / 8; ++j) {
          acc[j] = mma_16816(acc[j], as + (warp_id * 16u) * LD + kk, LD, bs + (uint32_t)(8 * j) * LD + kk, LD, lane);
        }
      }
      BARRIER();
    }
  }
  const uint32_t g = lane >> 2, t = (lane & 3u) * 2u;
  for (int j = 0; j < BN / 8; ++j) {
    const uint32_t col = n0 + (uint32_t)(8 * j) + t;
    for (int h = 0; h < 2; ++h) {
      const uint32_t m = m0 + warp_id * 16u + g + 8u * (uint32_t)h;
      if (m < (uint32_t)M) {
        const uint64_t o = ((uint64_t)e * M + m) * R + col;
        if (col < (uint32_t)R) y[o] = acc[j].v[2 * h];
        if (col + 1u < (uint32_t)R) y[o + 1] = acc[j].v[2 * h + 1];
      }
    }
  }
"""

SOURCE = KernelSource("strata_q2_mma", ("x", "arena", "slots"), ("y",), BODY)


def q2_mma(x: mx.array, arena: mx.array, slots: mx.array, rec: RecordLayout, planes: tuple[str, ...]) -> mx.array:
    """Y[e] = X[e] W_e^T with W_e the `planes` of record slots[e], stacked by rows (("gate", "up"):
    [2F, D]; ("down",): [D, F]).

    Shapes:
        x float16 [E, M, C]; arena uint8 [S, SLOT]; slots int32 [E] -> float32 [E, M, R]
    """
    e, m, c = x.shape
    shapes = [rec.shape(p) for p in planes]
    if any(cols != c for _, cols in shapes) or c % BK:
        raise ValueError(f"q2_mma: planes {planes} of {shapes} against x's {c} columns (a multiple of {BK})")
    ra = shapes[0][0]
    r = sum(rows for rows, _ in shapes)
    a, b = planes[0], planes[-1]
    template = (("C", c), ("M", m), ("R", r), ("RA", ra), ("CA", rec.codes(a).offset), ("SA", rec.scales(a).offset),
                ("CB", rec.codes(b).offset), ("SB", rec.scales(b).offset), ("SLOT", arena.shape[1]),
                ("BM", BM), ("BN", BN), ("BK", BK), ("PAD", PAD), ("NT", THREADS))
    return launch(SOURCE, [x, arena, slots], [(e, m, r)], [mx.float32],
                  blocks=(-(-r // BN), -(-m // BM), e), threads=THREADS, template=template)[0]
