"""The simulator and the streaming runtime make the same decisions: on the same text and
configuration, identical cache counts (every count but `late_readaheads`, the one that depends
on I/O timing), whichever cache the runtime drives (its fast in-place twin, the default, or the
reference machine).

At λ = 0 the replay of the decode-order trace is compared (the trace's logits are the run's).
With MoCE the real run's hidden states drift from the λ = 0 trace, so the closed loop run live
in decode order (`strata quality`'s policy run) is compared, logits included, bit for bit.
"""

from dataclasses import asdict

import numpy as np
import pytest

import strata
from strata.config import Config
from strata.formats.quant_types import QuantType
from strata.numpy_backend import native_build
from strata.testing.engines import open_numpy_streaming
from strata.testing.models import make_model
from strata.tools.closed_loop import LoopConfig
from strata.tools.options import tool_ops
from strata.tools.quality import fast_params, run_decode
from strata.tools.replay import replay
from strata.tools.trace import record_trace

TEXT = "def fib(n): return n if n < 2 else fib(n-1)"


@pytest.fixture(scope="module")
def model(tmp_path_factory):
    made = make_model(tmp_path_factory.mktemp("sim") / "m", "tiny", seed=7, n_layers=3, n_experts=32)
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
    d.pop("late_readaheads")
    return d


def run_runtime(model, tokens, config):
    with open_numpy_streaming(model, config) as engine:
        logits = np.stack([engine.decode(t) for t in tokens])
        return engine.streamer.totals, logits


def capacity(config, least_extra):
    return LoopConfig.from_config(config, 1).cache_config(3, 32, 4).min_capacity + least_extra


LAMBDA0 = [
    dict(), dict(prefetch=0), dict(prefetch=16), dict(prefetch_touch=True), dict(prefetch2=True),
    dict(split_turn=False), dict(pred_q8=False),
]


@pytest.mark.parametrize("switch", LAMBDA0, ids=lambda s: ",".join(f"{k}={v}" for k, v in s.items()) or "stock")
@pytest.mark.parametrize("extra", [0, 9])
@pytest.mark.parametrize("reference_cache", [False, True], ids=["fast-cache", "reference-cache"])
def test_replay_matches_runtime_at_lambda_zero(model, tokens, trace, switch, extra, reference_cache):
    config = Config(moce_lambda=0.0, reference_cache=reference_cache, **switch)
    cap = capacity(config, extra)
    config = config.replace(arena=f"{cap}slots")
    got, _ = run_runtime(model, tokens, config)
    sim = replay(trace, LoopConfig.from_config(config, cap))
    assert got.urgent_misses > 0
    assert decisions(sim.stats) == decisions(got)


MOCE = [
    dict(), dict(moce_j=1, moce_lambda=2.0), dict(moce_j=0, moce_lambda=1.0, moce_pre=True),
    dict(moce_lambda=0.3, moce_scale="range"), dict(moce_drop_tail=0.2, moce_drop_rank=2),
    dict(moce_lambda=1.5, prefetch=6, prefetch2=True, prefetch_touch=True),
]


@pytest.mark.parametrize("switch", MOCE, ids=lambda s: ",".join(f"{k}={v}" for k, v in s.items()) or "stock")
@pytest.mark.parametrize("reference_cache", [False, True], ids=["fast-cache", "reference-cache"])
def test_decode_order_loop_matches_runtime_with_moce(model, tokens, params, ops, switch, reference_cache):
    config = Config(moce="stock", reference_cache=reference_cache).replace(**switch)
    cap = capacity(config, 5)
    config = config.replace(arena=f"{cap}slots")
    got, logits = run_runtime(model, tokens, config)
    sim = run_decode(params, tokens, config=LoopConfig.from_config(config, cap), ops=ops)
    assert sim.changed > 0  # MoCE did change routing: the comparison is not a λ = 0 one in disguise
    assert decisions(sim.stats) == decisions(got)
    np.testing.assert_array_equal(sim.logits, logits)


@pytest.fixture(scope="module")
def q8_model(tmp_path_factory):
    """Experts and dense matrices stored Q8_0: every product on the compiled CPU kernels."""
    made = make_model(tmp_path_factory.mktemp("sim_q8") / "m", "tiny", seed=7, n_layers=3, n_experts=32,
                      expert_type=QuantType.Q8_0, dense_type=QuantType.Q8_0)
    return strata.load(made.model_path)


@pytest.mark.parametrize("switch", [dict(moce_lambda=0.0), dict(moce="stock")], ids=["lambda0", "stock"])
def test_the_tools_are_the_runtime_on_a_q8_0_model(q8_model, switch):
    """The trace, the replay and the decode-order loop compute on the runtime's products (the
    compiled Q8_0 kernels for the experts, the dense matrices and the head): its decisions and
    its logits bit for bit."""
    ops = tool_ops(q8_model, Config())
    if native_build.library() is not None:
        assert ops.compiled  # else both sides are on the reference's products, and the test says less
    tokens = q8_model.tokenizer.encode(TEXT)[:24]
    params = fast_params(q8_model.resident_params())
    config = Config(**switch)
    cap = capacity(config, 5)
    config = config.replace(arena=f"{cap}slots")
    got, logits = run_runtime(q8_model, tokens, config)
    loop = LoopConfig.from_config(config, cap)
    sim = run_decode(params, tokens, config=loop, ops=ops)
    assert decisions(sim.stats) == decisions(got) and got.urgent_misses > 0
    np.testing.assert_array_equal(sim.logits, logits)
    if loop.policy is None or loop.policy.bonus == 0:
        assert decisions(replay(record_trace(params, tokens, ops=ops), loop).stats) == decisions(got)
    else:
        assert sim.changed > 0  # MoCE did change routing
