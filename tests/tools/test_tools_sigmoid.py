"""The analysis tools on a sigmoid-routed model (the 'sigmoid' made model: a selection bias per
MoE layer, 4 groups of which 2 are eligible, scaled weights, a dense first layer): the trace
carries each layer's rule (through save/load too), the λ = 0 replay makes the streaming
runtime's decisions, the decode-order closed loop under MoCE is the runtime's bit for bit, and
`quality` at λ = 0 scores KLD exactly 0; the stock λ (logits) is refused on the sigmoid rule."""

from __future__ import annotations

import dataclasses
import json
from dataclasses import asdict

import numpy as np
import pytest

import strata
from strata.config import Config
from strata.errors import ConfigError, FormatError
from strata.model_config import RoutingOrder, TensorNames
from strata.testing.engines import open_numpy_streaming
from strata.testing.models import make_model
from strata.tools.closed_loop import LoopConfig
from strata.tools.options import tool_ops
from strata.tools.quality import fast_params, quality, run_decode
from strata.tools.replay import replay
from strata.tools.trace import Trace, load_trace, record_trace, reroute_check, save_trace

pytest.importorskip("gguf")

TEXT = "def fib(n): return n if n < 2 else fib(n-1)"


@pytest.fixture(scope="module")
def model(tmp_path_factory):
    made = make_model(tmp_path_factory.mktemp("sig_tools") / "m", "sigmoid", seed=5)
    return strata.load(made.model_path)


@pytest.fixture(scope="module")
def tokens(model):
    return model.tokenizer.encode(TEXT)[:24]


@pytest.fixture(scope="module")
def params(model):
    return fast_params(model.resident_params())


@pytest.fixture(scope="module")
def ops(model):
    """The products the runtime computes with (the compiled CPU kernels by default)."""
    return tool_ops(model, Config())


@pytest.fixture(scope="module")
def trace(params, tokens, ops):
    return record_trace(params, tokens, ops=ops)


def decisions(stats):
    d = asdict(stats)
    d.pop("late_readaheads")  # the one count that depends on I/O timing
    return d


def capacity(model, config, extra):
    cfg = model.cfg
    return (LoopConfig.from_config(config, 1).cache_config(cfg.n_moe_layers, cfg.n_experts, cfg.n_experts_per_token)
            .min_capacity + extra)


def run_runtime(model, tokens, config):
    with open_numpy_streaming(model, config) as engine:
        logits = np.stack([engine.decode(t) for t in tokens])
        return engine.streamer.totals, logits


def test_the_trace_carries_each_layers_rule(model, trace, tmp_path):
    cfg = model.cfg
    want = np.stack([model.dense[TensorNames.block(l, TensorNames.exp_probs_b)] for l in cfg.moe_layers])
    np.testing.assert_array_equal(trace.biases, want)
    assert trace.rule.order is RoutingOrder.SIGMOID_TOPK and trace.rule.n_group == 4 and trace.rule.scaling == 2.5
    assert reroute_check(trace) == 1.0
    # the biases decide selections here: without them the stored selections are not reproduced
    assert reroute_check(dataclasses.replace(trace, biases=None)) < 1.0
    back = load_trace(save_trace(tmp_path / "t", trace))
    assert back.rules == trace.rules and len(set(back.rules)) == cfg.n_moe_layers
    np.testing.assert_array_equal(back.biases, trace.biases)
    assert reroute_check(back) == 1.0
    assert back.truncated(5).rules == trace.rules


def test_a_version_1_trace_still_loads_and_biases_need_a_sigmoid_rule(trace, tmp_path):
    softmax = Trace(trace.tokens, trace.router_inputs, trace.routers, trace.logits, trace.selected, trace.weights,
                    dataclasses.replace(trace.rule, order=RoutingOrder.SOFTMAX_TOPK, n_group=1, topk_group=1,
                                        scaling=1.0))
    path = save_trace(tmp_path / "v1", softmax)
    with np.load(path) as z:
        arrays = {k: z[k] for k in z.files}
    header = json.loads(str(arrays["header"]))
    v1 = {"version": 1, **{k: header[k] for k in ("k", "order", "norm_topk_prob", "meta")}}
    np.savez(path, **{**arrays, "header": np.array(json.dumps(v1))})
    assert load_trace(path).rules == softmax.rules
    np.savez(path, **{**arrays, "biases": np.asarray(trace.biases)})  # biases beside a softmax rule
    with pytest.raises(FormatError, match="selection biases"):
        load_trace(path)


