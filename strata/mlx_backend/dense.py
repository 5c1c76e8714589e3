"""Dense weights on MLX as the model file stores them (the twin of strata.formats.dense_weights).

What each stored type is held as, and how a matmul reads it:

    file   kernel path (float16 kernels)        ops path
    F32    float16 (rounded once, as before)    float32
    F16    float16, as stored                   float16, widened per op (exact)
    BF16   float16 (the kernels read float16)   bfloat16, widened per op (exact)
    Q8_0   Q8Dense: the stored planes (int8 codes, float16 d): the Q8_0 GEMV kernel on a GPU
           path, widened per op (exact: float32(code) * float32(d), the reference's values) on
           the ops path

The ops path already widened every weight per op (`x @ w.astype(float32).T`), so holding F16 and
BF16 as stored changes no value there; a Q8_0 model's matrices now take the ops path with the
Q8_0 GEMV on the GPU (its attention and shared-expert kernels read float16 only), holding 1.06
bytes per weight instead of float16's 2. `Q8Dense.dtype` is int8, never float16, so every
kernel-path check that wants float16 weights sends a Q8_0 layer to the ops path.

Shapes: R rows, C columns (C a multiple of 32 for Q8_0).
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Mapping, Sequence

import mlx.core as mx
import numpy as np

from strata.formats.dense_weights import StoredTensor, StoredType, as_dense_weights
from strata.formats.quant_types import QuantType, layout
from strata.mlx_backend.kernels import dense_gemv as f16_kernel
from strata.mlx_backend.kernels import q8_gemv as q8_kernel
from strata.mlx_backend.kernels.launch import KernelPath, current_path

__all__ = ["Q8Dense", "held", "held_rows_of", "held_column_blocks", "widen", "linear", "project", "rows", "nbytes_of"]

Q8 = layout(QuantType.Q8_0)


@dataclass(frozen=True, eq=False)
class Q8Dense:
    """A Q8_0 matrix as stored. Shapes: codes int8 [R, C], scales float16 [R, C/32]"""

    codes: mx.array
    scales: mx.array

    @property
    def shape(self) -> tuple[int, int]:
        return tuple(self.codes.shape)

    @property
    def dtype(self) -> mx.Dtype:
        return self.codes.dtype

    @property
    def nbytes(self) -> int:
        return self.codes.nbytes + self.scales.nbytes

    def arrays(self) -> list[mx.array]:
        return [self.codes, self.scales]

    def widen(self) -> mx.array:
        """float32 [R, C]: the reference's values, float32(code) * float32(d)."""
        return _widen_q8(self.codes, self.scales)


