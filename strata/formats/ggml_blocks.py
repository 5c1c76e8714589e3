"""llama.cpp's weight blocks as GGUF files store them: the one definition of each byte layout.

Each ggml block type is a numpy structured dtype, field for field ggml-common.h's `block_*`
struct (little-endian, packed: ggml's structs have no padding). `BLOCKS[qtype].itemsize` is
ggml's `sizeof(block_*)`, asserted at import against the (block, bytes) pair the type table in
quant_types.py declares, the way ggml `static_assert`s its structs. A tensor row is a run of
whole blocks; `view_blocks` reads raw row bytes as an array of these records, no copy.

Fields (QK_K = 256 weights per super-block; f16 = IEEE half; "u8[n]" a byte array):

    Q4_0     d f16, qs u8[16]                           32 weights
    Q4_1     d f16, m f16, qs u8[16]                    32
    Q5_0     d f16, qh u8[4], qs u8[16]                 32
    Q5_1     d f16, m f16, qh u8[4], qs u8[16]          32
    Q8_0     d f16, qs i8[32]                           32
    Q2_K     scales u8[16], qs u8[64], d f16, dmin f16  256
    Q3_K     hmask u8[32], qs u8[64], scales u8[12], d f16
    Q4_K     d f16, dmin f16, scales u8[12], qs u8[128]
    Q5_K     d f16, dmin f16, scales u8[12], qh u8[32], qs u8[128]
    Q6_K     ql u8[128], qh u8[64], scales i8[16], d f16
    IQ2_XXS  d f16, qs u16[32]
    IQ2_XS   d f16, qs u16[32], scales u8[8]
    IQ2_S    d f16, qs u8[64] (grid bytes, then sign bytes), qh u8[8], scales u8[8]
    IQ3_XXS  d f16, qs u8[96] (grid bytes, then 8 u32 of scale and signs)
    IQ3_S    d f16, qs u8[64], qh u8[8], signs u8[32], scales u8[4]
    IQ1_S    d f16, qs u8[32], qh u16[8]
    IQ1_M    qs u8[32], qh u8[16], scales u8[8] (the f16 scale is spread over its top nibbles)
    IQ4_NL   d f16, qs u8[16]                           32
    IQ4_XS   d f16, scales_h u16, scales_l u8[4], qs u8[128]
    TQ1_0    qs u8[48], qh u8[4], d f16                 (base-3 digits, five per byte)
    TQ2_0    qs u8[64], d f16
    MXFP4    e u8 (e8m0), qs u8[16]                     32 (ggml's nibble order: weight j + 16
                                                         is the high nibble of byte j)
    NVFP4    d u8[4] (ue4m3, one per 16 weights), qs u8[32]   64

The tables the IQ and FP4 types index (ggml's `kvalues_*`, `ksigns_iq2xs`, the grids) are here
too. The grids (`iq2xxs_grid` .. `iq1s_grid`, 256 to 2048 rows of 4 or 8 small values) are read
from the `gguf` package's data at first use (a declared dependency; gguf keeps them packed as
hex, `grid_map` giving each packed code's value), never retyped here.
"""

from __future__ import annotations

import functools

import numpy as np

QK_K = 256  # weights per K-quant / IQ super-block


def _block(*fields: tuple) -> np.dtype:
    return np.dtype([(name, np.dtype(dt).newbyteorder("<"), *shape) for name, dt, *shape in fields])


