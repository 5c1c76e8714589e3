"""Quality in decode order: the decode step is the forward pass bit for bit, KLD is exactly 0 at
λ = 0 (whatever the arena and read-ahead), relMSE is 0 when the selections are equal, and a
policy that changes routing shows up in both."""

from dataclasses import replace

import numpy as np
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from strata.model_config import RoutingOrder
from strata.reference.experts import routed_experts, swiglu_expert
from strata.reference.model import ModelState, forward, plain_select
from strata.reference.routing import BonusScale, MoCEPolicy
from strata.tools.closed_loop import LoopConfig
from strata.tools.quality import (
    DequantizedExperts, _routed, decode_token, fast_params, kld_rows, quality, run_decode,
)
from strata.tools.replay import replay
from strata.tools.trace import record_trace
from tests.models import tiny_params

TOKENS = np.frombuffer(b"the cat sat on the mat, then sat again.", np.uint8).astype(np.int64)[:24]


@pytest.fixture(scope="module")
def params():
    return fast_params(tiny_params(seed=2, n_layers=3, n_experts=16))


@pytest.fixture(scope="module")
def reference(params):
    return run_decode(params, TOKENS)


def min_cap(params, config):
    cfg = params.cfg
    return config.cache_config(cfg.n_layers, cfg.n_experts, cfg.n_experts_per_token).min_capacity


@pytest.mark.parametrize("variant", [{}, dict(routing_order=RoutingOrder.TOPK_SOFTMAX, shared_ffn_size=0,
                                               shared_expert_gated=False)])
def test_decode_token_is_forward_bit_for_bit(variant):
    p = tiny_params(seed=4, **variant)
    s1 = s2 = ModelState.empty(p.cfg)
    select = plain_select(p.cfg)
    for tok in TOKENS[:8]:
        want, s1 = forward(p, s1, np.array([tok]))
        got, s2 = decode_token(p, s2, int(tok), select)
        np.testing.assert_array_equal(got, want[0])


def test_dequantized_experts_are_bit_identical():
    p = tiny_params(seed=1)
    fast = DequantizedExperts(p.experts, max_bytes=1)  # a tiny budget: evicts, still correct
    x = np.random.default_rng(0).standard_normal(p.cfg.hidden_size).astype(np.float32)
    for key in [(0, 0), (1, 5), (0, 0)]:
        np.testing.assert_array_equal(swiglu_expert(fast.expert(*key), x), swiglu_expert(p.experts.expert(*key), x))


def test_routed_sum_is_routed_experts(params):
    from strata.reference.routing import route
    from strata.reference.model import router_rule

    h = np.random.default_rng(1).standard_normal(params.cfg.hidden_size).astype(np.float32)
    z = np.random.default_rng(2).standard_normal(params.cfg.n_experts).astype(np.float32)
    sel = route(z, router_rule(params.cfg))
    want = routed_experts([params.experts.expert(1, int(e)) for e in sel.experts], sel.weights, h)
    np.testing.assert_array_equal(_routed(params, 1, sel, h, {}), want)


@settings(max_examples=12)
@given(j=st.integers(0, 5), extra=st.integers(0, 20), k=st.sampled_from([0, 3, 6]), touch=st.booleans(),
       two=st.booleans(), rng=st.booleans(), q8=st.booleans())
def test_kld_is_exactly_zero_at_lambda_zero(params, reference, j, extra, k, touch, two, rng, q8):
    pol = MoCEPolicy(protect_top_j=j, bonus=0.0, bonus_scale=BonusScale.RANGE if rng else BonusScale.ABSOLUTE)
    config = LoopConfig(capacity=1, prefetch_depth=k, prefetch_touch=touch, prefetch2=two, pred_q8=q8, policy=pol)
    config = replace(config, capacity=min_cap(params, config) + extra)
    q = quality(params, TOKENS, config, reference=reference)
    assert q.kld_mean == q.kld_p99 == q.kld_max == 0.0
    assert q.relmse == 0.0 and q.rel_l2 == 0.0 and q.changed_fraction == 0.0
    assert q.ppl == q.ppl_ref


def test_all_protected_means_equal_selections_and_zero_error(params, reference):
    k = params.cfg.n_experts_per_token
    config = LoopConfig(capacity=30, policy=MoCEPolicy(protect_top_j=k, bonus=5.0))
    q = quality(params, TOKENS, config, reference=reference)
    assert q.changed_fraction == 0.0 and q.relmse == 0.0 and q.kld_max == 0.0


def test_a_strong_bonus_costs_quality_and_saves_misses(params, reference):
    base = LoopConfig(capacity=24, prefetch_depth=0, policy=MoCEPolicy(bonus=0.0))
    strong = replace(base, policy=MoCEPolicy(protect_top_j=0, bonus=50.0))
    q0 = quality(params, TOKENS, base, reference=reference)
    q = quality(params, TOKENS, strong, reference=reference)
    assert q.changed_fraction > 0 and q.relmse > 0 and q.kld_mean > 0 and q.kld_max >= q.kld_p99 >= 0
    assert q.rel_l2 == pytest.approx(np.sqrt(q.relmse))
    assert q.urgent_per_token < q0.urgent_per_token


def test_decode_run_cache_counts_are_the_replays_at_lambda_zero(params):
    """At λ = 0 the live closed loop and the replay of the decode-order trace see the same logits
    and guesses, so the cache machine makes the same decisions."""
    trace = record_trace(params, TOKENS)
    for config in (LoopConfig(capacity=26, policy=None), LoopConfig(capacity=40, prefetch_depth=4, prefetch2=True,
                                                                    policy=MoCEPolicy(bonus=0.0))):
        run = run_decode(params, TOKENS, config=config, warmup=3)
        assert run.stats == replay(trace, config, warmup=3).stats


def test_kld_rows():
    a = np.array([[0.0, 1.0, 2.0], [1.0, 1.0, 1.0]], np.float32)
    assert kld_rows(a, a).tolist() == [0.0, 0.0]
    b = a[:, ::-1].copy()
    kl = kld_rows(a, b)
    assert kl[0] > 0 and kl[1] == 0.0
