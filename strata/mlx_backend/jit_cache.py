"""Where MLX's CUDA build keeps the kernels it compiles, across processes (docs/mlx_backend.md,
"JIT compile costs on MLX's CUDA build").

MLX 0.32's CUDA backend compiles its JIT kernels with NVRTC on first use (fused elementwise
graphs of `mx.compile`, gather / scatter / slice updates, the quantized and gather GEMMs: CUTLASS
templates) and writes each module's cubin to `MLX_PTX_CACHE_DIR`, by default
`<temp dir>/mlx/<version>/ptx` (`jit_module.cpp`, `ptx_cache_dir`). A temp directory is gone
after a reboot or a tmp cleaner, and each such module costs seconds of NVRTC again (a CUTLASS
GEMM tens of seconds). So strata points the cache at the user's cache directory, per MLX
version (MLX names a cached module by its kernel name alone, not by MLX's version, once the
variable is set), unless the user set it. Custom kernels (`mx.fast.cuda_kernel`: all of
strata's own) are not written there by MLX (`custom_kernel.cpp` asks for no disk cache): they
compile once per process whatever this says.

Clear the cache by deleting the directory (`cache_dir()`); MLX recompiles what is missing.
"""

from __future__ import annotations

import os
import shutil
from pathlib import Path

ENV = "MLX_PTX_CACHE_DIR"  # MLX reads it once, at its first JIT compile (a function-local static)


def cache_root(env: dict | None = None) -> Path:
    """`$XDG_CACHE_HOME/strata` (XDG_CACHE_HOME defaulting to ~/.cache): where the GPU build's
    files live (MLX's modules here, strata's CUDA sources in kernels/included_source.py)."""
    env = os.environ if env is None else env
    return Path(env.get("XDG_CACHE_HOME") or Path.home() / ".cache") / "strata"


def default_dir(mlx_version: str, env: dict | None = None) -> Path:
    """`cache_root()/mlx-ptx/<mlx version>`."""
    return cache_root(env) / "mlx-ptx" / mlx_version


def set_default(env: dict | None = None) -> str:
    """Set MLX_PTX_CACHE_DIR to `default_dir` unless it is set; return the value in force. Must
    run before MLX's first JIT compile (strata.mlx_backend's import does it)."""
    env = os.environ if env is None else env
    if env.get(ENV):
        return env[ENV]
    import mlx.core as mx  # the version names the directory; importing MLX compiles nothing

    env[ENV] = str(default_dir(mx.__version__, env))
    return env[ENV]


def cache_dir() -> Path:
    """The directory MLX's CUDA build reads and writes compiled modules in (this process)."""
    return Path(set_default())


def clear() -> int:
    """Delete the cached modules (the next process recompiles them); the number of files removed."""
    d = cache_dir()
    if not d.is_dir():
        return 0
    n = sum(1 for f in d.rglob("*") if f.is_file())
    shutil.rmtree(d)
    return n
