"""Random llama.cpp blocks of any kept ggml type, at a chosen scale: the weights of made models and
twin tests whose experts are stored as Q4_K, IQ4_NL, MXFP4, ... (strata quantizes only its own
types; a GGUF's blocks are copied, never made, so tests make theirs from random bytes).

Every byte of a block is random (codes, sub-block scales, high bits, signs) except its float
scales, which are set so the matrix's values have the root mean square asked for: the float16
fields (`d`, `dmin`, `m`) are set to 1 (times a random factor in [0.5, 1.5) per block), the
matrix dequantized once with the reference, and the fields rescaled by rms / measured; MXFP4's
e8m0 exponent is set to the nearest power of two instead. Offsets are chosen so each block's
values are centred near zero (Q4_1 / Q5_1's `m`; K-quants' `dmin` against their mean level).
"""

from __future__ import annotations

import numpy as np

from strata.formats import ggml_blocks
from strata.formats.quant_matrix import QuantMatrix
from strata.formats.quant_types import QuantType, ggml_block_name, is_whole_blocks, row_bytes
from strata.reference.quants import dequantize

__all__ = ["random_block_matrix"]

# the float16 fields scaled with the matrix; the mean level the offset cancels, per offset field
SCALE_FIELDS = ("d", "dmin", "m")
MEAN_LEVEL = {"Q4_1": 7.5, "Q5_1": 15.5}


def random_block_matrix(qtype: QuantType, n_rows: int, n_cols: int, rng: np.random.Generator,
                        rms: float = 1.0) -> QuantMatrix:
    """A [n_rows, n_cols] matrix of random `qtype` blocks whose values' root mean square is ~rms."""
    qtype = QuantType(qtype)
    if not is_whole_blocks(qtype):
        raise ValueError(f"random_block_matrix makes llama.cpp's block types; {qtype.name} is strata's own "
                         "(use strata.reference.quants.quantize)")
    name = ggml_block_name(qtype)
    if name == "IQ1_M":
        raise ValueError("random_block_matrix: IQ1_M keeps its float16 scale in the scales' top nibbles; not made here")
    codes = rng.integers(0, 256, (n_rows, row_bytes(qtype, n_cols)), dtype=np.uint8)
    blocks = ggml_blocks.view_blocks(name, codes)  # a view: writing its fields writes codes

    def values() -> np.ndarray:  # the matrix's values as its fields stand now
        return dequantize(QuantMatrix(qtype, n_rows, n_cols, codes, np.zeros((n_rows, 0), np.float16)))

    factor = rng.uniform(0.5, 1.5, len(blocks)).astype(np.float32)
    if name == "MXFP4":
        blocks["e"] = 127
    for field in SCALE_FIELDS:
        if field in blocks.dtype.names:
            blocks[field] = factor
    if name in MEAN_LEVEL:
        blocks["m"] = -factor * MEAN_LEVEL[name]
    elif "dmin" in blocks.dtype.names:  # K-quants: value = d * sc * q - dmin * m; cancel the mean
        w = values()
        blocks["dmin"] = 0.0
        no_offset = values()
        offsets = no_offset - w  # dmin * m per weight at dmin = factor
        ratio = float(no_offset.mean() / offsets.mean()) if offsets.mean() else 0.0
        blocks["dmin"] = factor * np.float32(ratio)
    measured = float(np.sqrt(np.mean(np.square(values(), dtype=np.float64))))
    if measured > 0:
        if name == "MXFP4":
            blocks["e"] = int(np.clip(127 + np.round(np.log2(rms / measured)), 1, 254))
        else:
            for field in SCALE_FIELDS:
                if field in blocks.dtype.names:
                    blocks[field] = blocks[field].astype(np.float32) * np.float32(rms / measured)
    return QuantMatrix(qtype, n_rows, n_cols, codes, np.zeros((n_rows, 0), np.float16))
