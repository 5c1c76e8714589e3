"""Routing traces: what `record_trace` stores is what the forward pass saw and chose, and a
saved trace reads back unchanged."""

import numpy as np
import pytest

from strata.errors import FormatError
from strata.model_config import TensorNames
from strata.reference.model import ModelState, forward
from strata.reference.routing import route
from strata.tools.closed_loop import GuessRouters
from strata.tools.trace import load_trace, record_trace, reroute_check, save_trace
from tests.models import tiny_params

TOKENS = np.array([104, 101, 108, 108, 111, 32, 119, 111, 114, 108, 100, 33, 10, 97, 98, 99], np.int64)


@pytest.fixture(scope="module")
def params():
    return tiny_params(seed=3, n_layers=3)


@pytest.fixture(scope="module")
def trace(params):
    return record_trace(params, TOKENS)


def test_decode_order_trace_is_the_forward_one_token_at_a_time(params, trace):
    state = ModelState.empty(params.cfg)
    for t, tok in enumerate(TOKENS):
        _, state, ft = forward(params, state, np.array([tok]), trace=True)
        for layer in range(params.cfg.n_layers):
            sel = ft.selections[layer][0]
            np.testing.assert_array_equal(trace.router_inputs[t, layer], ft.router_inputs[layer, 0])
            np.testing.assert_array_equal(trace.logits[t, layer], sel.logits)
            np.testing.assert_array_equal(trace.selected[t, layer], sel.experts)
            np.testing.assert_array_equal(trace.weights[t, layer], sel.weights)
    assert reroute_check(trace) == 1.0


def test_batch_trace_selects_the_same_experts(params, trace):
    batch = record_trace(params, TOKENS, decode_order=False)
    np.testing.assert_array_equal(batch.selected, trace.selected)


def test_shapes_and_routers(params, trace):
    cfg = params.cfg
    T, L, E, D, k = len(TOKENS), cfg.n_layers, cfg.n_experts, cfg.hidden_size, cfg.n_experts_per_token
    assert (trace.n_tokens, trace.n_layers, trace.n_experts, trace.top_k) == (T, L, E, k)
    assert trace.router_inputs.shape == (T, L, D) and trace.logits.shape == (T, L, E)
    for layer in range(L):
        np.testing.assert_array_equal(trace.routers[layer], params.dense[TensorNames.block(layer, TensorNames.router)])


@pytest.mark.parametrize("pred_q8", [False, True])
def test_guess_logits_are_the_next_router_on_this_input(trace, pred_q8):
    g = trace.guess_logits(1, pred_q8=pred_q8)
    g2 = trace.guess_logits(2, pred_q8=pred_q8)
    assert g.shape == (trace.n_tokens, trace.n_layers - 1, trace.n_experts)
    assert g2.shape == (trace.n_tokens, trace.n_layers - 2, trace.n_experts)
    routers = GuessRouters(trace.routers, pred_q8=pred_q8)
    np.testing.assert_array_equal(g[5, 1], routers.logits(2, trace.router_inputs[5, 1]))
    if not pred_q8:  # the next layer's router on this layer's input: the guess IS a router logit vector
        np.testing.assert_array_equal(g[5, 1], (trace.router_inputs[5, 1][None] @ trace.routers[2].T)[0])


def test_save_load_round_trip(tmp_path, trace):
    path = save_trace(tmp_path / "t", trace)
    assert path.suffix == ".npz"
    back = load_trace(tmp_path / "t")
    for name in ("tokens", "router_inputs", "routers", "logits", "selected", "weights"):
        np.testing.assert_array_equal(getattr(back, name), getattr(trace, name))
    assert back.rule == trace.rule


def test_f16_trace_keeps_exact_logits(params, tmp_path):
    t16 = record_trace(params, TOKENS[:6], input_dtype="f16")
    assert t16.router_inputs.dtype == np.float16 and t16.logits.dtype == np.float32
    assert reroute_check(load_trace(save_trace(tmp_path / "h", t16))) == 1.0


def test_bad_files_are_clear_errors(tmp_path):
    with pytest.raises(FormatError, match="no such trace"):
        load_trace(tmp_path / "missing.npz")
    np.savez(tmp_path / "other.npz", x=np.zeros(3))
    with pytest.raises(FormatError, match="not a strata trace"):
        load_trace(tmp_path / "other.npz")


def test_truncated(trace):
    short = trace.truncated(4)
    assert short.n_tokens == 4
    np.testing.assert_array_equal(short.selected, trace.selected[:4])
    assert route(short.logits[3, 0], short.rule).experts.tolist() == short.selected[3, 0].tolist()
