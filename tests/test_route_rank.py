"""A decoded token's top k ranked once (kernels/route_rank.py) and read by the expert launches
(decode_routing.Ranking.GIVEN): the ranking is the reference's order (z descending, ties to the
lower id) in the hard cases, and the expert launches reading it write what they write ranking z
themselves, bit for bit (the two launches, the chained experts, the deferred down step). The
chained form inside the attention's launch is held to the unchained decode in tests/test_phases.py."""

from __future__ import annotations

import mlx.core as mx
import numpy as np
import pytest

from strata.mlx_backend.kernels import decode_routing, moe_decode, route_rank
from strata.mlx_backend.kernels.decode_routing import RankedLogits
from strata.mlx_backend.kernels.launch import KernelPath, using_path
from strata.model_config import RoutingOrder
from test_mlx_moe_decode import _case
from tests.kernel_paths import KERNEL_PATHS, emulated


def _lexsort_top(z: np.ndarray, k: int) -> np.ndarray:
    ids = np.arange(z.shape[1])
    return np.stack([np.lexsort((ids, -row))[:k] for row in z])


@pytest.mark.parametrize("path", KERNEL_PATHS)
@pytest.mark.parametrize("k,n", [(5, 24), (10, 300), (40, 64)], ids=["one-chunk", "many-chunks", "k-past-a-warp"])
def test_the_ranking_is_the_references_order(path, k, n):
    """Exact ties (the lower id first), -inf logits, a tie across the k-th place; 300 logits: more
    chunks of 32 than warps; k = 40: the count loop (the warp sorts hold 32)."""
    rng = np.random.default_rng(k)
    z = rng.standard_normal((3, n)).astype(np.float32)
    z[0, [3, 9, 17]] = z[0].max() + 1.0
    z[1, :] = -np.inf
    z[1, [4, 20, 2, 7, 11, 1]] = [0.5, 0.5, -1.0, 2.0, -1.0, -1.0]
    z[2, np.argsort(-z[2])[k - 1]] = z[2, n - 1] = np.sort(z[2])[::-1][k - 1]  # a tie at the k-th place
    with using_path(path):
        got = np.array(route_rank.rank(mx.array(z), k))
    assert got.dtype == np.int32
    np.testing.assert_array_equal(got, _lexsort_top(z, k))
    assert route_rank.form(k) is (decode_routing.Ranking.LOOP if k > 32 else decode_routing.RANK_FORM)


def test_bad_k_is_refused():
    with pytest.raises(ValueError, match="k=0 of 8"):
        route_rank.rank(mx.zeros((1, 8)), 0)


@pytest.mark.parametrize("path", KERNEL_PATHS)
@pytest.mark.parametrize("order,norm", [(RoutingOrder.SOFTMAX_TOPK, True), (RoutingOrder.TOPK_SOFTMAX, False)])
def test_gateup_reading_the_given_top_k_writes_what_it_writes_ranking_itself(path, order, norm):
    """Emulated at a medium expert, on the GPU at the seed shape's."""
    with using_path(path):
        k, base = 6, 24
        rec, records, x, _, z = _case(path, 5, k, tokens=2)
        z[1, 5] = z[1, 7]
        top = route_rank.rank(mx.array(z), k)
        itself = moe_decode.gateup(records, rec, mx.array(x), mx.array(z), base, k, order, norm)
        given = moe_decode.gateup(records, rec, mx.array(x), mx.array(z), base, k, order, norm, given=top)
        for name, a, b in zip(moe_decode.GateUp._fields, itself, given):
            if name not in ("sout", "sgate"):  # no shared expert: its partials and gate are unwritten on both sides
                assert np.array(a).tobytes() == np.array(b).tobytes(), name
        # it reads the ids it is given (not z): another top k gives those slots
        other = mx.array(np.tile(np.arange(k, dtype=np.int32)[::-1], (2, 1)))
        _, sel, *_ = moe_decode.gateup(records, rec, mx.array(x), mx.array(z), base, k, order, norm, given=other)
        np.testing.assert_array_equal(np.array(sel), base + np.array(other))
        with pytest.raises(ValueError, match="no ranking form"):
            moe_decode.gateup(records, rec, mx.array(x), mx.array(z), base, k, order, norm, given=top,
                              rounds=decode_routing.Ranking.LOOP)


@emulated
@pytest.mark.parametrize("form", ["two-launches", "chained-experts", "deferred-down"])
def test_the_routed_residual_of_ranked_logits_is_the_same_bits(monkeypatch, form):
    """One token: x_mid + the routed experts from RankedLogits against from z, in each form of the
    expert step (the chained and deferred down phases read the given top k too)."""
    monkeypatch.setattr(moe_decode, "CHAIN_EXPERTS", form == "chained-experts")
    monkeypatch.setattr(moe_decode, "DEFER_DOWN", form == "deferred-down")
    with using_path(KernelPath.EMULATED):
        k, base = 8, 0
        rec, records, x, x_mid, z = _case(KernelPath.EMULATED, 9, k, tokens=1, n=64)
        args = (records, rec, mx.array(x_mid), mx.array(x))
        rule = (k, RoutingOrder.SOFTMAX_TOPK, True)
        defer = form == "deferred-down"
        plain = moe_decode.materialized(moe_decode.routed_residual(*args, mx.array(z), base, *rule, defer=defer))
        ranked = RankedLogits(mx.array(z), route_rank.rank(mx.array(z), k))
        out = moe_decode.routed_residual(*args, ranked, base, *rule, defer=defer)
        assert isinstance(out, moe_decode.DeferredDown) is defer
        assert moe_decode.chains_experts(rec, k, 1) is (form == "chained-experts")
        assert np.array(plain).tobytes() == np.array(moe_decode.materialized(out)).tobytes()
