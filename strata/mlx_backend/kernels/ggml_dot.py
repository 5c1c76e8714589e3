"""llama.cpp's weight blocks inside a kernel: one decoder per type, written once, read by every
kernel that multiplies such rows (the fused expert kernel, kernels/moe_ggml.py; the dense GEMV,
kernels/ggml_gemv.py).

The unit is a *group*: 32 consecutive weights of a row, the smallest run every type's scales
respect (a 32-weight block; a K / IQ super-block's sub-block of 32, whose scales come in one or
two halves of 16). `gg_dot32(ty, bb, row, srow, g, p)` returns Σ_j w_j p[j] over group g of a row
whose blocks start at `row` (bb bytes each; Q8_0, which strata stores as two planes, reads its
codes at `row` and its float16 scales at `srow`): the partner p (x, or the hidden h) is 32 floats
in threadgroup memory. Per type the sum is the reference's values in another order:
scale x Σ q p, minus min x Σ p where the type has a min (Q5_1's plus), per group or half group;
the reference (strata/reference/ggml_quants.py) forms each weight as (d·sc)·q − dmin·m and then the
float32 matmul, so the two agree to float32 reordering.

Byte layouts are ggml's (strata/formats/ggml_blocks.py: the one definition); the field offsets
below are asserted against those numpy dtypes at import, and the small tables (IQ4_NL's and
MXFP4's 16 values) are packed into words from ggml_blocks' arrays, never retyped. Words are read
as uint32 where the block size and field offset are multiples of 4 (Q4_K, Q5_K, Q2_K, IQ4_XS,
Q5_1, Q8_0's planes), else byte by byte (Q6_K's 210-byte blocks, Q3_K's 110, IQ4_NL's 18, Q5_0's 22,
MXFP4's 17): a row of them is not 4-byte aligned past its first block.

Shapes:
    row: one weight row's blocks, uint8 [cols / QK * bb]; p: float [32] -> float
"""

from __future__ import annotations

import numpy as np

from strata.formats import ggml_blocks
from strata.formats.quant_types import QuantType, ggml_block_name, layout

# the types with a decoder here; Q8_0 is read from its two planes (codes, then float16 scales)
TYPES = (QuantType.Q4_K, QuantType.Q6_K, QuantType.Q8_0, QuantType.Q5_K, QuantType.IQ4_NL, QuantType.IQ4_XS,
         QuantType.GGML_MXFP4, QuantType.Q5_1, QuantType.Q5_0, QuantType.Q3_K, QuantType.Q2_K, QuantType.IQ3_S,
         QuantType.IQ2_XXS)
GROUP = 32  # weights per group (gg_dot32's unit)


def block_bytes(qtype: QuantType) -> int:
    """bb: the bytes of one block as a row stores it (Q8_0's codes plane: 32 bytes a block)."""
    lay = layout(qtype)
    return lay.code_bytes


def _field(name: str, field: str) -> int:
    return ggml_blocks.BLOCK_DTYPES[name][1].fields[field][1]


