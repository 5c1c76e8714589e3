"""benchmarks/source_bytes.py: a decoded token's kernel sources by kernel, inline and included, with
their launches: the default's 3 launches a layer and 2 a token, and the cuts' fewer launches of
larger sources."""

from __future__ import annotations

import sys
from pathlib import Path

import pytest

sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "benchmarks"))

import source_bytes  # noqa: E402

from strata.mlx_backend.kernels import emulate  # noqa: E402


@pytest.mark.skipif(not emulate.available(), reason="no C++ compiler for the emulator")
def test_a_tokens_sources_and_launches():
    layers = source_bytes.LAYERS
    default = source_bytes.token_bytes("default")
    launches = {name: k for name, (_, _, k) in default.items()}
    folded = " (outputs folded)"  # the launch's unread outputs in one buffer (folded_outputs.py)
    assert launches == {"strata_chain_qkv_groups_attend_project_sum_router" + folded: layers,
                        "strata_moe_gateup" + folded: layers, "strata_moe_down_warps": layers,
                        "strata_dense_gemv": 1, "strata_embed": 1}
    assert all(n > 0 for n, _, _ in default.values())
    # included (the CUDA default): what MLX hashes is its own frame and two include lines, a
    # fraction of each large source
    assert all(inc < n / 4 for n, inc, _ in default.values() if n > 8000)
    cuts = source_bytes.token_bytes("all_cuts")
    assert sum(k for _, _, k in cuts.values()) == sum(launches.values()) - (layers - 1)  # each down but the last deferred
    deferred = cuts["strata_chain_moe_down_chained_qkv_groups_attend_project_sum_router_route_rank" + folded]
    assert deferred[0] > default["strata_chain_qkv_groups_attend_project_sum_router" + folded][0]
    # the deferred down step's gate/up launches are a chain's first phase (unfolded), the last layer's not
    assert cuts["strata_moe_gateup"][2] == layers - 1 and cuts["strata_moe_gateup" + folded][2] == 1
