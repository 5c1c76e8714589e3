"""benchmarks/l2_probe.py on the emulated kernels at a tiny size: every sequence runs (the bulk
and line prefetch launches, the demand read, the GEMVs) and the measured GEMV's output is the same
after each (the probe asserts it; the prefetches are no-ops here), one marker line a sequence."""

from __future__ import annotations

import sys
from pathlib import Path

import pytest

sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "benchmarks"))

import l2_probe  # noqa: E402

from strata.mlx_backend.kernels import emulate  # noqa: E402
from strata.mlx_backend.kernels.launch import LAUNCHES, KernelPath, using_path  # noqa: E402


@pytest.mark.skipif(not emulate.available(), reason="no C++ compiler for the emulator")
def test_every_sequence_runs_and_changes_no_values(monkeypatch, capsys):
    monkeypatch.setattr(l2_probe, "ROWS", 64)
    monkeypatch.setattr(l2_probe, "COLS", 256)
    monkeypatch.setattr(l2_probe, "EVICT_BYTES", 1 << 16)
    before = {n: LAUNCHES[n] for n in ("strata_probe_l2_ask", "strata_probe_l2_lines", "strata_probe_l2_read")}
    with using_path(KernelPath.EMULATED):
        assert l2_probe.main() == 0
    lines = [ln for ln in capsys.readouterr().out.splitlines() if ln.startswith("l2_probe segment")]
    assert len(lines) == 2 * 5 and lines[0].endswith("cold") and lines[-1].endswith("copy")
    assert all(LAUNCHES[n] - b == 2 for n, b in before.items())  # each asking / reading launch once a pass