# (type, field) -> byte offset inside the block, as the kernels below hard-code it
_OFFSETS = {("Q4_K", "d"): 0, ("Q4_K", "dmin"): 2, ("Q4_K", "scales"): 4, ("Q4_K", "qs"): 16,
            ("Q5_K", "d"): 0, ("Q5_K", "dmin"): 2, ("Q5_K", "scales"): 4, ("Q5_K", "qh"): 16, ("Q5_K", "qs"): 48,
            ("Q6_K", "ql"): 0, ("Q6_K", "qh"): 128, ("Q6_K", "scales"): 192, ("Q6_K", "d"): 208,
            ("Q3_K", "hmask"): 0, ("Q3_K", "qs"): 32, ("Q3_K", "scales"): 96, ("Q3_K", "d"): 108,
            ("Q2_K", "scales"): 0, ("Q2_K", "qs"): 16, ("Q2_K", "d"): 80, ("Q2_K", "dmin"): 82,
            ("IQ4_NL", "d"): 0, ("IQ4_NL", "qs"): 2, ("IQ4_XS", "d"): 0, ("IQ4_XS", "scales_h"): 2,
            ("IQ4_XS", "scales_l"): 4, ("IQ4_XS", "qs"): 8, ("MXFP4", "e"): 0, ("MXFP4", "qs"): 1,
            ("Q5_1", "d"): 0, ("Q5_1", "m"): 2, ("Q5_1", "qh"): 4, ("Q5_1", "qs"): 8,
            ("Q5_0", "d"): 0, ("Q5_0", "qh"): 2, ("Q5_0", "qs"): 6,
            ("IQ3_S", "d"): 0, ("IQ3_S", "qs"): 2, ("IQ3_S", "qh"): 66, ("IQ3_S", "signs"): 74, ("IQ3_S", "scales"): 106,
            ("IQ2_XXS", "d"): 0, ("IQ2_XXS", "qs"): 2}
for (_name, _f), _off in _OFFSETS.items():
    assert _field(_name, _f) == _off, (_name, _f)
for _q in TYPES:
    if _q is not QuantType.Q8_0:
        assert block_bytes(_q) == ggml_blocks.BLOCK_BYTES[ggml_block_name(_q)], _q
assert layout(QuantType.Q8_0).code_bytes == GROUP and layout(QuantType.Q8_0).scale_bytes == 2
del _name, _f, _off, _q


# The grids the IQ types index (ggml's iq3s_grid: 512 rows of 4 bytes; iq2xxs_grid: 256 rows of 8),
# packed as uint32 words into one device table every kernel of these types takes as an input
# (`tables()`): a row's byte k is its value k, as ggml's uint32 / uint64 entries hold them.
IQ3S_GRID, IQ2XXS_GRID = 0, 512  # word offsets in the table


def table_words() -> np.ndarray:
    """The grids as one uint32 table (IQ3S_GRID, IQ2XXS_GRID offsets). [1024] uint32"""
    iq3s = ggml_blocks.grid("iq3s").astype(np.uint8)  # [512, 4]
    iq2xxs = ggml_blocks.grid("iq2xxs").astype(np.uint8)  # [256, 8]
    words = np.concatenate([iq3s.reshape(-1), iq2xxs.reshape(-1)]).view("<u4")
    assert words.size == IQ2XXS_GRID + 512 and iq3s.shape == (512, 4) and iq2xxs.shape == (256, 8)
    return np.ascontiguousarray(words, np.uint32)


def tables():
    """`table_words` as a device constant, made once (a kernel input; kernels/launch.device_const)."""
    from strata.mlx_backend.kernels.launch import device_const

    return device_const(table_words())


def _words(values: np.ndarray) -> str:
    """16 int8 table values as four uint32 literals, value n in byte n % 4 of word n / 4."""
    b = np.asarray(values, np.int8).view(np.uint8).reshape(4, 4).astype(np.uint32)
    return ", ".join(f"0x{int(w[0] | (w[1] << 8) | (w[2] << 16) | (w[3] << 24)):08X}u" for w in b)


def _table(name: str, values: np.ndarray) -> str:
    w = _words(values)
    return (f"INLINE int {name}(uint32_t n) {{  // the type's table value of nibble n (int8, sign-extended)\n"
            f"  const uint32_t w0 = {w.split(', ')[0]}, w1 = {w.split(', ')[1]}, w2 = {w.split(', ')[2]}, "
            f"w3 = {w.split(', ')[3]};\n"
            f"  const uint32_t w = n < 4u ? w0 : (n < 8u ? w1 : (n < 12u ? w2 : w3));\n"
            f"  return ((int32_t)(w << (24u - 8u * (n & 3u)))) >> 24;\n}}\n")


