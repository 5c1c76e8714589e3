"""benchmarks/chain_timeline.py on the emulated kernels at the smoke test's shape: every phase of
the decode chain reported, its blocks in phase order (the emulator runs them one after another,
its clock counting stamps), one JSON line."""

from __future__ import annotations

import json
import sys
from pathlib import Path

import pytest

sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "benchmarks"))

import chain_timeline  # noqa: E402

from strata.mlx_backend.kernels import emulate  # noqa: E402


@pytest.mark.skipif(not emulate.available(), reason="no C++ compiler for the emulator")
def test_the_timeline_reports_each_phase_in_order(capsys, monkeypatch):
    monkeypatch.setattr(sys, "argv", ["chain_timeline.py", "--small", "--layers", "3", "--contexts", "8", "--marks"])
    assert chain_timeline.main() == 0
    out = capsys.readouterr().out
    res = json.loads(out.split("JSON ", 1)[1])
    run = res["runs"]["default@8"]
    assert run["launches"] == 3 and run["same_bits_as_first_form"]
    (kind, chain), = run["kinds"].items()
    assert kind == "qkv_groups + attend_project_sum + router" and chain["launches"] == 3
    names = [p["phase"] for p in chain["phases"]]
    assert names == ["strata_qkv_groups", "strata_attend_project_sum", "strata_router"]
    for a, b in zip(chain["phases"], chain["phases"][1:]):
        assert b["waited_median"] > a["ended_median"]  # a phase's wait is met after the one before ended
    assert all(p["blocks"] > 0 for p in chain["phases"])
    marks = dict(chain["phases"][1]["marks"])  # the attention's, after its wait, in the body's order
    assert [k for k, _ in chain["phases"][1]["marks"]] == ["attention made", "W_o's rows summed"]
    assert 0 < marks["attention made"] <= marks["W_o's rows summed"]


@pytest.mark.skipif(not emulate.available(), reason="no C++ compiler for the emulator")
def test_whole_layers_stamp_the_expert_launches_and_the_gaps(capsys, monkeypatch):
    monkeypatch.setattr(sys, "argv", ["chain_timeline.py", "--small", "--layers", "2", "--contexts", "8", "--layer",
                                      "--marks", "--forms", "default,unranked"])
    assert chain_timeline.main() == 0
    runs = json.loads(capsys.readouterr().out.split("JSON ", 1)[1])["runs"]
    run = runs["default@8"]
    assert run["launches"] == 6  # a chain, gate/up and down a layer
    assert set(run["kinds"]) == {"qkv_groups + attend_project_sum + router", "moe_gateup", "moe_down_warps"}
    assert set(run["gaps_us"]) == {"qkv_groups + attend_project_sum + router -> moe_gateup",
                                   "moe_gateup -> moe_down_warps",
                                   "moe_down_warps -> qkv_groups + attend_project_sum + router"}
    gateup = run["kinds"]["moe_gateup"]["phases"][0]["marks"]
    assert [k for k, _ in gateup] == ["z staged", "the warps' sorts written", "the candidates counted",
                                      "ranked (the slot known)", "gate/up codes asked", "x staged"]
    assert [v for _, v in gateup] == sorted(v for _, v in gateup)
    # no ranking (a diagnostic form): the sorts' and the count's marks are not passed, and the
    # others keep their own labels
    unranked = runs["unranked@8"]["kinds"]["moe_gateup"]["phases"][0]["marks"]
    assert [k for k, _ in unranked] == ["z staged", "ranked (the slot known)", "gate/up codes asked", "x staged"]


def test_the_timeline_refuses_one_layer(capsys, monkeypatch):
    monkeypatch.setattr(sys, "argv", ["chain_timeline.py", "--small", "--layers", "1"])
    with pytest.raises(SystemExit):
        chain_timeline.main()
    assert "--layers must be at least 2" in capsys.readouterr().err
