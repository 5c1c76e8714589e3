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

ROOT = Path(__file__).resolve().parents[1]


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
    else:
        assert all(v is None for v in res["ratios"].values())


def test_mlx_lm_model_files_load_without_its_tokenizer_imports():
    """peers.py loads mlx-lm's model files only: no transformers (a GPU machine has mlx-lm's wheel alone)."""
    pytest.importorskip("mlx_lm")
    code = ("import sys; sys.path.insert(0, 'benchmarks'); import peers; peers.mlx_lm_module('models.qwen3_moe'); "
            "peers.mlx_lm_module('models.cache'); print('transformers' in sys.modules)")
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=300, cwd=ROOT)
    assert out.returncode == 0, out.stderr[-2000:]
    assert out.stdout.strip().splitlines()[-1] == "False"
