"""A weight matrix in one of the QuantTypes, held as two planes (codes, then block scales).

This is the in-memory twin of how a projection sits in an `.experts` record (docs/formats.md);
the reference (`strata.reference.quants`) quantizes into it and dequantizes out of it.
"""

from __future__ import annotations

from dataclasses import dataclass

import numpy as np

from strata.formats.quant_types import QuantType, layout


@dataclass(frozen=True, eq=False)
class QuantMatrix:
    """An [n_rows, n_cols] weight matrix in one of the QuantTypes, as two planes.

    Shapes:
        codes:  uint8 [n_rows, n_cols * bits / 8]   (float types: the raw little-endian floats)
        scales: float16 [n_rows, n_cols / 32]       (float types: [n_rows, 0])
    """

    qtype: QuantType
    n_rows: int
    n_cols: int
    codes: np.ndarray
    scales: np.ndarray

    def __post_init__(self) -> None:
        lay = layout(self.qtype)
        if self.n_cols % lay.block_size:
            raise ValueError(f"{self.qtype.name}: n_cols={self.n_cols} is not a multiple of {lay.block_size}")
        n_blocks = self.n_cols // lay.block_size if lay.scale_bytes else 0
        want_codes = (self.n_rows, self.n_cols // lay.block_size * lay.code_bytes)
        if self.codes.dtype != np.uint8 or self.codes.shape != want_codes:
            raise ValueError(f"{self.qtype.name} codes: want uint8 {want_codes}, got {self.codes.dtype} {self.codes.shape}")
        if self.scales.dtype != np.float16 or self.scales.shape != (self.n_rows, n_blocks):
            raise ValueError(
                f"{self.qtype.name} scales: want float16 {(self.n_rows, n_blocks)}, got {self.scales.dtype} {self.scales.shape}"
            )

    @property
    def shape(self) -> tuple[int, int]:
        return (self.n_rows, self.n_cols)

    @property
    def nbytes(self) -> int:
        return self.codes.nbytes + self.scales.nbytes
