"""benchmarks/kernels.py --ncu chains (_decode_kernels.ncu_chain_forms) on the emulated kernels: every
form of chained launches decodes the same token as the form with none, within the FORWARD budget."""

from __future__ import annotations

import sys
from pathlib import Path

import pytest

sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "benchmarks"))

import _decode_kernels  # noqa: E402

from strata.mlx_backend.kernels import emulate, moe_decode  # noqa: E402
from strata.mlx_backend.kernels.launch import LAUNCHES, KernelPath, using_path  # noqa: E402


@pytest.mark.skipif(not emulate.available(), reason="no C++ compiler for the emulator")
def test_every_chain_form_decodes_the_same_token(capsys):
    before = LAUNCHES["strata_chain_dense_gemv_attend_project_sum_router"]
    experts_before = LAUNCHES["strata_chain_moe_gateup_moe_down_chained"]
    groups_before = LAUNCHES["strata_chain_qkv_groups_attend_project_sum_router"]
    deferred_before = LAUNCHES["strata_chain_moe_down_chained_qkv_groups_attend_project_sum_router"]
    ranked_before = LAUNCHES["strata_chain_qkv_groups_attend_project_sum_router_route_rank"]
    ranked_deferred_before = LAUNCHES["strata_chain_moe_down_chained_qkv_groups_attend_project_sum_router_route_rank"]
    with using_path(KernelPath.EMULATED):
        errs = _decode_kernels.ncu_chain_forms(small=True, layers=2)
    assert set(errs) == {label for label, _ in _decode_kernels.CHAIN_FORMS}
    assert all(e <= 1e-4 for e in errs.values()), errs  # FORWARD's budget
    out = capsys.readouterr().out
    assert out.count("the same argmax True") == len(errs)
    # the QKV GEMV walked by KV groups (the default), two passes of two layers: where a layer's down
    # step is deferred (those two forms) the first layer's launch is the three phases and the
    # second's leads with the down step; without deferral (the default, the walk's 4-group
    # prefetch, the experts chained, the 10-unit router) both are the three phases; the plain chain
    # and its 16-group prefetch; the experts' chain in the forms that switch it on
    assert LAUNCHES["strata_chain_qkv_groups_attend_project_sum_router"] - groups_before == (4 * 2 + 2 * 1) * 2
    assert LAUNCHES["strata_chain_moe_down_chained_qkv_groups_attend_project_sum_router"] - deferred_before == 2 * 2
    # the top k ranked as the last phase: both layers' launches in that form, the first layer's
    # (the second's leads with the down step) where the down step is deferred too
    assert LAUNCHES["strata_chain_qkv_groups_attend_project_sum_router_route_rank"] - ranked_before == (2 + 1) * 2
    assert (LAUNCHES["strata_chain_moe_down_chained_qkv_groups_attend_project_sum_router_route_rank"]
            - ranked_deferred_before == 1 * 2)
    assert LAUNCHES["strata_chain_dense_gemv_attend_project_sum_router"] - before == 2 * 2 * 2
    experts = sum(bool(dict(((m, k), v) for m, k, v in sw).get((moe_decode, "CHAIN_EXPERTS"), moe_decode.CHAIN_EXPERTS))
                  for _, sw in _decode_kernels.CHAIN_FORMS)
    assert experts >= 1
    assert LAUNCHES["strata_chain_moe_gateup_moe_down_chained"] - experts_before == experts * 2 * 2

