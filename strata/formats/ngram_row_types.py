"""The row types of an n-gram row store: how one PLE embedding row is stored, and back.

A row is one record: `width` values in one of ROW_TYPES, in the block layout of
strata/formats/quant_types.py (the one definition of every block): F32 and F16 as plain floats,
Q8_0 and Q4_0 (the 4-bit type) as ggml blocks, `d` then `qs`, block after block. The quantizer is
gguf's, as for the model file's Q8_0 matrices: it follows ggml's `quantize_row_*_ref` and agrees
byte for byte with strata's reference quantizer (tests/formats/test_ngram_rows_file.py checks both types
against `strata.reference.quants`).
"""

from __future__ import annotations

import numpy as np

from strata.formats.quant_types import FLOAT_DTYPES, QuantType, layout, row_bytes

__all__ = ["ROW_TYPES", "encode_rows", "decode_rows", "check_row_type"]

# Q4_0 is the 4-bit type: 4.5 bits a value (a float16 scale per 32), 3.6x smaller than F16.
ROW_TYPES = (QuantType.F32, QuantType.F16, QuantType.Q8_0, QuantType.Q4_0)


def _ggml(qtype: QuantType):
    from gguf import GGMLQuantizationType

    return GGMLQuantizationType(int(qtype))  # strata keeps ggml's ids for these types


def check_row_type(qtype: QuantType | int, width: int) -> int:
    """The bytes of one row of `width` values; ValueError for a type or width rows cannot take."""
    qtype = QuantType(qtype)
    if qtype not in ROW_TYPES:
        names = ", ".join(t.name for t in ROW_TYPES)
        raise ValueError(f"n-gram rows cannot be stored as {qtype.name} (row types: {names})")
    if width <= 0:
        raise ValueError(f"row width must be positive, got {width}")
    return row_bytes(qtype, width)  # raises for a width that is not whole blocks


def encode_rows(qtype: QuantType, x: np.ndarray) -> np.ndarray:
    """Rows of floats in the stored form of `qtype`.

    Shapes:
        x: [n, width] (any float dtype) -> uint8 [n, row_bytes(qtype, width)]
    """
    qtype = QuantType(qtype)
    x = np.asarray(x)
    if x.ndim != 2:
        raise ValueError(f"want rows as a 2-D array [n, width], got shape {x.shape}")
    nbytes = check_row_type(qtype, x.shape[1])
    if qtype in FLOAT_DTYPES:
        with np.errstate(over="ignore"):
            out = np.ascontiguousarray(x.astype(FLOAT_DTYPES[qtype]))
        if qtype is QuantType.F16 and not np.isfinite(out).all() and np.isfinite(x).all():
            big = float(np.abs(x.astype(np.float32)).max())
            raise ValueError(f"rows hold {big:.4g}, beyond float16's range (65504): store them as F32")
        return out.view(np.uint8).reshape(x.shape[0], nbytes)
    import gguf.quants

    out = gguf.quants.quantize(np.ascontiguousarray(x, dtype=np.float32), _ggml(qtype))
    return np.ascontiguousarray(out, dtype=np.uint8).reshape(x.shape[0], nbytes)


def decode_rows(qtype: QuantType, raw: np.ndarray, width: int) -> np.ndarray:
    """The float32 values of stored rows (bit for bit what the row type stands for).

    Shapes:
        raw: uint8 [n, row_bytes(qtype, width)] -> float32 [n, width]
    """
    qtype = QuantType(qtype)
    nbytes = check_row_type(qtype, width)
    raw = np.ascontiguousarray(raw, dtype=np.uint8).reshape(-1, nbytes)
    if qtype in FLOAT_DTYPES:
        return raw.view(FLOAT_DTYPES[qtype]).astype(np.float32)
    import gguf.quants

    assert nbytes == width // layout(qtype).block_size * layout(qtype).block_bytes
    return gguf.quants.dequantize(raw, _ggml(qtype)).astype(np.float32, copy=False).reshape(-1, width)
