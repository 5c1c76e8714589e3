"""Build each kernel once and launch it on the path in force: a GPU, the emulator, or none.

`KernelPath` names how a kernel-backed function runs:
- GPU: the shared body through `mx.fast.metal_kernel` (Apple) or `mx.fast.cuda_kernel` (NVIDIA),
  built once per body (mlx-lm's `gated_delta.py` pattern) and specialised by template arguments;
- EMULATED: the same body compiled for the CPU (emulate.py); inputs are evaluated to numpy;
- OPS: no custom kernel; the public functions use their MLX-ops twins (the CPU default).

The default is GPU where MLX sees a GPU, else OPS. `using_path(p)` switches it (tests).
"""

from __future__ import annotations

import collections
import contextlib
import contextvars
import enum
import functools
from typing import Iterator, Sequence

import mlx.core as mx
import numpy as np

from strata.mlx_backend.kernels import emulate
from strata.mlx_backend.kernels.preludes import Dialect
from strata.mlx_backend.kernels.source import MIN_INPUT_SIZE, KernelSource, mlx_source


class KernelPath(enum.Enum):
    GPU = "gpu"
    EMULATED = "emulated"
    OPS = "ops"


def gpu_dialect() -> Dialect | None:
    """The dialect of the GPU MLX sees here, or None (CPU-only MLX)."""
    if mx.metal.is_available():
        return Dialect.METAL
    if hasattr(mx, "cuda") and mx.cuda.is_available():
        return Dialect.CUDA
    return None


def default_path() -> KernelPath:
    return KernelPath.GPU if gpu_dialect() is not None else KernelPath.OPS


LAUNCHES: collections.Counter = collections.Counter()  # custom-kernel launches by kernel name (benchmarks)

_recording: contextvars.ContextVar[list | None] = contextvars.ContextVar("strata_kernel_recording", default=None)


@contextlib.contextmanager
def recording() -> Iterator[list]:
    """Collect (source, input dtype names, output dtype names, template) of every launch in the
    block (the compile checks build each specialisation that actually ran for Metal and CUDA)."""
    seen: list = []
    token = _recording.set(seen)
    try:
        yield seen
    finally:
        _recording.reset(token)


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


@functools.cache
def _built(src: KernelSource, dialect: Dialect):
    header, body = mlx_source(src, dialect)
    make = mx.fast.metal_kernel if dialect is Dialect.METAL else mx.fast.cuda_kernel
    return make(name=src.name, input_names=list(src.inputs), output_names=list(src.outputs),
                source=body, header=header)


def _padded(a) -> mx.array:
    """An input of at least MIN_INPUT_SIZE elements. Host (numpy) inputs are padded on the host,
    which costs no launch; a small MLX array costs one concatenate (avoid in hot paths)."""
    if isinstance(a, np.ndarray):
        a = np.ascontiguousarray(a)
        if a.size < MIN_INPUT_SIZE:
            a = np.concatenate([a.reshape(-1), np.zeros(MIN_INPUT_SIZE - a.size, a.dtype)])
        return mx.array(a)
    if a.size >= MIN_INPUT_SIZE:
        return a
    flat = a.reshape(-1)
    return mx.concatenate([flat, mx.zeros((MIN_INPUT_SIZE - a.size,), dtype=a.dtype)])


def as_f32(a):
    """a as float32 without an op when it already is (host arrays are converted on the host)."""
    if isinstance(a, np.ndarray):
        return np.ascontiguousarray(a, dtype=np.float32)
    return a if a.dtype == mx.float32 else a.astype(mx.float32)


def int_params(*values: int) -> np.ndarray:
    """Runtime int scalars for a kernel (a host array: padded without a launch)."""
    return np.array(values, dtype=np.int32)


def float_params(*values: float) -> np.ndarray:
    return np.array(values, dtype=np.float32)


def launch(src: KernelSource, inputs: Sequence, output_shapes: Sequence[tuple[int, ...]],
           output_dtypes: Sequence, *, blocks: tuple[int, int, int], threads: int,
           template: Sequence[tuple[str, int]]) -> list[mx.array]:
    """Launch `src` over `blocks` (x, y, z) blocks of `threads` threads on the current path.

    `template` holds the compile-time ints. Inputs are mx.arrays or host numpy arrays; those
    smaller than MIN_INPUT_SIZE are padded (the bodies index them by their logical size).
    Must not be called on the OPS path.
    """
    path = current_path()
    template = tuple((k, int(v)) for k, v in template)
    grid = (blocks[0] * threads, blocks[1], blocks[2])
    tg = (threads, 1, 1)
    inputs = [_padded(a) for a in inputs]
    LAUNCHES[src.name] += 1
    rec = _recording.get()
    if rec is not None:
        key = (src, tuple(str(a.dtype).split(".")[-1] for a in inputs),
               tuple(str(d).split(".")[-1] for d in output_dtypes), template)
        if key not in rec:
            rec.append(key)
    if path is KernelPath.GPU:
        kernel = _built(src, gpu_dialect())
        return kernel(inputs=list(inputs), template=list(template), grid=grid, threadgroup=tg,
                      output_shapes=[tuple(s) for s in output_shapes], output_dtypes=list(output_dtypes))
    if path is KernelPath.EMULATED:
        mx.eval(*inputs)
        host = [np.array(a, copy=False) for a in inputs]  # zero-copy: in-place writes reach MLX memory
        outs = emulate.run(src, host, [tuple(s) for s in output_shapes],
                           [np.dtype(str(d).split(".")[-1]) for d in output_dtypes], grid, tg, template)
        return [mx.array(o) for o in outs]
    raise RuntimeError(f"kernel {src.name} launched on the OPS path: the caller must use its MLX-ops twin")
