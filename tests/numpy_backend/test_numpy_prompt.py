"""The numpy backend's all-resident prompt path (strata/numpy_backend/prompt.py) against the
reference `forward`: the same layers with experts grouped over their tokens and the head on the
last position only, so only float32 summation order may differ (FLOAT32_REORDER), on every made
layer kind, and greedy generation on the embedded model is the same token for token."""

from __future__ import annotations

import numpy as np
import pytest

import strata
from strata.numpy_backend.engine import ReferenceEngine
from strata.numpy_backend.prompt import prompt_forward
from strata.reference.model import ModelState, forward
from strata.testing.models import make_model
from tests.budgets import FLOAT32_REORDER, FLOAT32_REORDER_OF_SCALE

SHAPES = ["tiny", "dense-first", "sigmoid", "hybrid", "gpt-oss", "mla"]
PROMPT = np.array(list(b"def fibonacci(n): return n if n < 2 else fib(n - 1)"), np.int64)  # 51 positions
CUT = 20  # a second prompt chunk after this many cached positions


@pytest.fixture(scope="module", params=SHAPES)
def model(request, tmp_path_factory):
    made = make_model(tmp_path_factory.mktemp("np") / request.param, request.param, seed=5)
    m = strata.load(made.model_path)
    yield m
    m.close()


def test_prompt_forward_matches_the_reference_forward(model):
    params = model.resident_params()
    empty = ModelState.empty(model.cfg)
    want, want_state = forward(params, empty, PROMPT)
    got, state = prompt_forward(params, empty, PROMPT, all_logits=True)
    np.testing.assert_allclose(got, want, **FLOAT32_REORDER)
    last, _ = prompt_forward(params, empty, PROMPT)  # the head on the last position only
    assert last.shape == (1, model.cfg.vocab_size)
    np.testing.assert_allclose(last[0], want[-1], **FLOAT32_REORDER)
    assert state.length == want_state.length == len(PROMPT)
    # the state it leaves decodes like the reference's, and a second chunk continues it
    nxt = np.array([int(np.argmax(want[-1]))])
    np.testing.assert_allclose(forward(params, state, nxt)[0], forward(params, want_state, nxt)[0], **FLOAT32_REORDER)
    first, mid = prompt_forward(params, empty, PROMPT[:CUT])
    second, _ = prompt_forward(params, mid, PROMPT[CUT:], all_logits=True)
    np.testing.assert_allclose(np.concatenate([first, second])[[0, -1]], want[[CUT - 1, -1]], **FLOAT32_REORDER)


def test_prompt_forward_groups_each_expert_once(model, monkeypatch):
    """The point of the path: one expert fetch (and matmul) per selected expert per layer, not per token."""
    params = model.resident_params()
    calls = []
    real = params.experts.expert
    monkeypatch.setattr(params.experts, "expert", lambda l, e: calls.append((l, e)) or real(l, e))
    _, _, trace = forward(params, ModelState.empty(model.cfg), PROMPT, trace=True)
    per_token = len(calls)
    calls.clear()
    prompt_forward(params, ModelState.empty(model.cfg), PROMPT)
    unique = sum(len({int(e) for sel in layer for e in sel.experts}) for layer in trace.selections)
    assert len(calls) == len(set(calls)) == unique < per_token


def test_reference_engine_window_matches_the_reference_forward(model):
    params = model.resident_params()
    want, _ = forward(params, ModelState.empty(model.cfg), PROMPT)
    eng = ReferenceEngine(params)
    np.testing.assert_allclose(eng.prefill(PROMPT[:CUT]), want[CUT - 1], **FLOAT32_REORDER)
    got = eng.decode_window(PROMPT[CUT:])
    err = np.abs(got - want[CUT:]).max(axis=1) / np.abs(want[CUT:]).max(axis=1)
    assert got.shape == want[CUT:].shape and err.max() <= FLOAT32_REORDER_OF_SCALE, err


def test_greedy_generation_on_the_embedded_model_is_unchanged():
    with strata.load() as m:
        params = m.resident_params()
        prompt = np.array(m.tokenizer.encode("def fibonacci(n):\n    "), np.int64)
        logits, state = forward(params, ModelState.empty(m.cfg), prompt)
        want = []
        for _ in range(24):
            want.append(int(np.argmax(logits[-1])))
            logits, state = forward(params, state, np.array(want[-1:]))
        eng = ReferenceEngine(params)
        got, last = [], eng.prefill(prompt)
        for _ in range(24):
            got.append(int(np.argmax(last)))
            last = eng.decode(got[-1])
    assert got == want
