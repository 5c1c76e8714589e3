"""Reference routing: the model's rule, MoCE and its variants (design §3)."""

from __future__ import annotations

import dataclasses

import numpy as np
import pytest
from hypothesis import given
from hypothesis import strategies as st
from hypothesis.extra import numpy as hnp

from strata.errors import ConfigError
from strata.model_config import RoutingOrder
from strata.reference.routing import (
    LOGIT_RANGE_DECAY,
    STOCK_BONUS,
    STOCK_J,
    BonusScale,
    LogitRange,
    MoCEPolicy,
    RouterRule,
    combine_weights,
    route,
    route_batch,
    router_logits,
    update_logit_range,
)
from tests.strategies import (
    MAX_ROUTING_EXPERTS,
    logit_values,
    logit_ranges,
    moce_policies,
    routing_orders,
    routing_problems,
)

F32_UNIT_ROUNDOFF = 2.0**-24
from tests.budgets import HAND_WEIGHT_ATOL, WEIGHT_RTOL  # noqa: E402

QWEN = dict(order=RoutingOrder.SOFTMAX_TOPK, norm_topk_prob=True)
QWEN_UNNORM = dict(order=RoutingOrder.SOFTMAX_TOPK, norm_topk_prob=False)
MIXTRAL = dict(order=RoutingOrder.TOPK_SOFTMAX, norm_topk_prob=False)


# ---------------------------------------------------------------- independent definitions


def _by_z(z: np.ndarray) -> list[int]:
    return sorted(range(z.size), key=lambda e: (-float(z[e]), e))


def expected_experts(z: np.ndarray, resident: np.ndarray, k: int, j: int, bonus: float) -> list[int]:
    """design §3 written as sorts on tuple keys: top-J by z, then the rest by z' (ties: z, index)."""
    order = _by_z(z)
    j = min(j, k)
    b = np.float32(bonus)
    z_biased = {e: float(z[e] + b) if resident[e] else float(z[e]) for e in order[j:]}
    rest = sorted(order[j:], key=lambda e: (-z_biased[e], -float(z[e]), e))
    return order[:j] + rest[: k - j]


def expected_weights(z: np.ndarray, experts, rule: RouterRule) -> np.ndarray:
    """The model's rule on a selected set, in float64."""
    z64 = z.astype(np.float64)
    sel = np.asarray(experts, dtype=np.int64)
    if rule.order is RoutingOrder.SOFTMAX_TOPK:
        p = np.exp(z64 - z64.max())
        w = (p / p.sum())[sel]
        return w / w.sum() if rule.norm_topk_prob else w
    e = np.exp(z64[sel] - z64[sel].max())
    return e / e.sum()


def assert_weights_close(actual: np.ndarray, expected: np.ndarray) -> None:
    assert actual.dtype == np.float32 and actual.shape == expected.shape
    np.testing.assert_allclose(actual, expected, rtol=WEIGHT_RTOL, atol=0)


def same_bits(a: np.ndarray, b: np.ndarray) -> bool:
    return a.dtype == b.dtype and a.shape == b.shape and a.tobytes() == b.tobytes()


def n_protected(policy: MoCEPolicy | None, k: int, z: np.ndarray | None = None) -> int:
    """The protected count written out directly: min(J, k); under margin gating, the top-1 plus
    each rank 1..J-1 whose lead over the z-rank-J expert is >= margin."""
    if policy is None:
        return 0
    j = min(policy.protect_top_j, k)
    if policy.margin is None or j <= 1 or j >= len(z):
        return j
    zs = np.sort(z)[::-1]
    return 1 + sum(1 for i in range(1, j) if zs[i] - zs[j] >= np.float32(policy.margin))


def no_drop(policy: MoCEPolicy) -> MoCEPolicy:
    return dataclasses.replace(policy, drop_tail_weight=0.0)


# ---------------------------------------------------------------- the model's own rule


@given(problem=routing_problems(), order=routing_orders, norm=st.booleans())
def test_plain_rule_is_top_k_by_z_with_the_models_weights(problem, order, norm):
    z, _, k = problem
    rule = RouterRule(k, order, norm)
    sel = route(z, rule)
    assert sel.experts.dtype == np.int64 and sel.experts.tolist() == _by_z(z)[:k]
    assert_weights_close(sel.weights, expected_weights(z, sel.experts, rule))
    assert not sel.protected.any() and not sel.resident.any()
    assert sel.ranks.tolist() == list(range(k)) and sel.dropped.size == 0
    assert same_bits(sel.logits, z)


