"""A weight matrix in one of the QuantTypes, held as two planes (codes, then block scales).

This is the in-memory twin of how a projection sits in an `.experts` record (docs/formats.md);
the reference (`strata.reference.quants`) quantizes into it and dequantizes out of it.
"""

from __future__ import annotations

from dataclasses import dataclass

import numpy as np

from strata.formats import ggml_blocks, mlx_affine, mxfp4
from strata.formats.quant_types import QuantType, ggml_block_name, layout


def scale_dtype(qtype: QuantType) -> np.dtype:
    """The dtype of a type's per-block scales (and biases, for MLX's affine types)."""
    if qtype in mlx_affine.AFFINE_SPECS:
        return mlx_affine.AFFINE_SPECS[qtype].scale_dtype
    if qtype is QuantType.MXFP4:
        return mxfp4.SCALE_DTYPE
    return np.dtype(np.float16)


def has_biases(qtype: QuantType) -> bool:
    return qtype in mlx_affine.AFFINE_SPECS


@dataclass(frozen=True, eq=False)
class QuantMatrix:
    """An [n_rows, n_cols] weight matrix in one of the QuantTypes, as two planes.

    Shapes:
        codes:  uint8 [n_rows, n_cols * bits / 8]   (float types: the raw little-endian floats)
        scales: float16 [n_rows, n_cols / 32]       (float types: [n_rows, 0]; MLX affine types:
                [n_rows, n_cols / group] float16 or uint16 bfloat16 bits; MXFP4: uint8 e8m0)
        biases: like scales for MLX's affine types, else None
    """

    qtype: QuantType
    n_rows: int
    n_cols: int
    codes: np.ndarray
    scales: np.ndarray
    biases: np.ndarray | None = None

    def __post_init__(self) -> None:
        lay = layout(self.qtype)
        sdt = scale_dtype(self.qtype)
        if self.n_cols % lay.block_size:
            raise ValueError(f"{self.qtype.name}: n_cols={self.n_cols} is not a multiple of {lay.block_size}")
        n_blocks = self.n_cols // lay.block_size if lay.scale_bytes else 0
        want_codes = (self.n_rows, self.n_cols // lay.block_size * lay.code_bytes)
        if self.codes.dtype != np.uint8 or self.codes.shape != want_codes:
            raise ValueError(f"{self.qtype.name} codes: want uint8 {want_codes}, got {self.codes.dtype} {self.codes.shape}")
        if self.scales.dtype != sdt or self.scales.shape != (self.n_rows, n_blocks):
            raise ValueError(
                f"{self.qtype.name} scales: want {sdt} {(self.n_rows, n_blocks)}, got {self.scales.dtype} {self.scales.shape}"
            )
        if has_biases(self.qtype) != (self.biases is not None) or (
                self.biases is not None and (self.biases.dtype != sdt or self.biases.shape != self.scales.shape)):
            want = f"{sdt} {(self.n_rows, n_blocks)}" if has_biases(self.qtype) else "None"
            got = None if self.biases is None else f"{self.biases.dtype} {self.biases.shape}"
            raise ValueError(f"{self.qtype.name} biases: want {want}, got {got}")

    @property
    def shape(self) -> tuple[int, int]:
        return (self.n_rows, self.n_cols)

    @property
    def nbytes(self) -> int:
        return self.codes.nbytes + self.scales.nbytes + (0 if self.biases is None else self.biases.nbytes)

    def non_finite(self) -> int:
        """How many NaN or infinite weights the planes hold, read without widening: a quantized
        block is finite when its scale (and bias) are, since its codes are integers (MXFP4's FP4
        codes have no NaN or inf; its e8m0 scale's NaN is E8M0_NAN); a float type's values are
        looked at themselves. Counted in weights (a bad block counts its block_size)."""
        lay = layout(self.qtype)
        if lay.whole_blocks:  # a ggml block type kept as stored: its blocks' own scale fields
            return int(np.count_nonzero(ggml_blocks.non_finite_blocks(ggml_block_name(self.qtype), self.codes))) \
                * lay.block_size
        if self.qtype is QuantType.BF16:  # bfloat16 bits: exponent all ones is inf or NaN
            return int(np.count_nonzero((self.codes.view("<u2") & 0x7F80) == 0x7F80))
        if not lay.scale_bytes:  # F32 / F16: the codes are the little-endian floats
            values = self.codes.view("<f4" if self.qtype is QuantType.F32 else "<f2")
            return int(values.size - np.count_nonzero(np.isfinite(values)))
        planes = [self.scales] if self.biases is None else [self.scales, self.biases]
        bad = np.zeros(self.scales.shape, bool)
        for plane in planes:
            if plane.dtype == np.uint8:  # MXFP4's e8m0 exponents
                bad |= plane == mxfp4.E8M0_NAN
            elif plane.dtype == np.dtype("<u2"):  # bfloat16 bits: exponent all ones is inf or NaN
                bad |= (plane & 0x7F80) == 0x7F80
            else:
                bad |= ~np.isfinite(plane)
        return int(np.count_nonzero(bad)) * lay.block_size

    def scale_plane(self) -> np.ndarray:
        """The bytes of the record's scales plane: all scales, then all biases (if any). uint8 [N]"""
        parts = [self.scales] if self.biases is None else [self.scales, self.biases]
        return np.concatenate([np.ascontiguousarray(p).view(np.uint8).reshape(-1) for p in parts])

    @classmethod
    def from_planes(cls, qtype: QuantType, n_rows: int, n_cols: int, codes: np.ndarray,
                    scale_plane: np.ndarray) -> "QuantMatrix":
        """The inverse of (`codes`, `scale_plane()`): views of the given uint8 planes, no copy."""
        qtype = QuantType(qtype)
        lay = layout(qtype)
        n_blocks = n_cols // lay.block_size if lay.scale_bytes else 0
        codes = codes.reshape(n_rows, n_cols // lay.block_size * lay.code_bytes)
        words = scale_plane.view(scale_dtype(qtype))
        if has_biases(qtype):
            half = n_rows * n_blocks
            return cls(qtype, n_rows, n_cols, codes, words[:half].reshape(n_rows, n_blocks),
                       words[half:].reshape(n_rows, n_blocks))
        return cls(qtype, n_rows, n_cols, codes, words.reshape(n_rows, n_blocks))
