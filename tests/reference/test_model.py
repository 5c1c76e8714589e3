"""The reference forward: incremental decode, chunked prefill, causality, RoPE, q/k-norm variants."""

import numpy as np
import pytest
from hypothesis import given
from hypothesis import strategies as st

from strata.model_config import QKNorm, RoutingOrder
from strata.reference.attention import rope
from strata.reference.model import ModelState, forward
from tests.models import tiny_params
from tests.budgets import FLOAT32_REORDER

VARIANTS = {
    "qwen3-like": {},
    "olmoe-like": dict(qk_norm=QKNorm.FULL, shared_ffn_size=0, shared_expert_gated=False),
    "qwen2-like": dict(qk_norm=QKNorm.NONE, attention_bias=True),
    "mixtral-like": dict(qk_norm=QKNorm.NONE, routing_order=RoutingOrder.TOPK_SOFTMAX, shared_ffn_size=0,
                         shared_expert_gated=False),
    "tied": dict(tie_embeddings=True, n_heads=4, n_kv_heads=4),
}


@pytest.fixture(scope="module", params=sorted(VARIANTS))
def params(request):
    return tiny_params(seed=1, **VARIANTS[request.param])


def test_incremental_decode_matches_full_forward(params):
    tokens = np.random.default_rng(0).integers(0, 256, size=12)
    full, _ = forward(params, ModelState.empty(params.cfg), tokens)
    state = ModelState.empty(params.cfg)
    steps = []
    for t in tokens:
        logits, state = forward(params, state, np.array([t]))
        steps.append(logits[0])
    assert state.length == len(tokens)
    np.testing.assert_allclose(np.stack(steps), full, **FLOAT32_REORDER)


def test_chunked_prefill_matches_full_forward(params):
    tokens = np.random.default_rng(1).integers(0, 256, size=10)
    full, _ = forward(params, ModelState.empty(params.cfg), tokens)
    first, state = forward(params, ModelState.empty(params.cfg), tokens[:4])
    second, _ = forward(params, state, tokens[4:])
    np.testing.assert_allclose(np.concatenate([first, second]), full, **FLOAT32_REORDER)


def test_causal_later_tokens_do_not_change_earlier_logits():
    params = tiny_params(seed=2)
    a = np.array([5, 6, 7, 8, 9, 10])
    b = a.copy()
    b[4:] = [200, 201]
    la, _ = forward(params, ModelState.empty(params.cfg), a)
    lb, _ = forward(params, ModelState.empty(params.cfg), b)
    np.testing.assert_array_equal(la[:4], lb[:4])
    assert not np.allclose(la[4:], lb[4:])


def test_out_of_range_token_is_a_clear_error():
    params = tiny_params()
    with pytest.raises(ValueError, match="token ids must be in"):
        forward(params, ModelState.empty(params.cfg), np.array([params.cfg.vocab_size]))


@given(st.integers(0, 50), st.integers(0, 50), st.integers(0, 20))
def test_rope_scores_depend_only_on_relative_position(i, j, shift):
    rng = np.random.default_rng(i * 1000 + j)
    q = rng.standard_normal((1, 1, 16)).astype(np.float32)
    k = rng.standard_normal((1, 1, 16)).astype(np.float32)
    s1 = (rope(q, np.array([i]), 10000.0) * rope(k, np.array([j]), 10000.0)).sum()
    s2 = (rope(q, np.array([i + shift]), 10000.0) * rope(k, np.array([j + shift]), 10000.0)).sum()
    np.testing.assert_allclose(s1, s2, **FLOAT32_REORDER)


def test_rope_preserves_norm():
    x = np.random.default_rng(0).standard_normal((2, 5, 16)).astype(np.float32)
    y = rope(x, np.arange(5) * 7, 10000.0)
    np.testing.assert_allclose(np.linalg.norm(y, axis=-1), np.linalg.norm(x, axis=-1), **FLOAT32_REORDER)


def test_trace_records_router_inputs_and_selections():
    params = tiny_params()
    tokens = np.arange(5)
    logits, _, tr = forward(params, ModelState.empty(params.cfg), tokens, trace=True)
    cfg = params.cfg
    assert tr.router_inputs.shape == (cfg.n_layers, 5, cfg.hidden_size)
    assert len(tr.selections) == cfg.n_layers and len(tr.selections[0]) == 5
    assert all(len(s.experts) == cfg.n_experts_per_token for layer in tr.selections for s in layer)
