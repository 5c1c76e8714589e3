"""The one definition of every weight format strata stores: block size, bytes, layout, size formula.

Kernels, readers, writers and the reference all take these constants from here; nothing
retypes a block size. (The pattern is ggml's `block_q4_0` with its `static_assert`.)

Layouts (all little-endian; a "row" is one output channel, quantized along its inputs):

- F32, F16: plain arrays, block 1.
- Q8_0 (ggml's): blocks of 32 weights, 34 bytes: `d: float16`, then 32 x int8 `qs`.
  Value = d * qs[j].
- Q4_0 (ggml's): blocks of 32 weights, 18 bytes: `d: float16`, then 16 bytes `qs`; weight j < 16
  is the low nibble of byte j, weight j >= 16 the high nibble of byte j - 16. Value = d * (q - 8).
- Q2_0 (strata's own; not a ggml type): blocks of 32 weights, 10 bytes: `d: float16`, then
  8 bytes `qs`; code j (0..31) is in byte j // 4 at bits 2 * (j % 4), LSB first.
  Value = d * (q - 2), so levels are {-2d, -d, 0, d}. The code order is MLX's 2-bit affine order
  (scale = d, bias = -2d, group 32).
- A{4,8}G{32,64}_{F16,BF16}, MXFP4: MLX's own formats, kept bit-exact from mlx-lm checkpoints;
  their one definition is strata/formats/mlx_affine.py and strata/formats/mxfp4.py.
- BF16 and the rest of llama.cpp's types (Q4_1 .. Q6_K, the IQ types, TQ1_0, TQ2_0, ggml's
  MXFP4 and NVFP4): kept exactly as a GGUF stores them, whole blocks (`whole_blocks`: the
  codes plane is the blocks themselves, scales inside; there is no separate scales plane).
  Their one definition is strata/formats/ggml_blocks.py; ids are ggml's.
"""

from __future__ import annotations

import enum
from dataclasses import dataclass

import numpy as np

from strata.formats import ggml_blocks

class QuantType(enum.IntEnum):
    """Weight formats. Values shared with ggml keep ggml's type ids; Q2_0 takes an id ggml
    does not use, so a strata file can never be mistaken for a ggml tensor of another type."""

    F32 = 0
    F16 = 1
    Q4_0 = 2
    Q4_1 = 3
    Q5_0 = 6
    Q5_1 = 7
    Q8_0 = 8
    Q2_K = 10
    Q3_K = 11
    Q4_K = 12
    Q5_K = 13
    Q6_K = 14
    IQ2_XXS = 16
    IQ2_XS = 17
    IQ3_XXS = 18
    IQ1_S = 19
    IQ4_NL = 20
    IQ3_S = 21
    IQ2_S = 22
    IQ4_XS = 23
    IQ1_M = 29
    BF16 = 30
    TQ1_0 = 34
    TQ2_0 = 35
    # ggml's MXFP4 and NVFP4 (ids 39, 40): not MLX's MXFP4 (220), whose nibble order differs
    GGML_MXFP4 = 39
    GGML_NVFP4 = 40
    Q2_0 = 200
    # MLX's own checkpoint formats, kept bit-exact from mlx-lm files (strata/formats/mlx_affine.py,
    # strata/formats/mxfp4.py): affine {4, 8} bits x group {32, 64} x 16-bit scale/bias dtype, and MXFP4.
    A4G32_F16 = 210
    A4G64_F16 = 211
    A8G32_F16 = 212
    A8G64_F16 = 213
    A4G32_BF16 = 214
    A4G64_BF16 = 215
    A8G32_BF16 = 216
    A8G64_BF16 = 217
    MXFP4 = 220


@dataclass(frozen=True)
class BlockLayout:
    """How one block of `block_size` weights is stored in `block_bytes` bytes."""

    block_size: int
    block_bytes: int
    scale_bytes: int  # leading float16 scale (0 for float types and whole-block types)
    bits: int  # bits per weight code (the float width for float types; the nominal width a
    #            whole-block type is named for, its scales not counted)
    whole_blocks: bool = False  # a ggml block type kept as stored: codes plane = the blocks

    @property
    def code_bytes(self) -> int:
        return self.block_bytes - self.scale_bytes


