"""Random valid `.experts` records of MLX's own types (affine 4/8-bit, MXFP4), made on the device:
what the native expert kernel's benchmarks read (values do not matter to them; valid scales and
distinct addresses do). `random_records` (mlx_params.py) makes Q2_0's.
"""

from __future__ import annotations

import math

import mlx.core as mx

from strata.formats.expert_record import PROJECTIONS, RecordLayout
from strata.formats.mlx_affine import AFFINE_SPECS
from strata.formats.quant_types import QuantType

__all__ = ["random_native_records"]

# weights of about N(0, 1 / fan-in), as a trained model's: outputs of order 1 through a whole
# expert (scales fixed regardless of the fan-in overflowed the reference's exp at D = 2880)
SPREAD = 6.0  # a group's range, in units of 1 / sqrt(fan-in)


def _scale_plane(rec: RecordLayout, nbytes: int, fan_in: int, m: int, key: mx.array) -> mx.array:
    """uint8 [m, nbytes]: a projection's scales plane (affine: scales then biases; MXFP4: e8m0 bytes)."""
    span = SPREAD / math.sqrt(fan_in)  # a group's range of values
    if rec.qtype is QuantType.MXFP4:  # 6 * 2^(e-127) about span / 2
        e = 127 + round(math.log2(span / 2 / 6))
        return mx.random.randint(e - 1, e + 2, (m, nbytes), key=key).astype(mx.uint8)
    spec = AFFINE_SPECS[rec.qtype]
    dtype = mx.bfloat16 if spec.bfloat16 else mx.float16
    n = nbytes // 4  # scales, then as many biases, 2 bytes each
    scales = mx.random.uniform(0.5, 1.5, (m, n), key=key) * (span / spec.levels)
    biases = -scales * (spec.levels / 2)  # centred: q = levels / 2 is 0
    return mx.concatenate([scales, biases], axis=1).astype(dtype).view(mx.uint8)


def random_native_records(rec: RecordLayout, n: int, key: mx.array) -> mx.array:
    """n valid records (uint8 [n, padded_bytes]) of an MLX type: random codes (any byte is valid),
    weights of about N(0, 1 / fan-in) (affine groups centred on 0, MXFP4 scales to match), and
    (records with biases) float32 expert biases of about 0.1."""
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
            pieces.append(_scale_plane(rec, span.nbytes, rec.shape(PROJECTIONS[i // 2])[1], n, keys[i]))
        end = span.end
    pieces.append(mx.zeros((n, rec.padded_bytes - end), mx.uint8))
    out = mx.concatenate(pieces, axis=1)
    mx.eval(out)
    return out