@pytest.mark.parametrize("switch", [dict(), dict(prefetch2=True), dict(pred_q8=False), dict(prefetch=16)],
                         ids=lambda s: ",".join(f"{k}={v}" for k, v in s.items()) or "stock")
@pytest.mark.parametrize("extra", [0, 9])
def test_replay_matches_runtime_at_lambda_zero(model, tokens, trace, switch, extra):
    config = Config(moce_lambda=0.0, **switch)
    cap = capacity(model, config, extra)
    config = config.replace(arena=f"{cap}slots")
    got, _ = run_runtime(model, tokens, config)
    sim = replay(trace, LoopConfig.from_config(config, cap))
    assert got.urgent_misses > 0
    assert decisions(sim.stats) == decisions(got)


# λ in score units (sigmoid scores lie in (0, 1); docs/routing.md): a few hundredths, or RANGE
MOCE = [dict(moce_lambda=0.05), dict(moce_j=1, moce_lambda=0.1, prefetch2=True),
        dict(moce_lambda=0.5, moce_scale="range"), dict(moce_j=0, moce_lambda=0.05, moce_pre=True)]


@pytest.mark.parametrize("switch", MOCE, ids=lambda s: ",".join(f"{k}={v}" for k, v in s.items()))
def test_decode_order_loop_matches_runtime_with_moce(model, tokens, params, ops, switch):
    config = Config(moce_j=3).replace(**switch)
    cap = capacity(model, config, 5)
    config = config.replace(arena=f"{cap}slots")
    got, logits = run_runtime(model, tokens, config)
    sim = run_decode(params, tokens, config=LoopConfig.from_config(config, cap), ops=ops)
    assert sim.changed > 0  # MoCE did change routing: not a λ = 0 comparison in disguise
    assert decisions(sim.stats) == decisions(got)
    np.testing.assert_array_equal(sim.logits, logits)


def test_quality_at_lambda_zero_is_exact(model, tokens, params):
    config = Config(moce_lambda=0.0)
    result = quality(params, tokens, LoopConfig.from_config(config, capacity(model, config, 3)), warmup=4)
    assert result.kld_max == 0.0 and result.changed_fraction == 0.0 and result.stats.urgent_misses > 0


def test_stock_moce_is_refused_on_sigmoid_rules_and_range_runs(model, tokens, params, ops):
    """`--moce stock`'s λ = 0.85 is logits (softmax routers): on a sigmoid rule, whose ABSOLUTE
    bonus is in score units, the runtime and the closed loop refuse it naming the RANGE form."""
    stock = Config(moce="stock")
    cap = capacity(model, stock, 5)
    with pytest.raises(ConfigError, match="RANGE form"):
        open_numpy_streaming(model, stock.replace(arena=f"{cap}slots"))
    with pytest.raises(ConfigError, match="RANGE form"):
        run_decode(params, tokens, config=LoopConfig.from_config(stock, cap))
    ranged = stock.replace(moce_scale="range", moce_lambda=0.5)
    got, logits = run_runtime(model, tokens, ranged.replace(arena=f"{cap}slots"))
    sim = run_decode(params, tokens, config=LoopConfig.from_config(ranged, cap), ops=ops)
    assert sim.changed > 0 and decisions(sim.stats) == decisions(got)
    np.testing.assert_array_equal(sim.logits, logits)


def test_stock_moce_still_runs_on_softmax_rules(tmp_path):
    made = make_model(tmp_path / "soft", "tiny", seed=5, n_layers=2)
    soft = strata.load(made.model_path)
    stock = Config(moce="stock")
    cap = capacity(soft, stock, 5)
    with open_numpy_streaming(soft, stock.replace(arena=f"{cap}slots")) as engine:
        assert engine.selector.policy.bonus == 0.85
