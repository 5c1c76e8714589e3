"""benchmarks/jit_probe.py runs on MLX's CPU build at a small shape and reports every part."""

from __future__ import annotations

import json
import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "benchmarks"))

import jit_probe  # noqa: E402
import pytest  # noqa: E402

from strata.mlx_backend.kernels import emulate, moe_decode  # noqa: E402


def test_probe_reports_each_part(capsys, monkeypatch):
    monkeypatch.setattr(jit_probe.grouped, "GEMM", jit_probe.grouped.GEMM)  # the probe may set them
    monkeypatch.setattr(jit_probe.grouped, "BUCKET_CAP", jit_probe.grouped.BUCKET_CAP)
    monkeypatch.setattr(jit_probe.prompt_attention, "BUCKET_POSITIONS", jit_probe.prompt_attention.BUCKET_POSITIONS)
    jit_probe.main(["--small", "--layers", "2", "--lengths", "32,40", "--one-process", "--no-bucket"])
    out = capsys.readouterr().out
    line = next(ln for ln in out.splitlines() if ln.startswith("JSON "))
    res = json.loads(line[5:])
    first = res["first_process"]
    assert res["second_process"] is None and first["bucket_cap"] is False and first["bucket_positions"] is False
    assert first["decode"]["first_s"] > 0 and first["decode"]["second_s"] > 0
    assert set(first["prompt"]) == {"32", "40"}
    assert all(v["first_s"] > 0 and v["second_s"] > 0 for v in first["prompt"].values())
    assert [r["layer"] for r in first["per_layer"]] == [0, 1] and first["layers_at"] == 40
    assert "prompt 40" in out and "per layer at 40 tokens" in out


@pytest.mark.slow  # ~30 s: the emulated prompt
@pytest.mark.skipif(not emulate.available(), reason="no C++ compiler")
def test_probe_counts_first_launched_kernels(capsys):
    """On the emulated path the decode step launches custom kernels first (each an NVRTC compile
    on CUDA); a prompt afterwards counts only the specialisations the decode did not launch (its
    own: the prompt path's row kernels and grouped GEMMs)."""
    jit_probe._SEEN.clear()
    jit_probe.main(["--small", "--layers", "1", "--lengths", "32", "--one-process", "--path", "emulated"])
    res = json.loads(next(ln for ln in capsys.readouterr().out.splitlines() if ln.startswith("JSON "))[5:])
    first = res["first_process"]
    assert first["path"] == "emulated" and first["one_compile_s"] is None
    # embedding, QKV + attention + router (one chained launch), gate/up, down (or gate/up + down
    # as one: moe_decode.CHAIN_EXPERTS), head
    assert first["decode"]["new_kernels"] >= 5 - moe_decode.CHAIN_EXPERTS
    assert first["prompt"]["32"]["new_kernels"] >= 1
