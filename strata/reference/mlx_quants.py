"""Reference quantization and dequantization of MLX's formats (pure numpy): the affine types
(strata/formats/mlx_affine.py) and MXFP4 (strata/formats/mxfp4.py).

The quantizers follow `mx.quantize` step for step, in float32, and give its bytes exactly
(tests/mlx_backend/test_mlx_quants.py checks every type against MLX's CPU build):

- affine: per group, w_max and w_min; the side of larger magnitude is the edge;
  scale = max((w_max - w_min) / (2**bits - 1), 1e-7), negated unless the edge is w_min;
  q0 = round(edge / scale); if q0 != 0 the scale becomes edge / q0 and the bias the edge, else
  the bias is 0; q = clip(round((w - bias) / scale), 0, 2**bits - 1) with the float32 scale and
  bias, which are then rounded to the stored 16-bit type. (round: half to even.)
- MXFP4: per block of 32, e = ceil(log2(max|w| / 6)) (0 for an all-zero block), clamped to
  the e8m0 range; the magnitude |w| / 2**e goes to the nearest E2M1 value, ties to the smaller;
  the sign bit is set for negative weights with a nonzero magnitude (a zero is +0).

Dequantization is exact in float32 (a 16-bit scale times a small integer plus a 16-bit bias;
a power of two times an E2M1 value).
"""

from __future__ import annotations

import numpy as np

from strata.formats import mlx_affine, mxfp4
from strata.formats.mlx_affine import AFFINE_SPECS, AffineSpec, pack_codes, unpack_codes
from strata.formats.quant_matrix import QuantMatrix
from strata.formats.quant_types import QuantType

MLX_TYPES = frozenset(AFFINE_SPECS) | {QuantType.MXFP4}
AFFINE_MIN_SCALE = np.float32(1e-7)  # mx.quantize's floor on a group's step (a constant group)


def _groups(w: np.ndarray, group: int) -> np.ndarray:
    w = np.asarray(w, dtype=np.float32)
    if w.ndim != 2 or w.shape[1] % group:
        raise ValueError(f"want a 2-D matrix with columns a multiple of {group}, got {w.shape}")
    return w.reshape(w.shape[0], w.shape[1] // group, group)  # [R, G, group]


def _quantize_affine(spec: AffineSpec, qtype: QuantType, w: np.ndarray) -> QuantMatrix:
    g = _groups(w, spec.group)  # [R, G, group]
    levels = np.float32(spec.levels)
    w_max, w_min = g.max(axis=-1), g.min(axis=-1)  # [R, G]
    edge_is_min = np.abs(w_min) > np.abs(w_max)
    with np.errstate(over="ignore", invalid="ignore"):
        step = np.maximum((w_max - w_min) / levels, AFFINE_MIN_SCALE).astype(np.float32)
        scale = np.where(edge_is_min, step, -step).astype(np.float32)
        edge = np.where(edge_is_min, w_min, w_max)
        q0 = np.round(edge / scale).astype(np.float32)
        scale = np.where(q0 != 0, edge / np.where(q0 != 0, q0, np.float32(1)), scale).astype(np.float32)
        bias = np.where(q0 != 0, edge, np.float32(0)).astype(np.float32)
        q = np.clip(np.round((g - bias[..., None]) / scale[..., None]), 0, levels)
    q = np.nan_to_num(q, nan=0.0).astype(np.uint8).reshape(w.shape)
    return QuantMatrix(qtype, w.shape[0], w.shape[1], pack_codes(q, spec.bits),
                       mlx_affine.f32_to_scales(spec, scale), mlx_affine.f32_to_scales(spec, bias))


def _quantize_mxfp4(w: np.ndarray) -> QuantMatrix:
    b = _groups(w, mxfp4.BLOCK)  # [R, B, 32]
    amax = np.abs(b).max(axis=-1)  # [R, B]
    mant, ex = np.frexp((amax / np.float32(mxfp4.E2M1_MAX)).astype(np.float32))
    e = np.where(mant == 0.5, ex - 1, ex)  # ceil(log2(amax / 6)); an exact power of two stays
    e = np.clip(np.where(amax == 0, 0, e), -mxfp4.E8M0_BIAS, mxfp4.E8M0_BIAS).astype(np.int32)
    mag = np.abs(b) / np.ldexp(np.float32(1), e)[..., None]  # [R, B, 32]
    dist = np.abs(mag[..., None] - mxfp4.E2M1_MAGNITUDES)  # [R, B, 32, 8]
    idx = np.argmin(dist, axis=-1).astype(np.uint8)  # argmin takes the first: ties to the smaller
    sign = ((b < 0) & (idx > 0)).astype(np.uint8) << np.uint8(3)
    q = (idx | sign).reshape(w.shape)
    return QuantMatrix(QuantType.MXFP4, w.shape[0], w.shape[1], pack_codes(q, 4),
                       (e + mxfp4.E8M0_BIAS).astype(np.uint8))


def quantize(qtype: QuantType, w: np.ndarray) -> QuantMatrix:
    """`mx.quantize`'s result for an MLX type, as a QuantMatrix.

    Shapes:
        w: [n_rows, n_cols] (n_cols a multiple of the group) -> QuantMatrix [n_rows, n_cols]
    """
    w = np.asarray(w, dtype=np.float32)
    if w.ndim != 2:
        raise ValueError(f"quantize wants a 2-D matrix, got shape {w.shape}")
    if qtype is QuantType.MXFP4:
        return _quantize_mxfp4(w)
    return _quantize_affine(AFFINE_SPECS[qtype], qtype, w)


def codes_of(m: QuantMatrix) -> np.ndarray:
    """The unsigned code of every weight (MXFP4: sign bit 3, magnitude bits 0-2). uint8 [R, C]"""
    bits = 4 if m.qtype is QuantType.MXFP4 else AFFINE_SPECS[m.qtype].bits
    return unpack_codes(m.codes, bits)


def dequantize(m: QuantMatrix) -> np.ndarray:
    """The float32 weights. [n_rows, n_cols] float32"""
    q = codes_of(m)
    if m.qtype is QuantType.MXFP4:
        vals = mxfp4.E2M1_VALUES[q].reshape(m.n_rows, -1, mxfp4.BLOCK)  # [R, B, 32]
        return (vals * mxfp4.e8m0_to_f32(m.scales)[..., None]).reshape(m.n_rows, m.n_cols)
    spec = AFFINE_SPECS[m.qtype]
    q = q.astype(np.float32).reshape(m.n_rows, -1, spec.group)  # [R, G, group]
    scale = mlx_affine.scales_to_f32(spec, m.scales)[..., None]
    bias = mlx_affine.scales_to_f32(spec, m.biases)[..., None]
    return (q * scale + bias).reshape(m.n_rows, m.n_cols).astype(np.float32)
