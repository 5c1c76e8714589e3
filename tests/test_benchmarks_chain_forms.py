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
    with using_path(KernelPath.EMULATED):
        errs = _decode_kernels.ncu_chain_forms(small=True, layers=2)
    assert set(errs) == {label for label, _ in _decode_kernels.CHAIN_FORMS}
    assert all(e <= 1e-4 for e in errs.values()), errs  # FORWARD's budget
    out = capsys.readouterr().out
    assert out.count("the same argmax True") == len(errs)
    # the default, the experts chained too, the 10-unit router and the 16-group prefetch forms, two
    # passes, two layers each; the experts' chain in the forms that switch it on (or keep its default on)
    assert LAUNCHES["strata_chain_dense_gemv_attend_project_sum_router"] - before == 4 * 2 * 2
    # the two forms with the QKV GEMV walked by KV groups
    assert LAUNCHES["strata_chain_qkv_groups_attend_project_sum_router"] - groups_before == 2 * 2 * 2
    experts = sum(bool(dict(((m, k), v) for m, k, v in sw).get((moe_decode, "CHAIN_EXPERTS"), moe_decode.CHAIN_EXPERTS))
                  for _, sw in _decode_kernels.CHAIN_FORMS)
    assert experts >= 1
    assert LAUNCHES["strata_chain_moe_gateup_moe_down_chained"] - experts_before == experts * 2 * 2

