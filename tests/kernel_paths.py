"""The kernel paths the MLX kernel tests run on: the emulated one (the shared kernel bodies
compiled for the CPU; needs a C++20 compiler) and the GPU one (marked `gpu`, skipped where MLX
has no GPU), and a kernel plan put in force for a test. Import after
`pytest.importorskip("mlx.core")`."""

from __future__ import annotations

import contextvars

import pytest

from strata.mlx_backend import kernel_plan
from strata.mlx_backend.kernel_plan import KernelPlan
from strata.mlx_backend.kernels import emulate
from strata.mlx_backend.kernels.launch import KernelPath, gpu_dialect

emulated = pytest.mark.skipif(not emulate.available(), reason="no C++20 compiler")
gpu = [pytest.mark.gpu, pytest.mark.skipif(gpu_dialect() is None, reason="no MLX GPU here")]
KERNEL_PATHS = [pytest.param(KernelPath.EMULATED, id="emulated", marks=emulated),
                pytest.param(KernelPath.GPU, id="gpu", marks=gpu)]


def plan_in_force(monkeypatch, **fields) -> KernelPlan:
    """KernelPlan(**fields) in force for the rest of the test, as `using_plan` puts it in force
    for a block (within what the path in force can do; an engine's own plan still wins)."""
    plan = KernelPlan(**fields)
    monkeypatch.setattr(kernel_plan, "_given", contextvars.ContextVar("strata_test_kernel_plan", default=plan))
    return plan
