"""benchmarks/decode_context.py's `switched`: a form's module switches set inside, restored after,
on an error too (graph_time.py, host_cost.py and decode_context.py's own runs go through it)."""

from __future__ import annotations

import sys
from pathlib import Path

import pytest

sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "benchmarks"))

import decode_context  # noqa: E402

from strata.mlx_backend.kernels import moe_decode  # noqa: E402


def test_a_forms_switches_hold_inside_and_are_restored_after():
    before = moe_decode.DEFER_DOWN, moe_decode.DEFER_ROWS
    with decode_context.switched("deferred_r16"):
        assert (moe_decode.DEFER_DOWN, moe_decode.DEFER_ROWS) == (True, 16)
    assert (moe_decode.DEFER_DOWN, moe_decode.DEFER_ROWS) == before
    with pytest.raises(RuntimeError), decode_context.switched("deferred_r16"):
        raise RuntimeError("a failed run")
    assert (moe_decode.DEFER_DOWN, moe_decode.DEFER_ROWS) == before
    with decode_context.switched("split"):  # a form with no module switches
        assert (moe_decode.DEFER_DOWN, moe_decode.DEFER_ROWS) == before
