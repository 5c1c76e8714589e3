"""benchmarks/mla.py's byte counts: the three kernels' bytes (`kernel_bytes`, printed beside
ncu's time of each launch) add up to the step's (`kernels/mla.py` `absorbed_bytes`), at
DeepSeek-V3's attention shape and every length --ncu launches."""

from __future__ import annotations

import sys
from pathlib import Path

import pytest

pytest.importorskip("mlx.core")
sys.path.insert(0, str(Path(__file__).resolve().parents[2] / "benchmarks"))

import mla as mla_bench  # noqa: E402
from strata.mlx_backend.kernels import mla as mla_kernel  # noqa: E402


@pytest.mark.parametrize("positions", mla_bench.NCU_CONTEXTS + (1, 33))
def test_the_kernels_bytes_add_up_to_the_steps(positions):
    h, c, r, n, v = mla_bench._shape(mla_bench.DEEPSEEK_V3_SHAPE)
    ns = mla_kernel.MAX_SPLITS
    kb = mla_bench.kernel_bytes(h, c, r, n, v, positions, ns)
    step = mla_kernel.absorbed_bytes(h, c, r, n, v, positions, ns)
    assert kb["query"] + kb["attend"] + kb["output"] == kb["total"]
    assert kb["total"] - step["total"] == 4 * 2 * (c + r)  # the kernels also count the new row read and written
    assert kb["query"] > 2 * h * n * c and kb["output"] > 2 * h * v * c  # W_uk, W_uv: 16.8 MB each
    assert kb["attend"] >= 4 * positions * (c + r)  # every cached row once
