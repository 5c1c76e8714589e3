"""The kernel paths the MLX kernel tests run on: the emulated one (the shared kernel bodies
compiled for the CPU; needs a C++20 compiler) and the GPU one (marked `gpu`, skipped where MLX
has no GPU). Import after `pytest.importorskip("mlx.core")`."""

from __future__ import annotations

import pytest

from strata.mlx_backend.kernels import emulate
from strata.mlx_backend.kernels.launch import KernelPath, gpu_dialect

emulated = pytest.mark.skipif(not emulate.available(), reason="no C++20 compiler")
gpu = [pytest.mark.gpu, pytest.mark.skipif(gpu_dialect() is None, reason="no MLX GPU here")]
KERNEL_PATHS = [pytest.param(KernelPath.EMULATED, id="emulated", marks=emulated),
                pytest.param(KernelPath.GPU, id="gpu", marks=gpu)]
