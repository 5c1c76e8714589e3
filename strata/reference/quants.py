"""Reference quantization, dequantization and GEMV for every weight format (pure numpy).

A quantized matrix is held as two planes (`QuantMatrix`): all codes, then all block scales.
That is how the `.experts` file stores a projection (docs/formats.md) and how MLX keeps its
quantized arrays; the interleaved block form of design §2 (`d` then `qs`, block after block) is a
lossless re-arrangement of the same bytes (`to_blocks` / `from_blocks`).

Quantizers follow ggml's `quantize_row_*_ref` step for step, in float32:
- Q2_0: m = the block's value of largest magnitude (signed, first on ties), d = m / -2,
  id = 1/d (0 if d = 0), q = min(3, trunc(x*id + 2.5)); d is rounded to float16 only after.
- Q4_0: the same with d = m / -8 and q = min(15, trunc(x*id + 8.5)).
- Q8_0: d = max|x| / 127, q = round-half-away(x / d); d stored as float16.

llama.cpp's other types (BF16, Q4_1 .. Q6_K, the IQ types, ggml's MXFP4 and NVFP4) are kept as a
GGUF stores them and only dequantized here (strata/reference/ggml_quants.py, ggml's
`dequantize_row_*`); `quantize` refuses them (a GGUF's blocks are copied, never made).
"""

from __future__ import annotations

import numpy as np

from strata.formats.quant_types import (
    FLOAT_DTYPES,
    Q2_0_LEVEL_OFFSET,
    Q4_0_LEVEL_OFFSET,
    QuantType,
    ggml_block_name,
    is_whole_blocks,
    layout,
    row_bytes,
)
from strata.formats.quant_matrix import QuantMatrix, has_biases, scale_dtype
from strata.reference import ggml_quants, mlx_quants

__all__ = ["QuantMatrix", "quantize", "dequantize", "gemv", "codes_of", "to_blocks", "from_blocks",
           "QUANTIZABLE"]


# ---------------------------------------------------------------- quantize


