"""MLX's affine formats, stored as mlx-lm writes them so a checkpoint's experts pass through bit-exact.

One definition (STYLE §3): a type is (bits, group, scale dtype). Per row, per group of `group`
weights: the codes (`group * bits / 8` bytes, packed LSB first: weight j of a row sits at bits
`bits * (j % (8 / bits))` of byte `j * bits // 8`, which read as little-endian uint32 words is
exactly MLX's packed `w`), one scale and one bias in the checkpoint's 16-bit float type
(float16 or bfloat16). Value = scale * q + bias (q unsigned, 0 .. 2**bits - 1).

In a QuantMatrix the scales and biases are two [rows, groups] arrays of 16-bit words (float16,
or the raw bits of bfloat16 as uint16: numpy has no bfloat16); in an `.experts` record the
scales plane holds all scales, then all biases (docs/formats.md), so each is one contiguous
array an MLX kernel or `gather_qmm` takes without repacking.
"""

from __future__ import annotations

from dataclasses import dataclass

import numpy as np

from strata.formats.quant_types import QuantType, layout


@dataclass(frozen=True)
class AffineSpec:
    bits: int
    group: int
    bfloat16: bool  # scale/bias dtype: bfloat16 (raw uint16 bits in numpy) or float16

    @property
    def scale_dtype(self) -> np.dtype:
        return np.dtype("<u2") if self.bfloat16 else np.dtype("<f2")

    @property
    def levels(self) -> int:
        return (1 << self.bits) - 1


AFFINE_SPECS: dict[QuantType, AffineSpec] = {
    QuantType[f"A{b}G{g}_{dt}"]: AffineSpec(b, g, dt == "BF16")
    for b in (4, 8) for g in (32, 64) for dt in ("F16", "BF16")
}
for _qt, _spec in AFFINE_SPECS.items():  # the block table and this one must agree
    _lay = layout(_qt)
    assert (_lay.block_size, _lay.bits, _lay.scale_bytes) == (_spec.group, _spec.bits, 2 * _spec.scale_dtype.itemsize), _qt
del _qt, _spec, _lay


def affine_type(bits: int, group: int, bfloat16: bool) -> QuantType:
    """The QuantType of MLX's affine (bits, group_size) with scales of that dtype; ValueError if none."""
    for qt, spec in AFFINE_SPECS.items():
        if spec == AffineSpec(bits, group, bfloat16):
            return qt
    raise ValueError(f"no strata type for MLX affine bits={bits} group_size={group} "
                     f"(supported: bits 4 or 8, group_size 32 or 64)")


def bf16_to_f32(bits: np.ndarray) -> np.ndarray:
    """Raw bfloat16 words (uint16) -> float32, exactly."""
    return (np.asarray(bits, np.uint16).astype(np.uint32) << np.uint32(16)).view(np.float32)


def f32_to_bf16(x: np.ndarray) -> np.ndarray:
    """float32 -> raw bfloat16 words, rounded to nearest, ties to even (MLX's and torch's cast);
    NaN stays a quiet NaN."""
    u = np.ascontiguousarray(x, np.float32).view(np.uint32)
    rounded = (u + np.uint32(0x7FFF) + ((u >> np.uint32(16)) & np.uint32(1))) >> np.uint32(16)
    nan = np.isnan(np.asarray(x, np.float32))
    return np.where(nan, (u >> np.uint32(16)) | np.uint32(0x40), rounded).astype(np.uint16)


def scales_to_f32(spec: AffineSpec, words: np.ndarray) -> np.ndarray:
    """Stored 16-bit scales or biases -> float32 (exact)."""
    return bf16_to_f32(words) if spec.bfloat16 else np.asarray(words).view("<f2").astype(np.float32)


def f32_to_scales(spec: AffineSpec, x: np.ndarray) -> np.ndarray:
    """float32 -> the stored 16-bit words (round to nearest even)."""
    return f32_to_bf16(x) if spec.bfloat16 else np.asarray(x, np.float32).astype("<f2")


def pack_codes(q: np.ndarray, bits: int) -> np.ndarray:
    """[R, C] unsigned codes < 2**bits -> uint8 [R, C * bits / 8], LSB first (MLX's order)."""
    if bits == 8:
        return np.ascontiguousarray(q, np.uint8)
    per = 8 // bits
    q = np.asarray(q, np.uint8).reshape(q.shape[0], -1, per)
    shifts = (np.arange(per, dtype=np.uint8) * bits).astype(np.uint8)
    return np.bitwise_or.reduce(q << shifts, axis=-1).astype(np.uint8)


def unpack_codes(b: np.ndarray, bits: int) -> np.ndarray:
    """Inverse of `pack_codes`: uint8 [R, C * bits / 8] -> uint8 [R, C]."""
    if bits == 8:
        return np.asarray(b, np.uint8)
    per = 8 // bits
    shifts = (np.arange(per, dtype=np.uint8) * bits).astype(np.uint8)
    q = (np.asarray(b, np.uint8)[..., None] >> shifts) & np.uint8((1 << bits) - 1)
    return q.reshape(b.shape[0], -1)
