"""Random valid `.experts` records of MLX's own types (affine 4/8-bit, MXFP4), made on the device:
what the native expert kernel's benchmarks read (values do not matter to them; valid scales and
distinct addresses do). `random_records` (mlx_params.py) makes Q2_0's.
"""

from __future__ import annotations

import mlx.core as mx

from strata.formats.expert_record import RecordLayout
from strata.formats.mlx_affine import AFFINE_SPECS
from strata.formats.quant_types import QuantType

__all__ = ["random_native_records"]

MXFP4_SCALE_RANGE = (118, 124)  # e8m0 bytes: 2^-9 .. 2^-4, the weights' scale at |w| <= 6 * 2^-4


def _scale_plane(rec: RecordLayout, nbytes: int, m: int, key: mx.array) -> mx.array:
    """uint8 [m, nbytes]: a projection's scales plane (affine: scales then biases; MXFP4: e8m0 bytes)."""
    if rec.qtype is QuantType.MXFP4:
        return mx.random.randint(*MXFP4_SCALE_RANGE, (m, nbytes), key=key).astype(mx.uint8)
    dtype = mx.bfloat16 if AFFINE_SPECS[rec.qtype].bfloat16 else mx.float16
    k1, k2 = mx.random.split(key)
    n = nbytes // 4  # scales, then as many biases, 2 bytes each
    scales = mx.random.uniform(1e-3, 2e-2, (m, n), key=k1)
    biases = -scales * mx.random.uniform(0.0, float((1 << AFFINE_SPECS[rec.qtype].bits) - 1), (m, n), key=k2)
    return mx.concatenate([scales, biases], axis=1).astype(dtype).view(mx.uint8)


def random_native_records(rec: RecordLayout, n: int, key: mx.array) -> mx.array:
    """n valid records (uint8 [n, padded_bytes]) of an MLX type: random codes (any byte is valid),
    affine scales in [1e-3, 2e-2] with biases in [-levels * scale, 0], MXFP4 scales 2^-9 .. 2^-4,
    and (records with biases) float32 expert biases of about 0.1."""
    if rec.qtype not in AFFINE_SPECS and rec.qtype is not QuantType.MXFP4:
        raise ValueError(f"random native records are MLX types, not {rec.qtype.name}")
    keys = mx.random.split(key, len(rec.planes))
    pieces, end = [], 0
    for i, span in enumerate(rec.planes):
        if span.offset > end:
            pieces.append(mx.zeros((n, span.offset - end), mx.uint8))
        if i >= 6:  # expert biases (float32)
            pieces.append((0.1 * mx.random.normal((n, span.nbytes // 4), key=keys[i])).view(mx.uint8))
        elif i % 2 == 0:
            pieces.append(mx.random.randint(0, 256, (n, span.nbytes), key=keys[i]).astype(mx.uint8))
        else:
            pieces.append(_scale_plane(rec, span.nbytes, n, keys[i]))
        end = span.end
    pieces.append(mx.zeros((n, rec.padded_bytes - end), mx.uint8))
    out = mx.concatenate(pieces, axis=1)
    mx.eval(out)
    return out