def _widen_q8(codes: mx.array, scales: mx.array) -> mx.array:
    r, c = codes.shape
    blocks = codes.astype(mx.float32).reshape(r, c // Q8.block_size, Q8.block_size)  # [R, C/32, 32]
    return (blocks * scales.astype(mx.float32)[:, :, None]).reshape(r, c)


Weight = mx.array | Q8Dense


def widen(w: Weight) -> mx.array:
    """float32 values of a held weight. [R, C] -> [R, C]"""
    return w.widen() if isinstance(w, Q8Dense) else w.astype(mx.float32)


def linear(x: mx.array, w: Weight) -> mx.array:
    """x @ W.T in float32. On a kernel path a Q8_0 matrix goes through the Q8_0 GEMV (it reads
    the stored planes); elsewhere the weight is widened for the op. x [T, C] -> [T, R]"""
    x = x.astype(mx.float32)
    if isinstance(w, Q8Dense) and current_path() is not KernelPath.OPS:
        return q8_kernel.q8_gemv(w.codes.view(mx.uint8), w.scales, x)
    return x @ widen(w).T


GEMV_ROWS = 8  # project: positions up to which a float16 matrix takes the GEMV (a decode, a window)


def project(x: mx.array, w: Weight) -> mx.array:
    """`linear`, with a float16 matrix on a kernel path read as stored by the float16 GEMV kernel
    (kernels/dense_gemv.py: float32 activations and accumulation) for up to GEMV_ROWS positions,
    where `linear` would widen it to a float32 copy per op (2 bytes read, then 4 written and read
    again, per weight). For the layers whose matrices no fused kernel serves (the hyper-connection
    residual's: mlx_backend/residual.py). x [T, C] -> float32 [T, R]"""
    if (isinstance(w, mx.array) and w.dtype == mx.float16 and current_path() is not KernelPath.OPS
            and x.shape[0] <= GEMV_ROWS and w.shape[1] % 8 == 0 and w.shape[1] <= f16_kernel.MAX_COLS):
        return f16_kernel.dense_gemv(w, x.astype(mx.float32))
    return linear(x, w)


def rows(w: Weight, ids: mx.array) -> mx.array:
    """Rows `ids` of a matrix in float32, widening only those (an embedding lookup).
    ids int32 [T] -> [T, C]"""
    if isinstance(w, Q8Dense):
        return _widen_q8(w.codes[ids], w.scales[ids])
    x = w[ids]
    return x if x.dtype == mx.float32 else x.astype(mx.float32)


def held(t: np.ndarray | StoredTensor, dtype: mx.Dtype) -> Weight:
    """What MLX keeps for a stored tensor on the path whose float dtype is `dtype` (float16:
    kernels; float32: ops), per the table in the module docstring."""
    if not isinstance(t, StoredTensor):
        return mx.array(np.asarray(t, np.float32)).astype(dtype)
    if t.qtype is StoredType.Q8_0 and t.ndim == 2:
        return Q8Dense(mx.array(t.codes), mx.array(t.scales))
    if t.qtype is StoredType.F16:
        return mx.array(t.codes)
    if t.qtype is StoredType.BF16 and dtype == mx.float32:
        return mx.array(t.codes).view(mx.bfloat16)
    return mx.array(t.widen()).astype(dtype)


def held_rows_of(dense: Mapping, names: Sequence[str], dtype: mx.Dtype) -> Weight:
    """The named matrices stacked by rows (one projection, like q | k | v), held as `held`
    would hold one: stored planes concatenated where they share a stored type, else float32
    widened and held as `dtype`. [R_i, C] each -> [sum R_i, C]"""
    d = as_dense_weights(dense)
    parts = [d.stored(n) for n in names]
    kinds = {p.qtype if isinstance(p, StoredTensor) else None for p in parts}
    if len(kinds) == 1 and None not in kinds and all(p.ndim == 2 for p in parts):
        first = parts[0]
        codes = np.concatenate([p.codes for p in parts])
        scales = None if first.scales is None else np.concatenate([p.scales for p in parts])
        shape = (codes.shape[0], first.shape[1])
        return held(StoredTensor(first.qtype, shape, codes, scales), dtype)
    return held(np.concatenate([d[n] for n in names]), dtype)


def held_column_blocks(t: np.ndarray | StoredTensor, dtype: mx.Dtype, width: int) -> tuple[Weight, ...]:
    """A matrix held as `held` would hold it, in contiguous blocks of `width` columns (a multiple
    of Q8_0's block for a Q8_0 matrix), so that each block fits what `project`'s GEMV reads: the
    hyper-connection's matrices over all streams are wider than one block of its threadgroup
    memory at full size (S = 4 x 2560 columns). [R, C] -> C / width x [R, width]"""
    r, c = t.shape
    if c % width:
        raise ValueError(f"held_column_blocks: {c} columns are not whole blocks of {width}")
    out = []
    for a in range(0, c, width):
        if not isinstance(t, StoredTensor):
            out.append(held(np.ascontiguousarray(np.asarray(t)[:, a:a + width]), dtype))
            continue
        b = Q8.block_size
        scales = None if t.scales is None else np.ascontiguousarray(t.scales[:, a // b:(a + width) // b])
        out.append(held(StoredTensor(t.qtype, (r, width), np.ascontiguousarray(t.codes[:, a:a + width]), scales),
                        dtype))
    return tuple(out)


def nbytes_of(weights: Sequence[Weight | None]) -> int:
    """Bytes held by these weights (None: absent)."""
    return sum(int(w.nbytes) for w in weights if w is not None)


