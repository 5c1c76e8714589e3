"""FP8 e4m3fn (the `float8_e4m3fn` of torch, ml_dtypes and safetensors' `F8_E4M3`): one definition.

A byte is sign (bit 7), a 4-bit exponent (bits 3-6, bias 7) and a 3-bit mantissa (bits 0-2):
- exponent 1..15: (-1)^s * 2^(e - 7) * (1 + m / 8), except
- exponent 15 with mantissa 7 (0x7F, 0xFF): NaN. The "fn" form has no infinities, so the
  largest finite magnitude is 0x7E = 2^8 * 1.75 = 448;
- exponent 0: subnormal, (-1)^s * 2^-6 * (m / 8); 0x80 is -0.0.

Every finite value has at most 4 significant bits and an exponent in [-9, 8], so float32 holds
each one exactly: decoding is a lookup in a table of 256 float32s built here from the bits, with
no dependency on a library that knows the type.
"""

from __future__ import annotations

import numpy as np

E4M3_EXPONENT_BIAS = 7
E4M3_MANTISSA_BITS = 3
E4M3_MAX = 448.0  # 0x7E
E4M3_NAN_CODES = (0x7F, 0xFF)


def _e4m3fn_table() -> np.ndarray:
    codes = np.arange(256, dtype=np.int64)
    sign = np.where(codes & 0x80, -1.0, 1.0)
    exponent = (codes >> E4M3_MANTISSA_BITS) & 0xF
    mantissa = codes & 0x7
    normal = np.ldexp(1.0 + mantissa / 8.0, exponent - E4M3_EXPONENT_BIAS)
    subnormal = np.ldexp(mantissa / 8.0, 1 - E4M3_EXPONENT_BIAS)
    values = sign * np.where(exponent == 0, subnormal, normal)
    values[list(E4M3_NAN_CODES)] = np.nan
    out = values.astype(np.float32)
    assert np.array_equal(out.astype(np.float64), values, equal_nan=True)  # every value exact in float32
    assert out[0x7E] == E4M3_MAX and out[0x01] == 2.0**-9
    return out


E4M3FN_VALUES = _e4m3fn_table()  # [256] float32: the value of each code
E4M3FN_VALUES.setflags(write=False)


def e4m3fn_to_f32(codes: np.ndarray) -> np.ndarray:
    """FP8 e4m3fn bytes -> their float32 values, exactly (NaN codes give NaN).

    Shapes: codes [...] uint8 -> [...] float32
    """
    return E4M3FN_VALUES[np.asarray(codes, np.uint8)]
