"""benchmarks/spy_summary.py: a py-spy raw profile summarised inside a frame, with the JIT
compile's samples dropped (they would otherwise be most of a short run's samples)."""

from __future__ import annotations

import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "benchmarks"))

from spy_summary import summarise  # noqa: E402

RAW = [
    "<module> (run.py:1);measure (host_cost.py:80);mlx::core::async_eval;mlx::core::cu::get_jit_module;nvrtcCompileProgram 90",
    "<module> (run.py:1);measure (host_cost.py:80);mlx::core::async_eval;mlx::core::fast::CustomKernel::eval_gpu;std::_Hash_bytes 3",
    "<module> (run.py:1);measure (host_cost.py:81);mlx::core::async_eval;mlx::core::cu::CommandEncoder::commit 1",
    "<module> (run.py:1);_made (host_cost.py:60);random_params (mlx_params.py:9) 6",
    "not a sample line",
]


def _share(out: list[str], section: str, name: str) -> str:
    rows = out[out.index(section) + 1:]
    return next(r.split()[0] for r in rows if r.endswith(name))


def test_jit_samples_are_dropped_and_shares_are_within_the_frame():
    out = summarise(RAW, "measure", 10)
    assert out[0] == "## within measure: 4"  # 3 + 1: the 90 compile samples and _made's 6 left out
    assert _share(out, "self:", "std::_Hash_bytes") == "75.0%"
    assert _share(out, "inclusive:", "mlx::core::async_eval") == "100.0%"


def test_nothing_excluded_counts_every_sample():
    out = summarise(RAW, None, 10, excluding=())
    assert out[0] == "## all samples: 100"
    assert _share(out, "self:", "nvrtcCompileProgram") == "90.0%"
