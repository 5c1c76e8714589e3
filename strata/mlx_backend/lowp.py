"""Matmuls on float16 matrix units with float32-accurate activations: the prompt path's products.

The weights of the prompt path's matmuls are float16-exact (float16 dense weights; Q2_0's
d (q - 2) of a float16 d), so only the activations lose bits when a product runs on float16
matrix units. Rounding them alone cost the made shapes 0.1-1% of their logits (relative L2,
tests/mlx_backend/test_mlx_prompt.py), most of it in the attention and expert projections. So an activation
x goes in as two float16 terms, hi = f16(x) and lo = f16(x - hi) (x = hi + lo to ~2^-22
relative): each product of float16 values is exact in the float32 accumulator, and W x = W hi +
W lo is one GEMM over twice the rows, the weights read once. Twice the flops (~28 ms instead of
~14 at the seed shape's 2048-token prompt on the H200) for float32-level logits.

Rounding them once (half the flops; what mlx-lm does in float16) cost those 0.1-1%, so every
product takes the two terms.

On MLX's CPU build (no float16 GEMM worth the name: its float16 matmul rounds its output, and its
gather_mm is float32 only) the same float16 values are multiplied in float32, which is what a
GPU's float32 accumulation computes.

Shapes: see each function.
"""

from __future__ import annotations

import mlx.core as mx

__all__ = ["mm_dtype", "as_mm", "split_rows", "join_rows", "lowp_matmul"]


def mm_dtype(dtype: mx.Dtype) -> mx.Dtype:
    """The dtype the products take `dtype` inputs in: `dtype` on a GPU, float32 on the CPU."""
    return dtype if mx.default_device() == mx.gpu else mx.float32


def as_mm(a: mx.array, dtype: mx.Dtype) -> mx.array:
    """a rounded to `dtype`, in the dtype the products take (`mm_dtype`)."""
    lo = mm_dtype(dtype)
    return a.astype(dtype) if lo == dtype else a.astype(dtype).astype(lo)


def split_rows(x: mx.array, dtype: mx.Dtype, axis: int = 0) -> mx.array:
    """x as its hi rows then its lo rows along `axis` (x of `dtype` already, e.g. the float16
    attention output, as it is: its lo rows would be zeros; float32 products: x itself).
    x float32 [.., N, ..] -> [.., 2N, ..] (or [.., N, ..]), in `mm_dtype(dtype)`"""
    if dtype == mx.float32 or x.dtype == dtype:  # x already of dtype: its lo term is zeros
        return as_mm(x, dtype)
    hi = x.astype(dtype)
    lo = (x - hi.astype(mx.float32)).astype(dtype)
    m = mm_dtype(dtype)
    return mx.concatenate([hi.astype(m), lo.astype(m)], axis=axis)


def join_rows(y: mx.array, n: int, axis: int = 0) -> mx.array:
    """The sum of the hi and lo rows' products (float32): [.., 2N or N, ..] -> [.., N, ..]"""
    y = y.astype(mx.float32)
    if y.shape[axis] == n:
        return y
    lead = (slice(None),) * (axis % y.ndim)
    return y[lead + (slice(0, n),)] + y[lead + (slice(n, 2 * n),)]


def lowp_matmul(x: mx.array, w: mx.array, dtype: mx.Dtype) -> mx.array:
    """x @ w.T on `dtype` matrix units, w float16-exact. x [T, C], w [R, C] -> float32 [T, R]"""
    return join_rows(split_rows(x, dtype) @ as_mm(w, dtype).T, x.shape[0])
