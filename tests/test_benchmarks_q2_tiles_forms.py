"""The tile kernel's bodies in the benchmarks: benchmarks/q2_tiles_forms.py and prompt_probe.py
--tile-forms run on the emulated kernel path at a small shape, every body with the first's bits."""

from __future__ import annotations

import json
import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "benchmarks"))

import prompt_probe  # noqa: E402
import pytest  # noqa: E402
import q2_tiles_forms  # noqa: E402

from strata.mlx_backend.kernels import emulate  # noqa: E402
from strata.mlx_backend.kernels import q2_tiles as qt  # noqa: E402

pytestmark = pytest.mark.skipif(not emulate.available(), reason="no C++ compiler")


def _json(out: str) -> dict:
    return json.loads(next(ln for ln in out.splitlines() if ln.startswith("JSON "))[5:])


def test_forms_bench_reports_every_body_with_the_first_bits(capsys):
    q2_tiles_forms.main(["--small", "--path", "emulated", "--tokens", "16", "--repeat", "1", "--columns", "128"])
    res = _json(capsys.readouterr().out)
    assert len(res["rows"]) == 2 * len(qt.TileForm)
    for key, row in res["rows"].items():
        assert "error" not in row and row["ms"] > 0, key
        assert row["same_bits_as_first"] is (None if row["form"] == qt.TileForm.ROWS.value else True), key
    assert qt.FORM is None  # the bench leaves the default as it was


def test_probe_times_each_tile_body(capsys, monkeypatch):
    g = prompt_probe.grouped
    monkeypatch.setattr(g, "GEMM", g.GEMM)  # the probe sets them
    monkeypatch.setattr(g, "GROUPED_MIN_PAIRS", g.GROUPED_MIN_PAIRS)
    monkeypatch.setattr(qt, "FORM", qt.FORM)
    prompt_probe.main(["--small", "--lengths", "8", "--repeat", "1", "--path", "emulated", "--forms", "q2tiles",
                       "--tile-forms", "best,rows", "--crossing", "8", "--layer-at", "1", "--budget-s", "600"])
    res = _json(capsys.readouterr().out)
    assert set(res["forms"]) == {"q2tiles", "q2tiles:rows"}
    rows = res["forms"]["q2tiles:rows"]["whole"]["8"]
    assert rows["rel_l2_vs_first_form"] == 0.0 and rows["same_argmax"]
    assert "experts (q2tiles:rows): gate|up kernel" in res["layer_steps_ms"]