# name -> (weights per block, block dtype); the names are ggml's type names
BLOCK_DTYPES: dict[str, tuple[int, np.dtype]] = {
    "Q4_0": (32, _block(("d", "f2"), ("qs", "u1", 16))),
    "Q4_1": (32, _block(("d", "f2"), ("m", "f2"), ("qs", "u1", 16))),
    "Q5_0": (32, _block(("d", "f2"), ("qh", "u1", 4), ("qs", "u1", 16))),
    "Q5_1": (32, _block(("d", "f2"), ("m", "f2"), ("qh", "u1", 4), ("qs", "u1", 16))),
    "Q8_0": (32, _block(("d", "f2"), ("qs", "i1", 32))),
    "Q2_K": (QK_K, _block(("scales", "u1", 16), ("qs", "u1", 64), ("d", "f2"), ("dmin", "f2"))),
    "Q3_K": (QK_K, _block(("hmask", "u1", 32), ("qs", "u1", 64), ("scales", "u1", 12), ("d", "f2"))),
    "Q4_K": (QK_K, _block(("d", "f2"), ("dmin", "f2"), ("scales", "u1", 12), ("qs", "u1", 128))),
    "Q5_K": (QK_K, _block(("d", "f2"), ("dmin", "f2"), ("scales", "u1", 12), ("qh", "u1", 32), ("qs", "u1", 128))),
    "Q6_K": (QK_K, _block(("ql", "u1", 128), ("qh", "u1", 64), ("scales", "i1", 16), ("d", "f2"))),
    "IQ2_XXS": (QK_K, _block(("d", "f2"), ("qs", "u2", 32))),
    "IQ2_XS": (QK_K, _block(("d", "f2"), ("qs", "u2", 32), ("scales", "u1", 8))),
    "IQ2_S": (QK_K, _block(("d", "f2"), ("qs", "u1", 64), ("qh", "u1", 8), ("scales", "u1", 8))),
    "IQ3_XXS": (QK_K, _block(("d", "f2"), ("qs", "u1", 96))),
    "IQ3_S": (QK_K, _block(("d", "f2"), ("qs", "u1", 64), ("qh", "u1", 8), ("signs", "u1", 32), ("scales", "u1", 4))),
    "IQ1_S": (QK_K, _block(("d", "f2"), ("qs", "u1", 32), ("qh", "u2", 8))),
    "IQ1_M": (QK_K, _block(("qs", "u1", 32), ("qh", "u1", 16), ("scales", "u1", 8))),
    "IQ4_NL": (32, _block(("d", "f2"), ("qs", "u1", 16))),
    "IQ4_XS": (QK_K, _block(("d", "f2"), ("scales_h", "u2"), ("scales_l", "u1", 4), ("qs", "u1", 128))),
    "TQ1_0": (QK_K, _block(("qs", "u1", 48), ("qh", "u1", 4), ("d", "f2"))),
    "TQ2_0": (QK_K, _block(("qs", "u1", 64), ("d", "f2"))),
    "MXFP4": (32, _block(("e", "u1"), ("qs", "u1", 16))),
    "NVFP4": (64, _block(("d", "u1", 4), ("qs", "u1", 32))),
}

# ggml-common.h's sizeof(block_*) for each, the numbers every GGUF reader agrees on
BLOCK_BYTES = {"Q4_0": 18, "Q4_1": 20, "Q5_0": 22, "Q5_1": 24, "Q8_0": 34, "Q2_K": 84, "Q3_K": 110,
               "Q4_K": 144, "Q5_K": 176, "Q6_K": 210, "IQ2_XXS": 66, "IQ2_XS": 74, "IQ2_S": 82,
               "IQ3_XXS": 98, "IQ3_S": 110, "IQ1_S": 50, "IQ1_M": 56, "IQ4_NL": 18, "IQ4_XS": 136,
               "TQ1_0": 54, "TQ2_0": 66, "MXFP4": 17, "NVFP4": 36}
for _name, (_n, _dt) in BLOCK_DTYPES.items():
    assert _dt.itemsize == BLOCK_BYTES[_name], (_name, _dt.itemsize)
assert BLOCK_DTYPES.keys() == BLOCK_BYTES.keys()
del _name, _n, _dt

# ---------------------------------------------------------------- the tables blocks index

KVALUES_IQ4NL = np.array([-127, -104, -83, -65, -49, -35, -22, -10, 1, 13, 25, 38, 53, 69, 89, 113], np.int8)
# e2m1 values doubled (0.5 lives in the scale: GGML_E8M0_TO_FP32_HALF, ue4m3's * 0.5)
KVALUES_MXFP4 = np.array([0, 1, 2, 3, 4, 6, 8, 12, 0, -1, -2, -3, -4, -6, -8, -12], np.int8)
IQ1_DELTA = np.float32(0.125)  # IQ1S_DELTA = IQ1M_DELTA
TQ_POW3 = np.array([1, 3, 9, 27, 81, 243], np.uint8)  # TQ1_0's digit weights (a byte is 0.xxxxx in base 3, x 243)


def _ksigns() -> np.ndarray:
    """ggml's ksigns_iq2xs: 7 stored sign bits, the 8th their parity (an even number of minus
    signs per 8 weights). [128] uint8"""
    i = np.arange(128, dtype=np.uint8)
    parity = sum((i >> np.uint8(b)) & np.uint8(1) for b in range(7)) & np.uint8(1)
    return (i | (parity << np.uint8(7))).astype(np.uint8)


