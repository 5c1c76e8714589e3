"""benchmarks/peers.py runs on MLX's CPU build at its small shape (issue 19: the lead runs it on
the H200 at the full one): every row timed for strata, and for mlx-lm where it is installed (a
benchmark-only dependency), the ratios printed in its JSON line."""

from __future__ import annotations

import importlib.util
import json
import subprocess
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[2]


@pytest.mark.slow
def test_peers_small_runs_and_reports_every_row():
    has_mlx_lm = importlib.util.find_spec("mlx_lm") is not None
    only = "mlx_lm,strata" if has_mlx_lm else "strata"
    out = subprocess.run([sys.executable, str(ROOT / "benchmarks" / "peers.py"), "--small", "--lengths", "16,32",
                          "--only", only], capture_output=True, text=True, timeout=600, cwd=ROOT)
    assert out.returncode == 0, out.stderr[-2000:]
    res = json.loads([l for l in out.stdout.splitlines() if l.startswith("JSON ")][-1][5:])
    rows = ("decode at 8", "decode at 32", "prompt 16", "prompt 32")
    assert set(rows) <= set(res["times_s"]["strata"]) and all(res["times_s"]["strata"][r] > 0 for r in rows)
    assert set(res["ratios"]) == set(rows)
    if has_mlx_lm:
        assert all(res["ratios"][r] > 0 for r in rows)
        assert res["all_at_least_2x"] is (min(res["ratios"].values()) >= 2)
    else:
        assert all(v is None for v in res["ratios"].values())
        assert res["all_at_least_2x"] is None  # one side: no verdict


def test_mlx_lm_model_files_load_without_its_tokenizer_imports():
    """peers.py loads mlx-lm's model files only: no transformers (a GPU machine has mlx-lm's wheel alone)."""
    pytest.importorskip("mlx_lm")
    code = ("import sys; sys.path.insert(0, 'benchmarks'); import peers; peers.mlx_lm_module('models.qwen3_moe'); "
            "peers.mlx_lm_module('models.cache'); print('transformers' in sys.modules)")
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=300, cwd=ROOT)
    assert out.returncode == 0, out.stderr[-2000:]
    assert out.stdout.strip().splitlines()[-1] == "False"


@pytest.mark.slow
def test_peers_in_processes_reports_medians_of_its_runs():
    """--processes 2: strata in two fresh processes; each row's median is the median of the two
    runs' times, and the long context over 8 is given per process."""
    import statistics

    out = subprocess.run([sys.executable, str(ROOT / "benchmarks" / "peers.py"), "--small", "--lengths", "16,32",
                          "--only", "strata", "--rows", "decode", "--processes", "2"],
                         capture_output=True, text=True, timeout=600, cwd=ROOT)
    assert out.returncode == 0, out.stdout[-2000:] + out.stderr[-2000:]
    res = json.loads([l for l in out.stdout.splitlines() if l.startswith("JSON ")][-1][5:])
    runs = res["times_s"]["strata"]
    assert res["processes"] == 2 and len(runs) == 2
    for row in ("decode at 8", "decode at 32"):
        assert res["median_s"]["strata"][row] == statistics.median([r[row] for r in runs]) > 0
    assert res["long_over_8"] == [r["decode at 32"] / r["decode at 8"] for r in runs]
    assert res["ratios"] == {k: None for k in res["median_s"]["strata"]}  # no mlx-lm side asked for
    assert res["all_at_least_2x"] is None


def test_the_2x_verdict_needs_every_ratio():
    sys.path.insert(0, str(ROOT / "benchmarks"))
    import peers

    assert peers.at_least_2x({"decode at 8": 2.5, "prompt 512": 2.0}) is True
    assert peers.at_least_2x({"decode at 8": 2.5, "prompt 512": 1.9}) is False
    assert peers.at_least_2x({"decode at 8": 2.5, "prompt 512": None}) is None
    assert peers.at_least_2x({}) is None


def test_peers_refuses_fewer_than_one_process():
    out = subprocess.run([sys.executable, str(ROOT / "benchmarks" / "peers.py"), "--processes", "0"],
                         capture_output=True, text=True, timeout=300, cwd=ROOT)
    assert out.returncode == 2 and "--processes: at least 1, got 0" in out.stderr