@given(problem=routing_problems(), norm=st.booleans())
def test_qwen_and_mixtral_select_alike_and_weigh_as_defined(problem, norm):
    z, _, k = problem
    qwen, mixtral = route(z, RouterRule(k, RoutingOrder.SOFTMAX_TOPK, norm)), route(z, RouterRule(k, **MIXTRAL))
    assert qwen.experts.tolist() == mixtral.experts.tolist()
    np.testing.assert_allclose(mixtral.weights.sum(), 1.0, rtol=WEIGHT_RTOL)
    if norm:  # softmax-all then renormalize is softmax over the selected set
        np.testing.assert_allclose(qwen.weights, mixtral.weights, rtol=WEIGHT_RTOL, atol=0)
    else:
        assert qwen.weights.sum() <= 1.0 + WEIGHT_RTOL


def test_qwen_vs_mixtral_hand_example():
    z = np.array([2.0, 1.0, 0.0, -1.0], np.float32)
    # exp([2, 1, 0, -1]) = [7.389056, 2.718282, 1, 0.367879], sum 11.475217
    expected = {
        "qwen": [0.731059, 0.268941],
        "qwen_unnorm": [0.643914, 0.236883],
        "mixtral": [0.731059, 0.268941],
    }
    for name, kw in (("qwen", QWEN), ("qwen_unnorm", QWEN_UNNORM), ("mixtral", MIXTRAL)):
        sel = route(z, RouterRule(k=2, **kw))
        assert sel.experts.tolist() == [0, 1]
        np.testing.assert_allclose(sel.weights, expected[name], atol=HAND_WEIGHT_ATOL, rtol=0)


def test_ties_go_to_the_lower_expert_index():
    z = np.array([1.0, 3.0, 1.0, 3.0, 1.0], np.float32)
    for kw in (QWEN, MIXTRAL):
        assert route(z, RouterRule(k=3, **kw)).experts.tolist() == [1, 3, 0]
    # underflowed probabilities do not tie: the rank follows z, not the rounded softmax
    z = np.array([0.0, -200.0, -150.0], np.float32)
    assert route(z, RouterRule(k=3, **QWEN_UNNORM)).experts.tolist() == [0, 2, 1]


# ---------------------------------------------------------------- MoCE properties


@given(problem=routing_problems(), order=routing_orders, norm=st.booleans(), policy=moce_policies(drop_tail=False),
       logit_range=logit_ranges)
def test_zero_bonus_is_the_plain_rule_bit_for_bit(problem, order, norm, policy, logit_range):
    z, resident, k = problem
    rule = RouterRule(k, order, norm)
    plain = route(z, rule)
    for off in (MoCEPolicy.off(), dataclasses.replace(policy, bonus=0.0)):
        sel = route(z, rule, off, resident, logit_range)
        assert sel.experts.tolist() == plain.experts.tolist()
        assert same_bits(sel.weights, plain.weights)
        assert sel.dropped.size == 0


@given(problem=routing_problems(), order=routing_orders, policy=moce_policies(drop_tail=False),
       logit_range=logit_ranges)
def test_selection_is_top_j_by_z_then_top_by_biased_z(problem, order, policy, logit_range):
    z, resident, k = problem
    sel = route(z, RouterRule(k, order), policy, resident, logit_range)
    bonus = policy.effective_bonus(logit_range)
    assert sel.experts.tolist() == expected_experts(z, resident, k, n_protected(policy, k, z), bonus)


@given(problem=routing_problems(), order=routing_orders, policy=moce_policies(), logit_range=logit_ranges)
def test_top_j_by_z_always_selected_first(problem, order, policy, logit_range):
    z, resident, k = problem
    sel = route(z, RouterRule(k, order), policy, resident, logit_range)
    j = n_protected(policy, k, z)
    assert sel.experts[:j].tolist() == _by_z(z)[:j]
    if policy.margin is None:
        assert j == min(policy.protect_top_j, k)
    assert sel.protected.tolist() == [r < j for r in sel.ranks]
    # structure: k experts in all, each once, ranks increasing, flags aligned
    assert sel.experts.size + sel.dropped.size == k
    assert len(set(sel.experts.tolist()) | set(sel.dropped.tolist())) == k
    assert np.all(np.diff(sel.ranks) > 0)
    assert sel.resident.tolist() == resident[sel.experts].tolist()


@given(problem=routing_problems(), norm=st.booleans(), order=routing_orders, policy=moce_policies(),
       logit_range=logit_ranges)
