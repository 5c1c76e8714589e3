"""Quantized weights on MLX arrays: the twins of strata.reference.quants.dequantize / gemv.

A strata block (32 weights, float16 d, codes) is MLX's affine group (group 32): value =
scale * q_u + bias with the codes packed LSB-first into uint32 words, so every strata type maps
onto `mx.quantize`'s layout without changing a value:

    Q2_0  q_u = q             scale = d  bias = -2 d    bits 2  (the codes plane read as uint32 IS
                                                                 MLX's packed w, design §2)
    Q4_0  q_u = q (repacked)  scale = d  bias = -8 d    bits 4  (ggml's nibble order differs)
    Q8_0  q_u = q + 128       scale = d  bias = -128 d  bits 8

MLX's own types (the affine types of mlx-lm checkpoints, MXFP4) are held as MLX keeps them:
the codes plane is the packed w, the scales (and biases) in their stored dtype (`NATIVE`).

Scales and biases of the strata types are held in float32 (exact: -2d and -128d of a float16 d can overflow float16).
The Q8_0 GEMV also has a custom kernel (kernels/q8_gemv.py, the read-ahead router guess).

Shapes: see each function.
"""

from __future__ import annotations

from dataclasses import dataclass

import mlx.core as mx
import numpy as np

from strata.formats.mlx_affine import AFFINE_SPECS
from strata.formats.quant_matrix import QuantMatrix, scale_dtype
from strata.formats.quant_types import FLOAT_DTYPES, Q2_0_LEVEL_OFFSET, Q4_0_LEVEL_OFFSET, QuantType, layout
from strata.mlx_backend.kernels import q8_gemv as q8_kernel
from strata.mlx_backend.kernels.launch import KernelPath, current_path
from strata.reference.quants import codes_of
from strata.option_names import option

__all__ = ["MlxQuantMatrix", "to_mlx", "dequantize", "gemv", "AFFINE"]

GROUP = 32
# type -> (bits, unsigned-code offset added to the stored code, bias in units of -d)
AFFINE = {QuantType.Q2_0: (2, 0, Q2_0_LEVEL_OFFSET), QuantType.Q4_0: (4, 0, Q4_0_LEVEL_OFFSET),
          QuantType.Q8_0: (8, 128, 128)}
assert all(layout(q).block_size == GROUP for q in AFFINE)
# MLX's own types (mlx-lm checkpoints): the codes plane IS MLX's packed w and the scales (and
# biases) are MLX's, as stored: type -> (bits, group_size, mode)
NATIVE = {**{q: (s.bits, s.group, "affine") for q, s in AFFINE_SPECS.items()}, QuantType.MXFP4: (4, 32, "mxfp4")}
_MX_SCALE_DTYPES = {np.dtype("<f2"): mx.float16, np.dtype("<u2"): mx.bfloat16, np.dtype(np.uint8): mx.uint8}


def native_scale_view(qtype: QuantType, words: mx.array) -> mx.array:
    """Stored scale words (uint8 bytes or 16-bit words) as the MLX dtype `mx.quantize` uses for them."""
    target = _MX_SCALE_DTYPES[scale_dtype(qtype)]
    return words if words.dtype == target else words.view(target)


@dataclass(frozen=True, eq=False)
class MlxQuantMatrix:
    """A QuantMatrix in MLX's affine layout (quantized types) or as a float matrix.

    Shapes:
        w: uint32 [R, C * bits / 32] (float types: float32 [R, C]); scales, biases: float32 [R, C/32]
        codes, raw_scales: the strata planes as MLX arrays (uint8 [R, ...], float16 [R, C/32])
    """

    qtype: QuantType
    n_rows: int
    n_cols: int
    w: mx.array
    scales: mx.array | None
    biases: mx.array | None
    codes: mx.array
    raw_scales: mx.array
    group: int = GROUP
    mode: str = "affine"

    @property
    def bits(self) -> int:
        return NATIVE[self.qtype][0] if self.qtype in NATIVE else AFFINE[self.qtype][0]


def _pack(q: np.ndarray, bits: int) -> np.ndarray:
    """[R, C] unsigned codes < 2**bits -> uint32 [R, C*bits/32], LSB first (MLX's order)."""
    per = 32 // bits
    q = q.astype(np.uint32).reshape(q.shape[0], -1, per)
    shifts = (np.arange(per, dtype=np.uint32) * bits)
    return np.bitwise_or.reduce(q << shifts, axis=-1).astype(np.uint32)