def _blocks(w: np.ndarray, block: int) -> np.ndarray:
    w = np.asarray(w, dtype=np.float32)
    if w.ndim != 2 or w.shape[1] % block:
        raise ValueError(f"want a 2-D matrix with columns a multiple of {block}, got {w.shape}")
    return w.reshape(w.shape[0], w.shape[1] // block, block)  # [R, B, 32]


def _signed_absmax(blocks: np.ndarray) -> np.ndarray:
    """Per block, the value of largest magnitude keeping its sign, the first one on ties. [R, B]"""
    first = np.argmax(np.abs(blocks), axis=-1)  # argmax returns the first maximum
    return np.take_along_axis(blocks, first[..., None], axis=-1)[..., 0]


def _inverse(d: np.ndarray) -> np.ndarray:
    """1/d, and 0 where that is not finite: d = 0 (as ggml), or d so tiny that 1/d overflows
    float32 (ggml casts inf to int there, which C leaves undefined; every such block stores a
    float16 scale of 0, so its values dequantize to 0 whatever the codes)."""
    with np.errstate(divide="ignore", over="ignore"):
        inv = np.float32(1.0) / d
    return np.where(np.isfinite(inv), inv, np.float32(0.0)).astype(np.float32)


def _pack_bits(q: np.ndarray, bits: int) -> np.ndarray:
    """[R, B, 32] codes -> [R, B, 32*bits/8] bytes, code j at byte j*bits//8, LSB first."""
    per_byte = 8 // bits
    q = q.astype(np.uint8).reshape(*q.shape[:-1], q.shape[-1] // per_byte, per_byte)
    shifts = (np.arange(per_byte, dtype=np.uint8) * bits).astype(np.uint8)
    return np.bitwise_or.reduce(q << shifts, axis=-1).astype(np.uint8)


def _unpack_bits(b: np.ndarray, bits: int) -> np.ndarray:
    per_byte = 8 // bits
    shifts = (np.arange(per_byte, dtype=np.uint8) * bits).astype(np.uint8)
    q = (b[..., None] >> shifts) & np.uint8((1 << bits) - 1)
    return q.reshape(*b.shape[:-1], b.shape[-1] * per_byte)


def _q4_0_pack(q: np.ndarray) -> np.ndarray:
    """ggml nibble order: weight j < 16 low nibble of byte j, j >= 16 high nibble of byte j-16."""
    q = q.astype(np.uint8)
    return (q[..., :16] | (q[..., 16:] << 4)).astype(np.uint8)


def _q4_0_unpack(b: np.ndarray) -> np.ndarray:
    return np.concatenate([b & np.uint8(0x0F), b >> np.uint8(4)], axis=-1)


# the types `quantize` makes (the rest are only read, as stored)
QUANTIZABLE = tuple(q for q in QuantType if not is_whole_blocks(q) and q is not QuantType.BF16)


def quantize(qtype: QuantType, w: np.ndarray) -> QuantMatrix:
    """Quantize a float matrix by the reference rule of `qtype`.

    Shapes:
        w: [n_rows, n_cols] (n_cols a multiple of the block size) -> QuantMatrix [n_rows, n_cols]
    """
    qtype = QuantType(qtype)
    w = np.asarray(w, dtype=np.float32)
    if w.ndim != 2:
        raise ValueError(f"quantize wants a 2-D matrix, got shape {w.shape}")
    n_rows, n_cols = w.shape
    if qtype not in QUANTIZABLE:
        raise ValueError(f"{qtype.name} has no quantizer here: llama.cpp's types are kept as a GGUF stores "
                         f"them; quantize to one of {', '.join(q.name for q in QUANTIZABLE)}")
    row_bytes(qtype, n_cols)  # validates the column count
    if qtype in mlx_quants.MLX_TYPES:
        return mlx_quants.quantize(qtype, w)
    if qtype in FLOAT_DTYPES:
        data = np.ascontiguousarray(w.astype(FLOAT_DTYPES[qtype]))
        return QuantMatrix(qtype, n_rows, n_cols, data.view(np.uint8).reshape(n_rows, -1), np.zeros((n_rows, 0), np.float16))
    blocks = _blocks(w, layout(qtype).block_size)  # [R, B, 32]
    if qtype is QuantType.Q8_0:
        d = (np.max(np.abs(blocks), axis=-1) / np.float32(127.0)).astype(np.float32)
        scaled = blocks * _inverse(d)[..., None]
        q = (np.sign(scaled) * np.floor(np.abs(scaled) + np.float32(0.5))).astype(np.int8)  # roundf
        codes = q.view(np.uint8)
    elif qtype is QuantType.Q4_0:
        d = (_signed_absmax(blocks) / np.float32(-8.0)).astype(np.float32)
        q = np.minimum(15, np.trunc(blocks * _inverse(d)[..., None] + np.float32(8.5))).astype(np.uint8)
        codes = _q4_0_pack(q)
    elif qtype is QuantType.Q2_0:
        d = (_signed_absmax(blocks) / np.float32(-2.0)).astype(np.float32)
        q = np.minimum(3, np.trunc(blocks * _inverse(d)[..., None] + np.float32(2.5))).astype(np.uint8)
        codes = _pack_bits(q, 2)
    else:  # pragma: no cover - every QuantType is handled above
        raise ValueError(f"no quantizer for {qtype!r}")
    return QuantMatrix(qtype, n_rows, n_cols, codes.reshape(n_rows, -1), d.astype(np.float16))


# ---------------------------------------------------------------- dequantize / gemv


def codes_of(m: QuantMatrix) -> np.ndarray:
    """The integer code of every weight (quantized types only). [n_rows, n_cols] uint8/int8"""
    if m.qtype in mlx_quants.MLX_TYPES:
        return mlx_quants.codes_of(m)
    blocks = m.codes.reshape(m.n_rows, m.n_cols // 32, -1)  # [R, B, code_bytes]
    if m.qtype is QuantType.Q8_0:
        return blocks.view(np.int8).reshape(m.n_rows, m.n_cols)
    if m.qtype is QuantType.Q4_0:
        return _q4_0_unpack(blocks).reshape(m.n_rows, m.n_cols)
    if m.qtype is QuantType.Q2_0:
        return _unpack_bits(blocks, 2).reshape(m.n_rows, m.n_cols)
    raise ValueError(f"{m.qtype.name} has no codes")


_OFFSETS = {QuantType.Q8_0: 0, QuantType.Q4_0: Q4_0_LEVEL_OFFSET, QuantType.Q2_0: Q2_0_LEVEL_OFFSET}


def dequantize(m: QuantMatrix) -> np.ndarray:
    """The float32 weights a QuantMatrix stands for. [n_rows, n_cols] float32"""
    if m.qtype in FLOAT_DTYPES:
        return m.codes.view(FLOAT_DTYPES[m.qtype]).reshape(m.n_rows, m.n_cols).astype(np.float32)
    if m.qtype is QuantType.BF16:
        return ggml_quants.bf16(m.codes).reshape(m.n_rows, m.n_cols)
    if is_whole_blocks(m.qtype):
        return ggml_quants.dequantize_blocks(ggml_block_name(m.qtype), m.codes, m.n_cols).reshape(m.n_rows, m.n_cols)
    if m.qtype in mlx_quants.MLX_TYPES:
        return mlx_quants.dequantize(m)
    q = codes_of(m).astype(np.float32) - np.float32(_OFFSETS[m.qtype])
    q = q.reshape(m.n_rows, m.n_cols // 32, 32)
    return (q * m.scales.astype(np.float32)[..., None]).reshape(m.n_rows, m.n_cols)


def gemv(m: QuantMatrix, x: np.ndarray) -> np.ndarray:
    """y = W x on the stored weights, in float32.

    Shapes:
        x: [n_cols] or [T, n_cols] -> y: [n_rows] or [T, n_rows]
    """
    x = np.asarray(x, dtype=np.float32)
    if x.shape[-1] != m.n_cols:
        raise ValueError(f"gemv: x has {x.shape[-1]} features, the matrix wants {m.n_cols}")
    return x @ dequantize(m).T


# ---------------------------------------------------------------- interleaved block form


def to_blocks(m: QuantMatrix) -> np.ndarray:
    """The interleaved block bytes of design §2 (`d` then `qs`, per block; MLX's affine types: scale,
    bias, then codes; MXFP4: the e8m0 byte, then codes). [n_rows, row_bytes] uint8"""
    lay = layout(m.qtype)
    if not lay.scale_bytes:
        return m.codes.copy()
    n_blocks = m.n_cols // lay.block_size
    out = np.empty((m.n_rows, n_blocks, lay.block_bytes), np.uint8)
    words = np.stack([m.scales] + ([] if m.biases is None else [m.biases]), axis=-1)  # [R, B, 1 or 2]
    out[..., : lay.scale_bytes] = np.ascontiguousarray(words).view(np.uint8).reshape(m.n_rows, n_blocks, lay.scale_bytes)
    out[..., lay.scale_bytes :] = m.codes.reshape(m.n_rows, n_blocks, lay.code_bytes)
    return out.reshape(m.n_rows, -1)


def from_blocks(qtype: QuantType, n_cols: int, blocks: np.ndarray) -> QuantMatrix:
    """Inverse of `to_blocks`. blocks: [n_rows, row_bytes] uint8 (or flat bytes)."""
    qtype = QuantType(qtype)
    lay = layout(qtype)
    blocks = np.asarray(blocks, dtype=np.uint8).reshape(-1, row_bytes(qtype, n_cols))
    n_rows = blocks.shape[0]
    if not lay.scale_bytes:
        return QuantMatrix(qtype, n_rows, n_cols, blocks.copy(), np.zeros((n_rows, 0), np.float16))
    b = blocks.reshape(n_rows, n_cols // lay.block_size, lay.block_bytes)
    words = np.ascontiguousarray(b[..., : lay.scale_bytes]).view(scale_dtype(qtype))  # [R, B, 1 or 2]
    codes = np.ascontiguousarray(b[..., lay.scale_bytes :]).reshape(n_rows, -1)
    biases = np.ascontiguousarray(words[..., 1]) if has_biases(qtype) else None
    return QuantMatrix(qtype, n_rows, n_cols, codes, np.ascontiguousarray(words[..., 0]), biases)
