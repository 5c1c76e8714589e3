"""Shapes from a small fixed set, so that a new prompt length does not compile a new kernel.

On MLX's CUDA build a custom kernel is compiled (NVRTC, once per process) per distinct tuple of
template values (`custom_kernel.cpp`: the module is named by the kernel's name, its template
values and a hash of the source those values are baked into). The Q2_0 grouped GEMM's row count
M = P x cap (kernels/q2_mma.py) is a template value, and cap (the largest number of (token,
expert) pairs one expert got) changes with every prompt: each new one cost a compile of seconds
(docs/mlx_backend.md, "JIT compile costs on MLX's CUDA build"). Rounded up to a bucket it takes
a handful of values over every prompt length; the rows past a group's count are zeros and are
never gathered back, so the real rows' products are unchanged.

Buckets: powers of two from MIN_BUCKET up to LINEAR_FROM, then multiples of LINEAR_FROM: under 2x
the rows, n + LINEAR_FROM - 1 at most past LINEAR_FROM, and 5 + n / LINEAR_FROM distinct values
up to n.
"""

from __future__ import annotations

MIN_BUCKET = 16  # a matrix-unit tile's rows (mma m16): fewer rows are padding anyway
LINEAR_FROM = 256  # past it, multiples: a power of two would cost up to 2x the rows of a large group


def bucket(n: int) -> int:
    """The bucket n rounds up to: >= n, from a fixed set independent of any model or prompt."""
    if n < 0:
        raise ValueError(f"bucket: negative count {n}")
    if n <= LINEAR_FROM:
        return max(MIN_BUCKET, 1 << max(0, n - 1).bit_length())
    return -(-n // LINEAR_FROM) * LINEAR_FROM
