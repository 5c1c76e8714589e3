"""benchmarks/graph_time.py's summing of ncu's CSV (the GPU part needs MLX's CUDA build): every
gpu__time_duration row counted once in its unit, other lines passed through."""

from __future__ import annotations

import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "benchmarks"))

import graph_time  # noqa: E402


def test_the_sum_counts_each_duration_row_in_its_unit(capsys):
    lines = ['==PROF== Connected\n', '"ID","Kernel Name","Metric Name","Metric Unit","Metric Value"\n',
             '"0","graph","gpu__time_duration.sum","usecond","10.5"\n',
             '"0","graph","launch__registers_per_thread","register/thread","80"\n',
             '"1","graph","gpu__time_duration.sum","nsecond","1,500"\n',
             '"2","graph","gpu__time_duration.sum","msecond","0.002"\n']
    out = graph_time.summed(2, lines)
    assert out == {"workloads": 3, "total_us": 14.0, "us_a_token": 7.0, "workloads_a_token": 1.5}
    assert capsys.readouterr().out == "==PROF== Connected\n"