_DEFINES = "".join(f"#define GG_{ggml_block_name(q)} {int(q)}\n" for q in TYPES) + (
    f"#define GG_IQ3S_GRID {IQ3S_GRID}\n#define GG_IQ2XXS_GRID {IQ2XXS_GRID}\n")

HELPERS = _DEFINES + _table("gg_iq4nl", ggml_blocks.KVALUES_IQ4NL) + _table("gg_mxfp4", ggml_blocks.KVALUES_MXFP4) + r"""
INLINE uint32_t gg_u8(const DEVICE uint8_t* p, int i) { return (uint32_t)p[i]; }
// 4 bytes at p + i, little-endian: one load where block size and offset keep it 4-byte aligned
INLINE uint32_t gg_u32(const DEVICE uint8_t* p, int i, bool aligned) {
  if (aligned) return *(const DEVICE uint32_t*)(p + i);
  return gg_u8(p, i) | (gg_u8(p, i + 1) << 8) | (gg_u8(p, i + 2) << 16) | (gg_u8(p, i + 3) << 24);
}
INLINE float gg_f16(const DEVICE uint8_t* p, int i) { return F32(*(const DEVICE half_t*)(p + i)); }  // fields 2-aligned
INLINE int gg_s8(uint32_t v) { return ((int32_t)(v << 24)) >> 24; }  // a byte as int8
// GGML_E8M0_TO_FP32_HALF: 2^(e - 128) from its bits (e < 2: a subnormal)
INLINE float gg_e8m0_half(uint32_t e) { return bits_f32(e < 2u ? (0x00200000u << e) : ((e - 1u) << 23)); }
// Q4_K / Q5_K's 6-bit scale (min: 0) or min (1) of sub-block j (ggml's get_scale_min_k4), from the 12 bytes at s
INLINE float gg_k4(const DEVICE uint8_t* s, int j, int min) {
  if (j < 4) return F32((int)(gg_u8(s, j + 4 * min) & 63u));
  return F32((int)(min ? (gg_u8(s, j + 4) >> 4) | ((gg_u8(s, j) >> 6) << 4)
                       : (gg_u8(s, j + 4) & 0xFu) | ((gg_u8(s, j - 4) >> 6) << 4)));
}
// Q3_K's 6-bit scale k (0..15) from its 12 bytes, less 32
INLINE int gg_q3k_scale(const DEVICE uint8_t* s, int k) {
  const uint32_t lo = (gg_u8(s, k % 8) >> (4 * (k / 8))) & 0xFu, hi = (gg_u8(s, 8 + k % 4) >> (2 * (k / 4))) & 3u;
  return (int)(lo | (hi << 4)) - 32;
}
// ggml's ksigns_iq2xs: 7 sign bits and their parity as the 8th (an even number of minus signs)
INLINE uint32_t gg_ksigns(uint32_t i) {
  uint32_t q = i ^ (i >> 4);
  q ^= q >> 2;
  q ^= q >> 1;
  return i | ((q & 1u) << 7);
}
// Σ over 8 weights of grid bytes (two words) x signs (bit k: weight k negative) x p[k]
INLINE float gg_grid8(uint32_t lo, uint32_t hi, uint32_t signs, const SHARED_PTR(float) p) {
  float s = 0.0f;
  UNROLL for (int k = 0; k < 8; ++k) {
    const float v = F32((int)(((k < 4 ? lo : hi) >> (8 * (k & 3))) & 0xFFu));
    s += ((signs >> k) & 1u ? -v : v) * p[k];
  }
  return s;
}
// Σ_j w_j p[j] over the 32 weights of group g of a row of type ty (blocks of bb bytes at row;
// Q8_0's float16 scales at srow; tab: the IQ grids, `table_words`)
INLINE float gg_dot32(int ty, int bb, const DEVICE uint8_t* row, const DEVICE uint8_t* srow, int g,
                      const SHARED_PTR(float) p, const DEVICE uint32_t* tab) {
  const bool al = (bb & 3) == 0;
  if (ty == GG_Q8_0) {  // codes plane: 32 int8 a group; scales plane: float16 d a group
    const DEVICE uint8_t* q = row + (uint64_t)g * 32u;
    float s = 0.0f;
    UNROLL for (int w = 0; w < 8; ++w) {
      const uint32_t v = gg_u32(q, 4 * w, true);
      UNROLL for (int k = 0; k < 4; ++k) s += F32(gg_s8(v >> (8 * k))) * p[4 * w + k];
    }
    return gg_f16(srow, 2 * g) * s;
  }
  if (ty == GG_IQ4_NL || ty == GG_MXFP4 || ty == GG_Q5_1 || ty == GG_Q5_0) {  // 32-weight blocks, ggml's nibble order
    const DEVICE uint8_t* b = row + (uint64_t)g * (uint32_t)bb;
    const int qo = ty == GG_IQ4_NL ? 2 : (ty == GG_MXFP4 ? 1 : (ty == GG_Q5_0 ? 6 : 8));
    const uint32_t qh = ty == GG_Q5_1 ? gg_u32(b, 4, al) : (ty == GG_Q5_0 ? gg_u32(b, 2, false) : 0u);
    float s = 0.0f, sx = 0.0f;
    UNROLL for (int w = 0; w < 4; ++w) {
      const uint32_t v = gg_u32(b, qo + 4 * w, al && (qo & 3) == 0);
      UNROLL for (int k = 0; k < 4; ++k) {
        const int j = 4 * w + k;  // weight j: the low nibble of byte j; weight j + 16: its high nibble
        const uint32_t lo = (v >> (8 * k)) & 0xFu, hi = (v >> (8 * k + 4)) & 0xFu;
        float vl, vh;
        if (ty == GG_Q5_1) {
          vl = F32((int)(lo | (((qh >> j) & 1u) << 4)));
          vh = F32((int)(hi | (((qh >> (j + 16)) & 1u) << 4)));
          sx += p[j] + p[j + 16];
        } else if (ty == GG_Q5_0) {  // q - 16
          vl = F32((int)(lo | (((qh >> j) & 1u) << 4)) - 16);
          vh = F32((int)(hi | (((qh >> (j + 16)) & 1u) << 4)) - 16);
        } else if (ty == GG_IQ4_NL) {
          vl = F32(gg_iq4nl(lo)); vh = F32(gg_iq4nl(hi));
        } else {
          vl = F32(gg_mxfp4(lo)); vh = F32(gg_mxfp4(hi));
        }
        s += vl * p[j] + vh * p[j + 16];
      }
    }
    if (ty == GG_Q5_1) return gg_f16(b, 0) * s + gg_f16(b, 2) * sx;
    if (ty == GG_IQ4_NL || ty == GG_Q5_0) return gg_f16(b, 0) * s;
    return gg_e8m0_half(gg_u8(b, 0)) * s;
  }
  // 256-weight super-blocks: sub-block j = g % 8 of block g / 8
  const DEVICE uint8_t* b = row + (uint64_t)(g >> 3) * (uint32_t)bb;
  const int j = g & 7;
  if (ty == GG_Q4_K || ty == GG_Q5_K) {  // weight l: nibble j % 2 of qs[32 (j / 2) + l] (+ 16 x bit j of qh[l])
    const float sc = gg_k4(b + 4, j, 0), mn = gg_k4(b + 4, j, 1);
    const int qo = (ty == GG_Q4_K ? 16 : 48) + 32 * (j >> 1), sh = 4 * (j & 1);
    float s = 0.0f, sx = 0.0f;
    UNROLL for (int w = 0; w < 8; ++w) {
      const uint32_t v = gg_u32(b, qo + 4 * w, al);
      const uint32_t h = ty == GG_Q5_K ? gg_u32(b, 16 + 4 * w, al) : 0u;
      UNROLL for (int k = 0; k < 4; ++k) {
        const uint32_t q = ((v >> (8 * k + sh)) & 0xFu) | (((h >> (8 * k + j)) & 1u) << 4);
        s += F32((int)q) * p[4 * w + k];
        sx += p[4 * w + k];
      }
    }
    return (gg_f16(b, 0) * sc) * s - (gg_f16(b, 2) * mn) * sx;
  }
  if (ty == GG_IQ3_S) {  // 8 grid rows (qs byte | bit i of qh[j] << 8) of 4, a sign byte per 8; db = d (1 + 2 scale)
    const uint32_t qh = gg_u8(b, 66 + j);
    float s = 0.0f;
    UNROLL for (int l = 0; l < 4; ++l) {  // weights 8l .. 8l + 7: grid rows 2l, 2l + 1
      const uint32_t i0 = gg_u8(b, 2 + 8 * j + 2 * l) | (((qh >> (2 * l)) & 1u) << 8);
      const uint32_t i1 = gg_u8(b, 3 + 8 * j + 2 * l) | (((qh >> (2 * l + 1)) & 1u) << 8);
      s += gg_grid8(tab[GG_IQ3S_GRID + i0], tab[GG_IQ3S_GRID + i1], gg_u8(b, 74 + 4 * j + l), p + 8 * l);
    }
    const uint32_t sc = (gg_u8(b, 106 + j / 2) >> (4 * (j & 1))) & 0xFu;
    return (gg_f16(b, 0) * F32((int)(1u + 2u * sc))) * s;
  }
  if (ty == GG_IQ2_XXS) {  // two u32: 4 grid rows of 8 (bytes of the first), 4 x 7 sign bits + a scale (the second)
    const uint32_t a0 = gg_u32(b, 2 + 8 * j, false), a1 = gg_u32(b, 6 + 8 * j, false);
    float s = 0.0f;
    UNROLL for (int l = 0; l < 4; ++l) {
      const uint32_t r = GG_IQ2XXS_GRID + 2u * ((a0 >> (8 * l)) & 0xFFu);
      s += gg_grid8(tab[r], tab[r + 1u], gg_ksigns((a1 >> (7 * l)) & 127u), p + 8 * l);
    }
    return ((gg_f16(b, 0) * (0.5f + F32((int)(a1 >> 28)))) * 0.25f) * s;
  }
  if (ty == GG_IQ4_XS) {  // dl = d (6-bit scale - 32); the 16 bytes of sub-block j as IQ4_NL's
    const uint32_t sl = (gg_u8(b, 4 + j / 2) >> (4 * (j & 1))) & 0xFu;
    const uint32_t shi = ((gg_u8(b, 2) | (gg_u8(b, 3) << 8)) >> (2 * j)) & 3u;
    float s = 0.0f;
    UNROLL for (int w = 0; w < 4; ++w) {
      const uint32_t v = gg_u32(b, 8 + 16 * j + 4 * w, al);
      UNROLL for (int k = 0; k < 4; ++k) {
        const int l = 4 * w + k;
        s += F32(gg_iq4nl((v >> (8 * k)) & 0xFu)) * p[l] + F32(gg_iq4nl((v >> (8 * k + 4)) & 0xFu)) * p[l + 16];
      }
    }
    return (gg_f16(b, 0) * F32((int)(sl | (shi << 4)) - 32)) * s;
  }
  // Q6_K, Q3_K, Q2_K: sub-block j = 4 h + k of weights 128 h + 32 k + l, a scale per 16 weights
  const int h = j >> 2, k2 = j & 3;
  float s0 = 0.0f, s1 = 0.0f, x0 = 0.0f, x1 = 0.0f;
  if (ty == GG_Q6_K) {  // nibble k / 2 of ql[64 h + 32 (k % 2) + l] | bits 2k of qh[32 h + l] << 4, less 32
    const int lo = 64 * h + 32 * (k2 & 1), sh = 4 * (k2 >> 1);
    UNROLL for (int w = 0; w < 8; ++w) {
      const uint32_t v = gg_u32(b, lo + 4 * w, al), hv = gg_u32(b, 128 + 32 * h + 4 * w, al);
      UNROLL for (int k = 0; k < 4; ++k) {
        const int q = (int)(((v >> (8 * k + sh)) & 0xFu) | (((hv >> (8 * k + 2 * k2)) & 3u) << 4)) - 32;
        if (w < 4) s0 += F32(q) * p[4 * w + k]; else s1 += F32(q) * p[4 * w + k];
      }
    }
    const float d = gg_f16(b, 208);
    const int sc = 192 + 8 * h + 2 * k2;
    return (d * F32(gg_s8(gg_u8(b, sc)))) * s0 + (d * F32(gg_s8(gg_u8(b, sc + 1)))) * s1;
  }
  if (ty == GG_Q3_K) {  // bits 2k of qs[32 h + l], less 4 unless bit 4h + k of hmask[l]; scale (6-bit) - 32
    UNROLL for (int w = 0; w < 8; ++w) {
      const uint32_t v = gg_u32(b, 32 + 32 * h + 4 * w, al), hm = gg_u32(b, 4 * w, al);
      UNROLL for (int k = 0; k < 4; ++k) {
        const int q = (int)((v >> (8 * k + 2 * k2)) & 3u) - (((hm >> (8 * k + 4 * h + k2)) & 1u) ? 0 : 4);
        if (w < 4) s0 += F32(q) * p[4 * w + k]; else s1 += F32(q) * p[4 * w + k];
      }
    }
    const float d = gg_f16(b, 108);
    const int sc = 8 * h + 2 * k2;
    return (d * F32(gg_q3k_scale(b + 96, sc))) * s0 + (d * F32(gg_q3k_scale(b + 96, sc + 1))) * s1;
  }
  // Q2_K: bits 2k of qs[32 h + l]; scale byte 8h + 2k + l / 16: d (low nibble), dmin (high nibble)
  UNROLL for (int w = 0; w < 8; ++w) {
    const uint32_t v = gg_u32(b, 16 + 32 * h + 4 * w, al);
    UNROLL for (int k = 0; k < 4; ++k) {
      const float q = F32((int)((v >> (8 * k + 2 * k2)) & 3u));
      if (w < 4) { s0 += q * p[4 * w + k]; x0 += p[4 * w + k]; } else { s1 += q * p[4 * w + k]; x1 += p[4 * w + k]; }
    }
  }
  const float d = gg_f16(b, 80), dmin = gg_f16(b, 82);
  const uint32_t c0 = gg_u8(b, 8 * h + 2 * k2), c1 = gg_u8(b, 8 * h + 2 * k2 + 1);
  return (d * F32((int)(c0 & 0xFu))) * s0 - (dmin * F32((int)(c0 >> 4))) * x0
       + (d * F32((int)(c1 & 0xFu))) * s1 - (dmin * F32((int)(c1 >> 4))) * x1;
}
"""


def projection_ints(prefix: str, qtype: QuantType, cols: int, codes_offset: int, scales_offset: int) -> tuple:
    """A projection's template ints for the kernels: {prefix}TY (type id), {prefix}BB (bb),
    {prefix}RB (bytes of one row's codes), {prefix}CO / {prefix}SO (codes / scales plane offsets)
    and {prefix}SR (bytes of one row's scales: Q8_0's float16 d per group, else 0)."""
    lay = layout(qtype)
    bb = block_bytes(qtype)
    return ((f"{prefix}TY", int(qtype)), (f"{prefix}BB", bb), (f"{prefix}RB", cols // lay.block_size * bb),
            (f"{prefix}CO", codes_offset), (f"{prefix}SO", scales_offset),
            (f"{prefix}SR", cols // lay.block_size * lay.scale_bytes))