def test_weights_depend_only_on_the_selected_set(problem, norm, order, policy, logit_range):
    z, resident, k = problem
    rule = RouterRule(k, order, norm)
    sel = route(z, rule, policy, resident, logit_range)
    full = np.concatenate([sel.experts, sel.dropped])  # the selected set before drop-tail
    weights = np.concatenate([sel.weights, sel.dropped_weights])
    # the rule evaluated directly on that set, independently and through the public function
    assert_weights_close(weights, expected_weights(z, full, rule))
    assert same_bits(weights, combine_weights(z, full, rule))
    # ... and the rank order a policy produced does not change a bit of any weight
    perm = np.argsort(full)[::-1]
    assert same_bits(combine_weights(z, full[perm], rule), weights[perm])


@given(problem=routing_problems(), order=routing_orders, policy=moce_policies(),
       bonuses=st.lists(st.floats(0.0, 4.0), min_size=2, max_size=2), logit_range=logit_ranges)
def test_raising_the_bonus_never_selects_fewer_residents(problem, order, policy, bonuses, logit_range):
    z, resident, k = problem
    rule = RouterRule(k, order)
    low, high = sorted(bonuses)
    n_res = [int(route(z, rule, dataclasses.replace(policy, bonus=b), resident, logit_range).resident.sum())
             for b in (low, high)]
    assert n_res[0] <= n_res[1]


@given(problem=routing_problems(), policy=moce_policies(drop_tail=False), logit_range=logit_ranges)
def test_range_form_is_absolute_form_with_the_scaled_bonus(problem, policy, logit_range):
    z, resident, k = problem
    rule = RouterRule(k, RoutingOrder.SOFTMAX_TOPK)
    ranged = dataclasses.replace(policy, bonus_scale=BonusScale.RANGE, margin=None)
    absolute = dataclasses.replace(ranged, bonus_scale=BonusScale.ABSOLUTE, bonus=policy.bonus * logit_range)
    assert route(z, rule, ranged, resident, logit_range).experts.tolist() == \
        route(z, rule, absolute, resident).experts.tolist()


@given(problem=routing_problems(), policy=moce_policies(drop_tail=False), logit_range=logit_ranges)
def test_margin_gating_is_plain_moce_with_fewer_protected(problem, policy, logit_range):
    """Margin gating only shrinks the protected prefix: it equals ungated MoCE with J set to the
    gated count, which is at least 1 (when J >= 1) and at most J."""
    z, resident, k = problem
    rule = RouterRule(k, RoutingOrder.TOPK_SOFTMAX)
    sel = route(z, rule, policy, resident, logit_range)
    j = n_protected(policy, k, z)
    assert min(1, policy.protect_top_j, k) <= j <= min(policy.protect_top_j, k)
    ungated = dataclasses.replace(policy, margin=None, protect_top_j=j)
    assert sel.experts.tolist() == route(z, rule, ungated, resident, logit_range).experts.tolist()


@given(problem=routing_problems(), order=routing_orders, policy=moce_policies(), logit_range=logit_ranges)
def test_drop_tail_removes_only_small_tail_misses_and_keeps_weights(problem, order, policy, logit_range):
    z, resident, k = problem
    rule = RouterRule(k, order)
    sel = route(z, rule, policy, resident, logit_range)
    whole = route(z, rule, no_drop(policy), resident, logit_range)
    keep = np.isin(whole.experts, sel.experts)
    assert same_bits(whole.experts[keep], sel.experts) and same_bits(whole.weights[keep], sel.weights)
    assert same_bits(whole.experts[~keep], sel.dropped) and same_bits(whole.weights[~keep], sel.dropped_weights)
    j = n_protected(policy, k, z)
    droppable = (~whole.resident) & (whole.ranks >= max(j, policy.drop_tail_min_rank)) & (
        whole.weights < np.float32(policy.drop_tail_weight))
    assert droppable.tolist() == (~keep).tolist()


@given(problem=routing_problems(max_experts=12), order=routing_orders, policy=moce_policies(),
       n_tokens=st.integers(1, 4), data=st.data())
def test_route_batch_is_route_per_token(problem, order, policy, n_tokens, data):
    _, resident, k = problem
    z = data.draw(hnp.arrays(np.float32, (n_tokens, resident.size), elements=logit_values))
    rule = RouterRule(k, order)
    batch = route_batch(z, rule, policy, resident, 1.0)
    for t, sel in enumerate(batch):
        one = route(z[t], rule, policy, resident, 1.0)
        assert same_bits(sel.experts, one.experts) and same_bits(sel.weights, one.weights)


# ---------------------------------------------------------------- hand-computed variants