KSIGNS_IQ2XS = _ksigns()
assert KSIGNS_IQ2XS[1] == 0x81 and KSIGNS_IQ2XS[3] == 0x03 and KSIGNS_IQ2XS[127] == 0xFF

# ggml type name -> the gguf class whose packed grid it indexes, and the grid's [rows, cols]
GRIDS = {"iq2xxs": ("IQ2_XXS", (256, 8)), "iq2xs": ("IQ2_XS", (512, 8)), "iq2s": ("IQ2_S", (1024, 8)),
         "iq3xxs": ("IQ3_XXS", (256, 4)), "iq3s": ("IQ3_S", (512, 4)), "iq1s": ("IQ1_S", (2048, 8))}


@functools.cache
def grid(name: str) -> np.ndarray:
    """ggml's `{name}_grid` as small integers: row r, column j is byte j of the uint64 (uint32
    for the iq3 grids) entry r. iq1s: int8 in {-1, 0, 1}; the others positive. [rows, cols] int8"""
    import gguf.quants

    cls_name, shape = GRIDS[name]
    cls = getattr(gguf.quants, cls_name)
    cls.init_grid()  # gguf decodes its hex once and caches it on the class
    values = np.asarray(cls.grid, np.float32).reshape(shape)
    out = values.astype(np.int8)
    assert (out == values).all(), name  # every grid value is a small integer
    out.setflags(write=False)
    return out


def view_blocks(name: str, raw: np.ndarray) -> np.ndarray:
    """Raw bytes (uint8 [..., n_blocks * block_bytes]) as the block records, no copy. [N] structured"""
    _, dt = BLOCK_DTYPES[name]
    raw = np.ascontiguousarray(raw, np.uint8).reshape(-1)
    if raw.size % dt.itemsize:
        raise ValueError(f"{name}: {raw.size} bytes is not a whole number of {dt.itemsize}-byte blocks")
    return raw.view(dt)


def _f16_bad(bits: np.ndarray) -> np.ndarray:
    """float16 bit patterns whose exponent is all ones (inf or NaN). uint16 [...] -> bool [...]"""
    return (bits & 0x7C00) == 0x7C00


def _e8m0_half(e: np.ndarray) -> np.ndarray:
    """ggml's GGML_E8M0_TO_FP32_HALF: half of 2^(e - 127), built from its bits as ggml builds it."""
    e = e.astype(np.uint32)
    bits = np.where(e < 2, np.uint32(0x00200000) << e, (e - 1) << 23).astype(np.uint32)
    return bits.view(np.float32)


def non_finite_blocks(name: str, raw: np.ndarray) -> np.ndarray:
    """Which blocks of whole-block type `name` dequantize to a NaN or an infinity, decided from the
    fields that can carry one, never by widening the block: the float16 scales (d, dmin, m; IQ1_M's
    is spread over its scales' top nibbles), and for MXFP4 the product of its e8m0 scale with the
    block's largest code (2^126 x 12 overflows float32 though both are finite). The other factors
    of a weight are small integers or table values, and float16's largest times them stays finite
    in float32. bool [n_blocks]"""
    blocks = view_blocks(name, raw)
    bad = np.zeros(blocks.shape, bool)
    if name == "MXFP4":
        codes = np.stack([blocks["qs"] & 0x0F, blocks["qs"] >> 4], axis=-1)  # [N, 16, 2]
        largest = np.abs(KVALUES_MXFP4[codes]).reshape(len(blocks), -1).max(axis=1).astype(np.float32)
        with np.errstate(over="ignore"):
            return ~np.isfinite(largest * _e8m0_half(blocks["e"]))
    if name == "IQ1_M":
        sc = blocks["scales"].copy().view("<u2")  # [N, 4]
        bits = (sc[:, 0] >> 12) | ((sc[:, 1] >> 8) & 0x00F0) | ((sc[:, 2] >> 4) & 0x0F00) | (sc[:, 3] & 0xF000)
        return _f16_bad(bits)
    for field in ("d", "dmin", "m"):
        if field in blocks.dtype.names and blocks.dtype[field] == np.dtype("<f2"):
            bad |= _f16_bad(blocks[field].view("<u2"))
    return bad
