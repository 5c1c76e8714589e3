"""The selector's guess ranking (`top_k_experts`) against its definition, `route` with the rule
top-K (strata.reference.routing), on logits with many ties; and the decode `slots_for` fast path
against the general one."""

import numpy as np
import pytest
from hypothesis import given
from hypothesis import strategies as st

from strata.model_config import RoutingOrder
from strata.cache.types import Use
from strata.reference.routing import RouterRule, Selection, route
from strata.runtime.selector import slots_for
from strata.runtime.selector import top_k_experts
from tests.strategies import routing_orders, routing_problems


@given(routing_problems(), routing_orders)
def test_top_k_experts_is_routes_ranking(problem, order):
    z, _, k = problem
    want = tuple(int(e) for e in route(z, RouterRule(k, order)).experts)
    assert top_k_experts(z, k) == want


@given(st.integers(1, 256), st.integers(1, 16), st.integers(0, 2**32 - 1))
def test_top_k_experts_with_ties_at_the_boundary(n, k, seed):
    rng = np.random.default_rng(seed)
    k = min(k, n)
    z = rng.integers(-2, 3, n).astype(np.float32)  # five values: ties everywhere, -0.0 and 0.0 among them
    z[rng.random(n) < 0.2] *= -1
    assert top_k_experts(z, k) == tuple(int(e) for e in route(z, RouterRule(k, RoutingOrder.SOFTMAX_TOPK)).experts)


def test_top_k_experts_rejects_what_route_rejects():
    assert top_k_experts(np.zeros(4, np.float32), 0) == ()
    with pytest.raises(ValueError):
        top_k_experts(np.array([0.0, np.nan, 1.0], np.float32), 2)
    with pytest.raises(ValueError):
        top_k_experts(np.zeros(3, np.float32), 4)


def _selection(experts, weights) -> Selection:
    e, w = np.asarray(experts, np.int64), np.asarray(weights, np.float32)
    return Selection(e, w, e < 0, e < 0, np.arange(len(e)), e[:0], w[:0], w)


@given(st.lists(st.integers(0, 63), min_size=1, max_size=10, unique=True), st.integers(0, 2**32 - 1))
def test_slots_for_one_token_equals_the_general_path(experts, seed):
    rng = np.random.default_rng(seed)
    weights = rng.random(len(experts)).astype(np.float32)
    used = [e for e in experts if rng.random() < 0.7]  # a pass may hold only some of them
    use = Use(0, tuple(used), tuple(int(s) for s in rng.permutation(100)[: len(used)]))
    sel = _selection(experts, weights)
    slots, w = slots_for([sel], use)
    two = slots_for([sel, sel], use)  # the general path, row by row
    assert slots.dtype == np.int64 and w.dtype == np.float32 and slots.shape == w.shape == (1, len(experts))
    assert np.array_equal(slots[0], two[0][0]) and np.array_equal(w[0], two[1][0])
