"""MXFP4 (OCP microscaling FP4), as MLX and gpt-oss checkpoints store it: one definition.

Per row, per block of 32 weights: 16 bytes of e2m1 codes (weight j in byte j // 2, low nibble
first for even j: the order of MLX's `mode="mxfp4"` and of gpt-oss's `*_blocks` tensors; NOT
ggml's MXFP4, which puts weight j + 16 in the high nibble of byte j), then one e8m0 scale byte
(the power 2**(e - 127); e = 255 is NaN in the standard and never written here).
A code is sign (bit 3) and magnitude index (bits 0-2) into E2M1_VALUES. Value = 2**(e-127) * e2m1(q).

In a QuantMatrix the scales are uint8 [rows, blocks] (no biases); in an `.experts` record the
scales plane is those bytes (docs/formats.md).
"""

from __future__ import annotations

import numpy as np

from strata.formats.quant_types import QuantType, layout

BLOCK = 32
E8M0_BIAS = 127
E8M0_NAN = 255
E2M1_MAX = 6.0
E2M1_EMAX = 2  # the exponent of E2M1_MAX's leading bit (6 = 1.5 * 2**2)
# magnitudes of codes 0..7; codes 8..15 are their negatives (-0.0 for code 8)
E2M1_MAGNITUDES = np.array([0.0, 0.5, 1.0, 1.5, 2.0, 3.0, 4.0, 6.0], np.float32)
E2M1_VALUES = np.concatenate([E2M1_MAGNITUDES, -E2M1_MAGNITUDES]).astype(np.float32)  # [16]
SCALE_DTYPE = np.dtype(np.uint8)

_lay = layout(QuantType.MXFP4)
assert (_lay.block_size, _lay.bits, _lay.scale_bytes, _lay.code_bytes) == (BLOCK, 4, 1, BLOCK // 2)
del _lay


def e8m0_to_f32(e: np.ndarray) -> np.ndarray:
    """Scale bytes -> float32 powers of two (exact; e = 0 is 2**-127, a float32 subnormal)."""
    e = np.asarray(e, np.uint8).astype(np.int32)
    return np.ldexp(np.float32(1.0), e - E8M0_BIAS).astype(np.float32)