LAYOUTS: dict[QuantType, BlockLayout] = {
    QuantType.F32: BlockLayout(block_size=1, block_bytes=4, scale_bytes=0, bits=32),
    QuantType.F16: BlockLayout(block_size=1, block_bytes=2, scale_bytes=0, bits=16),
    QuantType.Q8_0: BlockLayout(block_size=32, block_bytes=34, scale_bytes=2, bits=8),
    QuantType.Q4_0: BlockLayout(block_size=32, block_bytes=18, scale_bytes=2, bits=4),
    QuantType.Q2_0: BlockLayout(block_size=32, block_bytes=10, scale_bytes=2, bits=2),
    # affine: a 16-bit scale and a 16-bit bias per group; MXFP4: one e8m0 byte per 32
    **{QuantType[f"A{b}G{g}_{dt}"]: BlockLayout(block_size=g, block_bytes=g * b // 8 + 4, scale_bytes=4, bits=b)
       for b in (4, 8) for g in (32, 64) for dt in ("F16", "BF16")},
    QuantType.MXFP4: BlockLayout(block_size=32, block_bytes=17, scale_bytes=1, bits=4),
    QuantType.BF16: BlockLayout(block_size=1, block_bytes=2, scale_bytes=0, bits=16),
}
# llama.cpp's block types, as whole blocks; the nominal code width each is named for
GGML_BLOCK_BITS = {
    QuantType.Q4_1: 4, QuantType.Q5_0: 5, QuantType.Q5_1: 5, QuantType.Q2_K: 2, QuantType.Q3_K: 3,
    QuantType.Q4_K: 4, QuantType.Q5_K: 5, QuantType.Q6_K: 6, QuantType.IQ2_XXS: 2, QuantType.IQ2_XS: 2,
    QuantType.IQ2_S: 2, QuantType.IQ3_XXS: 3, QuantType.IQ3_S: 3, QuantType.IQ1_S: 1, QuantType.IQ1_M: 1,
    QuantType.IQ4_NL: 4, QuantType.IQ4_XS: 4, QuantType.TQ1_0: 1, QuantType.TQ2_0: 2,  # TQ1_0: 1.6 (base 3)
    QuantType.GGML_MXFP4: 4, QuantType.GGML_NVFP4: 4,
}


def ggml_block_name(qtype: QuantType) -> str:
    """The ggml type name of a whole-block type (strata/formats/ggml_blocks.py's key)."""
    return qtype.name.removeprefix("GGML_")


for _qt, _bits in GGML_BLOCK_BITS.items():
    _block, _dt = ggml_blocks.BLOCK_DTYPES[ggml_block_name(_qt)]
    LAYOUTS[_qt] = BlockLayout(block_size=_block, block_bytes=_dt.itemsize, scale_bytes=0, bits=_bits,
                               whole_blocks=True)
del _qt, _bits, _block, _dt
assert set(LAYOUTS) == set(QuantType)
for _qt in (QuantType.Q4_0, QuantType.Q8_0):  # split into planes here, but the same ggml block
    assert (LAYOUTS[_qt].block_size, LAYOUTS[_qt].block_bytes) == (
        ggml_blocks.BLOCK_DTYPES[_qt.name][0], ggml_blocks.BLOCK_DTYPES[_qt.name][1].itemsize), _qt

# The layout constants must agree with the bit widths (ggml's static_assert, done once at import).
for _qt, _layout in LAYOUTS.items():
    if _layout.whole_blocks:
        assert _layout.block_bytes * 8 > _layout.block_size * _layout.bits, _qt  # codes and scales
    elif _layout.scale_bytes:
        assert _layout.code_bytes * 8 == _layout.block_size * _layout.bits, _qt
    else:
        assert _layout.block_bytes * 8 == _layout.bits, _qt
del _qt, _layout

Q2_0_LEVEL_OFFSET = 2  # value = d * (q - 2)
Q4_0_LEVEL_OFFSET = 8  # value = d * (q - 8)


def layout(qtype: QuantType | int) -> BlockLayout:
    return LAYOUTS[QuantType(qtype)]


def row_bytes(qtype: QuantType | int, n_cols: int) -> int:
    """Bytes of one row of `n_cols` weights. Raises ValueError if n_cols is not a whole number
    of blocks."""
    lay = layout(qtype)
    if n_cols % lay.block_size:
        raise ValueError(
            f"{QuantType(qtype).name} rows must be a multiple of {lay.block_size} weights, got {n_cols}"
        )
    return n_cols // lay.block_size * lay.block_bytes


def matrix_bytes(qtype: QuantType | int, n_rows: int, n_cols: int) -> int:
    """Bytes of an [n_rows, n_cols] matrix stored row by row."""
    return n_rows * row_bytes(qtype, n_cols)


def parse_quant_type(name: str) -> QuantType:
    """'q2_0' / 'Q2_0' / 'f16' -> QuantType, with an error listing the supported names."""
    try:
        return QuantType[name.upper()]
    except KeyError:
        names = ", ".join(q.name.lower() for q in QuantType)
        raise ValueError(f"unknown quant type {name!r}; supported: {names}") from None


FLOAT_DTYPES = {QuantType.F32: np.dtype("<f4"), QuantType.F16: np.dtype("<f2")}


def is_whole_blocks(qtype: QuantType | int) -> bool:
    """A type kept as ggml stores it (its codes plane is its blocks; no scales plane)."""
    return layout(qtype).whole_blocks
