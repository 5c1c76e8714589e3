"""Where kernel-backed functions run: `KernelPath` and the path in force.

- GPU: the shared body through `mx.fast.metal_kernel` (Apple) or `mx.fast.cuda_kernel` (NVIDIA);
- EMULATED: the same body compiled for the CPU (emulate.py); inputs are evaluated to numpy;
- OPS: no custom kernel; the public functions use their MLX-ops twins (the CPU default).

The default is GPU where MLX sees a GPU, else OPS; `using_path(p)` switches it (tests). Its own
module so the kernel plan (kernel_plan.py), which launch.py reads, can ask for it too.
"""

from __future__ import annotations

import contextlib
import contextvars
import enum
import functools
from typing import Iterator

import mlx.core as mx

from strata.mlx_backend.kernels import emulate
from strata.mlx_backend.kernels.preludes import Dialect

__all__ = ["KernelPath", "gpu_dialect", "default_path", "current_path", "using_path"]


class KernelPath(enum.Enum):
    GPU = "gpu"
    EMULATED = "emulated"
    OPS = "ops"


@functools.cache
def gpu_dialect() -> Dialect | None:
    """The dialect of the GPU MLX sees here, or None (CPU-only MLX). Asked once per process."""
    if mx.metal.is_available():
        return Dialect.METAL
    if hasattr(mx, "cuda") and mx.cuda.is_available():
        return Dialect.CUDA
    return None


def default_path() -> KernelPath:
    return KernelPath.GPU if gpu_dialect() is not None else KernelPath.OPS


_path: contextvars.ContextVar[KernelPath | None] = contextvars.ContextVar("strata_kernel_path", default=None)


def current_path() -> KernelPath:
    p = _path.get()
    return default_path() if p is None else p


@contextlib.contextmanager
def using_path(path: KernelPath) -> Iterator[None]:
    """Run kernel-backed functions on `path` inside the block."""
    if path is KernelPath.GPU and gpu_dialect() is None:
        raise RuntimeError("no MLX GPU here (Metal or CUDA): the GPU kernel path cannot run")
    if path is KernelPath.EMULATED and not emulate.available():
        raise RuntimeError("no C++ compiler here: the emulated kernel path cannot run")
    token = _path.set(path)
    try:
        yield
    finally:
        _path.reset(token)