# E = 6, k = 4; experts 4 and 5 are resident. Plain top-4 by z: [0, 1, 2, 3].
HAND_Z = np.array([4.0, 3.0, 2.8, 2.6, 2.2, 2.0], np.float32)
HAND_RESIDENT = np.array([False, False, False, False, True, True])


@pytest.mark.parametrize("j, expected", [
    # J=3: rest {3, 4, 5}, z' = 2.6, 3.05, 2.85 -> 4
    (3, [0, 1, 2, 4]),
    # J=2: rest {2..5}, z' = 2.8, 2.6, 3.05, 2.85 -> 4, 5
    (2, [0, 1, 4, 5]),
    # J=1: rest {1..5}, z' = 3.0, 2.8, 2.6, 3.05, 2.85 -> 4, 1, 5 (rank order by z')
    (1, [0, 4, 1, 5]),
    (0, [0, 4, 1, 5]),
])
def test_protect_top_j_hand_examples(j, expected):
    sel = route(HAND_Z, RouterRule(k=4, **QWEN), MoCEPolicy(protect_top_j=j, bonus=STOCK_BONUS), HAND_RESIDENT)
    assert sel.experts.tolist() == expected
    assert sel.protected.tolist() == [r < j for r in range(4)]
    assert_weights_close(sel.weights, expected_weights(HAND_Z, expected, RouterRule(k=4, **QWEN)))


def test_range_form_hand_example():
    rule = RouterRule(k=4, **QWEN)
    # λ = 0.25 absolute: z' of 4, 5 = 2.45, 2.25: nothing overtakes 3 (2.6)
    absolute = MoCEPolicy(protect_top_j=1, bonus=0.25)
    assert route(HAND_Z, rule, absolute, HAND_RESIDENT).experts.tolist() == [0, 1, 2, 3]
    # λ = 0.25 of a range 2.0: bonus 0.5, z' of 4 = 2.7 overtakes 3 (2.6), not 2 (2.8)
    ranged = MoCEPolicy(protect_top_j=1, bonus=0.25, bonus_scale=BonusScale.RANGE)
    assert route(HAND_Z, rule, ranged, HAND_RESIDENT, logit_range=2.0).experts.tolist() == [0, 1, 2, 4]


@pytest.mark.parametrize("margin, expected", [
    # J=3: the z-rank-3 candidate is expert 3 (2.6); leads of ranks 1, 2 are 0.4 and 0.2
    (0.5, [0, 4, 1, 5]),  # neither lead reaches 0.5: only the top-1 protected, as J=1
    (0.3, [0, 1, 4, 5]),  # rank 1 keeps protection (0.4), rank 2 loses it: as J=2
    (0.1, [0, 1, 2, 4]),  # both keep it: as J=3 ungated
])
def test_margin_gating_hand_example(margin, expected):
    rule = RouterRule(k=4, **QWEN)
    gated = MoCEPolicy(protect_top_j=3, bonus=STOCK_BONUS, margin=margin)
    assert route(HAND_Z, rule, gated, HAND_RESIDENT).experts.tolist() == expected


def test_drop_tail_hand_example():
    rule = RouterRule(k=4, **QWEN)
    # no bonus: selection [0, 1, 2, 3], weights softmax([4, 3, 2.8, 2.6]) over the four:
    # exp([0, -1, -1.2, -1.4]) = [1, 0.367879, 0.301194, 0.246597], sum 1.915670
    weights = [0.522010, 0.192037, 0.157227, 0.128726]
    nobody = np.zeros(6, bool)
    cases = [  # (J, w, r, resident, kept, dropped)
        (2, 0.16, 2, nobody, [0, 1], [2, 3]),
        (2, 0.16, 3, nobody, [0, 1, 2], [3]),
        (2, 0.16, 2, np.array([False, False, False, True, False, False]), [0, 1, 3], [2]),  # 3 resident
        (3, 0.50, 0, nobody, [0, 1, 2], [3]),  # protected experts are never dropped
        (2, 0.12, 2, nobody, [0, 1, 2, 3], []),  # every tail weight is >= 0.12
    ]
    for j, w, r, resident, kept, dropped in cases:
        policy = MoCEPolicy(protect_top_j=j, bonus=0.0, drop_tail_weight=w, drop_tail_min_rank=r)
        sel = route(HAND_Z, rule, policy, resident)
        assert sel.experts.tolist() == kept and sel.dropped.tolist() == dropped
        assert sel.ranks.tolist() == kept  # here expert id == rank
        # not renormalized: the kept experts keep their weights from the whole selection
        np.testing.assert_allclose(sel.weights, [weights[e] for e in kept], atol=HAND_WEIGHT_ATOL, rtol=0)
        np.testing.assert_allclose(sel.dropped_weights, [weights[e] for e in dropped], atol=HAND_WEIGHT_ATOL, rtol=0)