def to_mlx(m: QuantMatrix) -> MlxQuantMatrix:
    """The MLX form of a QuantMatrix (one host pass; Q2_0 codes are only re-viewed)."""
    if isinstance(m, MlxQuantMatrix):
        return m
    codes, raw = mx.array(np.ascontiguousarray(m.codes)), mx.array(np.ascontiguousarray(m.scales))
    if m.qtype in FLOAT_DTYPES:
        w = m.codes.view(FLOAT_DTYPES[m.qtype]).reshape(m.n_rows, m.n_cols).astype(np.float32)
        return MlxQuantMatrix(m.qtype, m.n_rows, m.n_cols, mx.array(w), None, None, codes, raw)
    if m.qtype in NATIVE:
        _, group, mode = NATIVE[m.qtype]
        w = mx.array(np.ascontiguousarray(m.codes).view("<u4"))
        sc = native_scale_view(m.qtype, raw)
        bi = None if m.biases is None else native_scale_view(m.qtype, mx.array(np.ascontiguousarray(m.biases)))
        return MlxQuantMatrix(m.qtype, m.n_rows, m.n_cols, w, sc, bi, codes, raw, group, mode)
    bits, add, bias = AFFINE[m.qtype]
    if m.qtype is QuantType.Q2_0:
        w = np.ascontiguousarray(m.codes).view("<u4")  # the codes plane is MLX's packed w
    else:
        q = codes_of(m).astype(np.int32) + add
        w = _pack(q, bits)
    d = m.scales.astype(np.float32)
    return MlxQuantMatrix(m.qtype, m.n_rows, m.n_cols, mx.array(w), mx.array(d), mx.array(-float(bias) * d), codes, raw)


def dequantize(m: QuantMatrix | MlxQuantMatrix) -> mx.array:
    """Twin of reference `dequantize`. -> float32 [n_rows, n_cols]"""
    m = to_mlx(m)
    if m.qtype in FLOAT_DTYPES:
        return m.w
    if m.qtype in NATIVE:  # in float32: mx.dequantize rounds its output to the scales' dtype
        sc = m.scales if m.biases is None else m.scales.astype(mx.float32)
        bi = None if m.biases is None else m.biases.astype(mx.float32)
        return mx.dequantize(m.w, sc, bi, group_size=m.group, bits=m.bits, mode=m.mode).astype(mx.float32)
    return mx.dequantize(m.w, m.scales, m.biases, group_size=GROUP, bits=m.bits).astype(mx.float32)


def gemv(m: QuantMatrix | MlxQuantMatrix, x) -> mx.array:
    """Twin of reference `gemv`: y = W x in float32.

    Shapes:
        x: [n_cols] or [T, n_cols] -> y: [n_rows] or [T, n_rows]
    """
    m = to_mlx(m)
    x = x if isinstance(x, mx.array) else mx.array(np.asarray(x, np.float32))
    if x.shape[-1] != m.n_cols:
        raise ValueError(f"gemv: x has {x.shape[-1]} features, the matrix wants {m.n_cols}")
    one = x.ndim == 1
    x2 = x.reshape(1, -1) if one else x
    x2 = x2.astype(mx.float32)
    if m.qtype in FLOAT_DTYPES:
        y = x2 @ m.w.T
    elif m.qtype is QuantType.Q8_0 and current_path() is not KernelPath.OPS:
        y = q8_kernel.q8_gemv(m.codes, m.raw_scales, x2)
    else:
        y = mx.quantized_matmul(x2, m.w, m.scales, m.biases, transpose=True, group_size=m.group, bits=m.bits,
                                mode=m.mode)
    return y.reshape(-1) if one else y


def _on_cuda() -> bool:
    cuda = getattr(mx, "cuda", None)
    return cuda is not None and cuda.is_available() and mx.default_device() == mx.gpu


def native_refusal(qtype: QuantType, rec=None, *, gather: bool = False) -> str | None:
    """Why MLX on this device cannot compute `qtype` experts (None: it can). Measured on an H200
    (MLX 0.32.4's CUDA build): `gather_qmm` has no mxfp4 kernel for float32 activations ("No
    implementation for problem shape"); Metal and the CPU build run it. The fused native kernel
    (kernels/moe_native.py) computes MXFP4 itself, so on a kernel path only records it refuses
    (`rec`, a RecordLayout; None: a shape it serves) still need gather_qmm. gather: the caller
    is about to call gather_qmm itself (the ops path), whatever the path."""
    if qtype != QuantType.MXFP4 or not _on_cuda():
        return None
    from strata.mlx_backend.kernels import moe_native  # the kernel's own limits (no import cycle at load)

    if not gather and current_path() is not KernelPath.OPS and (rec is None or moe_native.supports(rec) is None):
        return None
    return f"MLX's CUDA gather_qmm has no MXFP4 kernel for float32 activations (use {option('backend', 'numpy')})"
