"""MoCE on tier 2 (strata.tier2.moce): for the DeepSeek-style families whose mlx-lm block routes
in a replaceable gate module (deepseek_v3, glm4_moe, glm4_moe_lite), every selection is strata's reference
`route` on that gate's logits with the layer's rule and the cache's residency at that moment;
with nothing resident the rule read from the gate chooses what mlx-lm's own gate chooses; λ = 0
keeps mlx-lm's gate (bit for bit, also after a MoCE engine ran on the same model); the families
that route inline, drop-tail, and a MoCE trace are refused in one line."""

from __future__ import annotations

import numpy as np
import pytest

pytest.importorskip("mlx_lm")

import mlx.core as mx  # noqa: E402

import strata  # noqa: E402
from strata.config import Config  # noqa: E402
from strata.engines import open_engine  # noqa: E402
from strata.errors import ConfigError  # noqa: E402
from strata.reference.routing import route  # noqa: E402
from strata.tier2.engine import arena_plan_for  # noqa: E402
from strata.tier2.moce import MoCEGate, gate_rule  # noqa: E402
from strata.runtime.selector import Selector  # noqa: E402
from tests import tier2_models  # noqa: E402

PROMPT = [5, 17, 99, 200, 3, 45, 77, 12, 250, 31, 8, 140]
MOCE_FAMILIES = ("deepseek_v3_a4g32", "glm4_moe_a3g32", "glm4_moe_lite_a4g32")


@pytest.fixture(scope="module", params=MOCE_FAMILIES)
def made(request, tmp_path_factory):
    d = tier2_models.make_checkpoint(request.param, tmp_path_factory.mktemp("moce") / request.param)
    return d, tier2_models.mlx_lm_schedule_logits(d, PROMPT, [])


def _smallest(model, config):
    return config.replace(arena=f"{arena_plan_for(model, config.replace(arena='1000000slots')).min_slots}slots")


def test_each_selection_is_the_reference_route_with_the_residency_then(made):
    d, _ = made
    with strata.load(d) as model:
        config = _smallest(model, Config(prefetch=2, moce_lambda=5.0, moce_j=1))  # a bonus that decides
        calls = []
        with open_engine(model, config) as engine:
            for g in engine.gates:
                g.observer = lambda m, z, res, sels: calls.append((m, z, res.copy(), sels))
            engine.prefill(PROMPT)
            for t in (7, 99, 3, 250, 31, 8):
                engine.decode(t)
            rules = [gate_rule(g) for g in model.gates]
            assert "lossy: MoCE J1 λ5" in engine.report().policy
    assert {m for m, *_ in calls} == set(range(model.cfg.n_moe_layers))
    favoured = 0
    for m, z, resident, sels in calls:
        assert len(sels) == len(z)
        for zt, sel in zip(z, sels):
            want = route(zt, rules[m], config.moce_policy(), resident)
            assert np.array_equal(sel.experts, want.experts) and np.array_equal(sel.weights, want.weights)
            free = sel.experts[~sel.protected]  # the ranks the bonus decides
            eligible = np.isfinite(rules[m].selection_scores(zt)) & resident
            eligible[sel.experts[sel.protected]] = False
            if eligible.sum() >= len(free):  # enough residents: the bonus fills every such rank with one
                assert resident[free].all()
                favoured += 1
    assert favoured > 0  # the residency was real: some tokens had residents to favour


def test_with_nothing_resident_the_rule_chooses_what_mlx_lms_gate_does(made):
    d, _ = made

    class NothingResident:
        def resident_mask(self, layer):
            return np.zeros(model.cfg.n_experts, bool)

    with strata.load(d) as model:
        x = mx.array(np.random.default_rng(0).normal(size=(1, 9, model.gates[0].weight.shape[1])).astype(np.float32))
        x = x.astype(mx.bfloat16)
        policy = Config(moce_lambda=0.3).moce_policy()
        rules = tuple(gate_rule(g) for g in model.gates)
        selector = Selector.for_rules(rules, policy, tuple(range(len(rules))))
        for m, gate in enumerate(model.gates):
            want_inds, want_w = gate(x)
            inds, w = MoCEGate(gate, m, selector, NothingResident())(x)
            a, b = np.array(want_inds), np.array(inds)
            order_a, order_b = np.argsort(a, axis=-1), np.argsort(b, axis=-1)
            assert np.array_equal(np.take_along_axis(a, order_a, -1), np.take_along_axis(b, order_b, -1))
            np.testing.assert_allclose(np.take_along_axis(np.array(w), order_b, -1),
                                       np.take_along_axis(np.array(want_w), order_a, -1), rtol=1e-6)


def test_lambda_zero_keeps_mlx_lms_gate_bit_for_bit(made):
    d, want = made
    with strata.load(d) as model:
        lossy = _smallest(model, Config(prefetch=2, moce_lambda=0.5))
        with open_engine(model, lossy) as engine:
            engine.prefill(PROMPT)
        with open_engine(model, Config(prefetch=2)) as engine:  # after a MoCE engine on the same model
            assert engine.gates is None
            got = engine.prefill(PROMPT)
            assert all(parent["gate"] is g for (_, parent, _, _), g in zip(model.switches, model.gates))
    assert np.array_equal(got, want[0])


@pytest.mark.parametrize("recipe, setting, says", [
    ("qwen3_moe_a4g32", dict(moce_lambda=0.5), "qwen3_moe routes inside its MoE block"),
    ("deepseek_v3_a4g32", dict(moce_lambda=0.5, moce_drop_tail=0.05), "drop-tail"),
])
def test_what_tier2_cannot_run_is_refused_in_one_line(recipe, setting, says, tmp_path):
    d = tier2_models.make_checkpoint(recipe, tmp_path / recipe)
    with strata.load(d) as model:
        with pytest.raises(ConfigError) as e:
            strata.generate(model, PROMPT, max_tokens=2, config=Config(**setting))
    assert says in str(e.value) and "\n" not in str(e.value)


def test_a_tier2_trace_refuses_moce(made):
    from strata.tools.tier2_trace import record_tier2_trace

    d, _ = made
    with strata.load(d) as model:
        with pytest.raises(ConfigError, match="family's own routing"):
            record_tier2_trace(model, PROMPT, config=Config(moce_lambda=0.5))