def test_stock_policy():
    policy = MoCEPolicy()
    assert (policy.protect_top_j, policy.bonus, policy.bonus_scale) == (STOCK_J, STOCK_BONUS, BonusScale.ABSOLUTE)
    assert policy.margin is None and policy.drop_tail_weight == 0.0
    assert (STOCK_J, STOCK_BONUS) == (3, 0.85)


# ---------------------------------------------------------------- logit range, router logits


def test_logit_range_is_an_ema_started_at_the_first_range():
    start = LogitRange()
    one = update_logit_range(start, np.array([0.0, 4.0, 1.0], np.float32))
    assert (one.average, one.count) == (4.0, 1) and (start.average, start.count) == (0.0, 0)
    two = update_logit_range(one, np.array([1.0, 2.0, 1.5], np.float32))
    assert two.count == 2 and two.average == LOGIT_RANGE_DECAY * 4.0 + (1 - LOGIT_RANGE_DECAY) * 1.0
    both = update_logit_range(start, np.array([[0.0, 4.0, 1.0], [1.0, 2.0, 1.5]], np.float32))
    assert both == two


@given(e=st.integers(1, MAX_ROUTING_EXPERTS), d=st.integers(1, 64), t=st.integers(1, 4), seed=st.integers(0, 2**32 - 1))
def test_router_logits(e, d, t, seed):
    rng = np.random.default_rng(seed)
    w, x = rng.standard_normal((e, d)).astype(np.float32), rng.standard_normal((t, d)).astype(np.float32)
    z = router_logits(w, x)
    assert z.dtype == np.float32 and z.shape == (t, e) and router_logits(w, x[0]).shape == (e,)
    # float32 dot products of length d: |error| <= d·u·sum|w||x| (the classical gamma_d bound)
    bound = d * F32_UNIT_ROUNDOFF * (np.abs(x).astype(np.float64) @ np.abs(w).T)
    assert np.all(np.abs(z - x.astype(np.float64) @ w.T.astype(np.float64)) <= bound)


# ---------------------------------------------------------------- errors


@pytest.mark.parametrize("bad", [
    dict(protect_top_j=-1), dict(protect_top_j=1.5), dict(protect_top_j=True),
    dict(bonus=-0.1), dict(bonus=float("nan")), dict(bonus=float("inf")), dict(bonus="0.85"),
    dict(bonus_scale="range"),
    dict(margin=0.0), dict(margin=-1.0), dict(margin=float("nan")),
    dict(drop_tail_weight=-0.01), dict(drop_tail_weight=1.5), dict(drop_tail_weight=float("nan")),
    dict(drop_tail_min_rank=-1), dict(drop_tail_min_rank=2.0),
])
def test_bad_policy_values_raise_config_error(bad):
    with pytest.raises(ConfigError):
        MoCEPolicy(**bad)


@pytest.mark.parametrize("bad", [
    dict(k=0, order=RoutingOrder.SOFTMAX_TOPK), dict(k=2.0, order=RoutingOrder.SOFTMAX_TOPK),
    dict(k=2, order="softmax_topk"), dict(k=2, order=RoutingOrder.SOFTMAX_TOPK, norm_topk_prob=1),
])
def test_bad_rule_values_raise_config_error(bad):
    with pytest.raises(ConfigError):
        RouterRule(**bad)


def test_bad_route_inputs_raise_value_error():
    rule, z = RouterRule(k=2, **QWEN), np.zeros(4, np.float32)
    bad_calls = [
        lambda: route(np.zeros((2, 4), np.float32), rule),
        lambda: route(np.array([0.0, np.nan, 1.0, 2.0], np.float32), rule),
        lambda: route(z[:1], rule),  # top-2 of 1
        lambda: route(z, rule, MoCEPolicy(), np.zeros(3, bool)),
        lambda: route(z, rule, MoCEPolicy(), np.zeros(4, np.int8)),
        lambda: route(z, rule, MoCEPolicy(bonus_scale=BonusScale.RANGE)),  # RANGE needs a range
        lambda: route(z, rule, MoCEPolicy(bonus_scale=BonusScale.RANGE), logit_range=-1.0),
        lambda: route_batch(z, rule),
        lambda: router_logits(np.zeros((4, 3), np.float32), np.zeros(5, np.float32)),
        lambda: update_logit_range(LogitRange(), np.zeros((2, 2, 2), np.float32)),
    ]
    for call in bad_calls:
        with pytest.raises(ValueError):
            call()
