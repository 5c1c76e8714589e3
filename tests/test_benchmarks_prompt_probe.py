"""benchmarks/prompt_probe.py runs on the emulated kernel path at a small shape and reports every part."""

from __future__ import annotations

import json
import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "benchmarks"))

import prompt_probe  # noqa: E402
import pytest  # noqa: E402

from strata.mlx_backend.kernels import emulate  # noqa: E402


@pytest.mark.skipif(not emulate.available(), reason="no C++ compiler")
def test_probe_reports_each_part(capsys, monkeypatch):
    g = prompt_probe.grouped
    monkeypatch.setattr(g, "GEMM", g.GEMM)  # the probe sets them
    monkeypatch.setattr(g, "GROUPED_MIN_PAIRS", g.GROUPED_MIN_PAIRS)
    prompt_probe.main(["--small", "--lengths", "8", "--repeat", "1", "--path", "emulated", "--crossing", "8",
                       "--layer-at", "1", "--budget-s", "600"])
    out = capsys.readouterr().out
    res = json.loads(next(ln for ln in out.splitlines() if ln.startswith("JSON "))[5:])
    tiles, padded = res["forms"]["q2tiles"], res["forms"]["padded"]
    assert set(tiles["whole"]) == set(padded["whole"]) == {"8"}
    assert all(w["s"] > 0 and w["first_s"] > 0 for w in tiles["whole"].values())
    assert all(w["rel_l2_vs_first_form"] < 1e-4 and w["same_argmax"] for w in padded["whole"].values())
    assert len(tiles["synced"]["layer_ms"]) == 4 and len(tiles["synced"]["routing"]) == 4
    steps = res["layer_steps_ms"]
    assert "experts (q2tiles): gate|up kernel" in steps and "experts (padded): dequantize E experts" in steps
    assert set(res["crossing_ms"]["8"]) == {"fused", "q2tiles", "padded"}
    assert res["q2tiles_rounded_once"]["8"]["s"] > 0
    assert prompt_probe.lowp.SPLIT and prompt_probe.prompt_mod.grouped_experts is prompt_probe.grouped_experts


def test_variants_set_the_flags():
    """--variants: `all` turns every FLAGS constant on, `none` every one off, `-x` all but x; an
    unknown name stops the probe before it builds a model."""
    flags = prompt_probe.FLAGS
    saved = {k: getattr(m, c) for k, (m, c) in {**flags, **prompt_probe.OPT_IN}.items()}
    try:
        prompt_probe.set_variant("none")
        assert not any(getattr(m, c) for m, c in flags.values())
        prompt_probe.set_variant("-sort")
        assert {k for k, (m, c) in flags.items() if not getattr(m, c)} == {"sort"}
        prompt_probe.set_variant("+qkv1")
        assert all(getattr(m, c) for m, c in flags.values()) and prompt_probe.prompt_rows.QKV_ONE_TERM
        prompt_probe.set_variant("all")
        assert all(getattr(m, c) for m, c in flags.values()) and not prompt_probe.prompt_rows.QKV_ONE_TERM
        with pytest.raises(SystemExit, match="variant"):
            prompt_probe.set_variant("-nothing")
    finally:
        for k, (m, c) in {**flags, **prompt_probe.OPT_IN}.items():
            setattr(m, c, saved[k])
