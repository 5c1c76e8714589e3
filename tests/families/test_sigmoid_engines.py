"""The sigmoid-routed made model ('sigmoid': selection biases, 4 groups of which 2 are eligible,
scaled weights, an ungated shared expert, a dense first layer, partial rotary) through every
engine: numpy streaming (down to the smallest legal arena) bit for bit against the reference at
λ = 0, the MLX engines within the FORWARD budget, and the MLX routing twin exact on the sigmoid
rule under MoCE."""

from __future__ import annotations

import numpy as np
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

import strata
from strata.config import Backend, Config
from strata.formats.quant_types import QuantType
from strata.model_config import RoutingOrder
from strata.numpy_backend.engine import ReferenceEngine
from strata.reference.model import router_rules
from strata.reference.routing import RouterRule, route
from strata.runtime.decode import arena_plan_for
from strata.testing.engines import open_numpy_reference, open_numpy_streaming
from strata.testing.models import make_model
from tests.strategies import moce_policies

pytest.importorskip("gguf")

PROMPT = list(b"def fib(n): return n")
N_DECODE = 8
STOCK0 = Config(moce_lambda=0.0, arena="")


@pytest.fixture(scope="module", params=["sigmoid", "mla"])
def model(tmp_path_factory, request):
    made = make_model(tmp_path_factory.mktemp("sig") / request.param, request.param, seed=3,
                      dense_type=QuantType.F16)
    return strata.load(made.model_path)


def greedy(engine, n=N_DECODE):
    logits = [engine.prefill(PROMPT)]
    for _ in range(n):
        logits.append(engine.decode(int(np.argmax(logits[-1]))))
    return np.stack(logits)


@pytest.fixture(scope="module")
def reference(model):
    return greedy(ReferenceEngine(model.resident_params()))


@pytest.fixture(scope="module")
def numpy_reference(model):
    """The all-resident engine on the numpy streaming engine's products (STOCK0: the compiled CPU kernels)."""
    return greedy(open_numpy_reference(model, STOCK0))


def test_the_made_model_routes_with_its_biases_and_groups(model):
    """The biases are loaded per layer and change selections; the groups exclude experts."""
    rules = router_rules(model.cfg, model.dense)
    assert len({r.bias for r in rules}) == model.cfg.n_moe_layers and all(any(r.bias) for r in rules)
    rng = np.random.default_rng(0)
    z = rng.normal(0, 2, (200, model.cfg.n_experts)).astype(np.float32)
    unbiased = RouterRule.from_model_config(model.cfg)
    changed = sum(set(route(zt, rules[0]).experts.tolist()) != set(route(zt, unbiased).experts.tolist()) for zt in z)
    assert changed > 0


@pytest.mark.parametrize("extra", [0, 5])
def test_numpy_streaming_is_the_reference_bit_for_bit(model, numpy_reference, extra):
    least = arena_plan_for(model, STOCK0.replace(arena="100000slots")).min_slots
    with open_numpy_streaming(model, STOCK0.replace(arena=f"{least + extra}slots")) as engine:
        got = greedy(engine)
        assert engine.report().reads_per_token > 0
    np.testing.assert_array_equal(got, numpy_reference)


@pytest.mark.parametrize("arena", ["", "40slots"])
def test_mlx_engines_match_the_reference(model, reference, arena):
    pytest.importorskip("mlx.core")
    from mlx_agree import assert_backends_agree
    from strata.engines import open_engine

    config = Config(backend=Backend.MLX, arena=arena, moce_lambda=0.0)  # latent attention: the MLX ops twin
    eng = open_engine(model, config)
    try:
        got = greedy(eng)
    finally:
        eng.close()
    assert_backends_agree(reference, got, "FORWARD", what=f"mlx sigmoid model, arena {arena or 'resident'}")


@settings(max_examples=25, deadline=None)
@given(seed=st.integers(0, 2**31 - 1), policy=moce_policies(), n_group=st.sampled_from([1, 4, 8]),
       with_policy=st.booleans())
def test_mlx_route_twin_on_sigmoid_rules(seed, policy, n_group, with_policy):
    pytest.importorskip("mlx.core")
    from hypothesis import assume

    from mlx_agree import assert_selections_agree
    from strata.mlx_backend import routing as mlx_routing

    rng = np.random.default_rng(seed)
    e, k = 32, 4
    z, bias = rng.normal(0, 2, e).astype(np.float32), rng.normal(0, 0.3, e).astype(np.float32)
    rule = RouterRule(k, RoutingOrder.SIGMOID_TOPK, bool(seed % 2), n_group, min(2, n_group), 2.5).for_layer(bias)
    resident = rng.random(e) < 0.5
    policy = policy if with_policy else None
    ref = route(z, rule, policy, resident, 0.5)
    if policy is not None and policy.drop_tail_weight > 0:  # a weight at the threshold may round either way
        all_w = np.concatenate([ref.weights, ref.dropped_weights])
        assume(np.all(np.abs(all_w - np.float32(policy.drop_tail_weight)) > 1e-5))
    assert_selections_agree(ref, mlx_routing.route(z, rule, policy, resident, 0.5), what="sigmoid route")

