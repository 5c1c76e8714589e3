"""Read-ahead recall, checked by hand on a two-token case, and against a brute-force count."""

import numpy as np
import pytest

from strata.model_config import RoutingOrder
from strata.reference.routing import RouterRule
from strata.tools.recall import readahead_recall
from strata.tools.trace import Trace
from test_tools_synthetic import synthetic_trace


def hand_trace():
    """2 tokens, 2 layers, 4 experts, top-2. Layer 1's router is the identity, so the guess after
    layer 0 ranks experts by h(t, 0) itself:
        token 0: h = [4, 3, 2, 1] -> guess order 0 1 2 3; real layer-1 pick [1, 3], weights .6 .4
        token 1: h = [0, 0, 5, 1] -> guess order 2 3 0 1 (0/1 tie: lower index); real [3, 2], .7 .3
    """
    h = np.zeros((2, 2, 4), np.float32)
    h[0, 0] = [4, 3, 2, 1]
    h[1, 0] = [0, 0, 5, 1]
    routers = np.stack([np.eye(4, dtype=np.float32)] * 2)
    selected = np.array([[[0, 1], [1, 3]], [[0, 1], [3, 2]]], np.int64)
    weights = np.array([[[.5, .5], [.6, .4]], [[.5, .5], [.7, .3]]], np.float32)
    return Trace(np.arange(2), h, routers, np.zeros((2, 2, 4), np.float32), selected, weights,
                 RouterRule(2, RoutingOrder.SOFTMAX_TOPK))


def test_by_hand():
    r = readahead_recall(hand_trace(), (1, 2, 4))
    assert r.pairs == 2
    # K=1: token 0 guesses {0} (no real pick), token 1 guesses {2} (one of two; not the top-1)
    assert r.recall[1] == pytest.approx((0 + 0.5) / 2)
    assert r.top1[1] == 0.0
    assert r.weight_recall[1] == pytest.approx((0 + 0.3) / 2)
    # K=2: token 0 {0, 1} holds 1 (the top-1, weight .6); token 1 {2, 3} holds both
    assert r.recall[2] == pytest.approx((0.5 + 1.0) / 2)
    assert r.top1[2] == 1.0
    assert r.weight_recall[2] == pytest.approx((0.6 + 1.0) / 2)
    assert r.recall[4] == r.top1[4] == r.weight_recall[4] == 1.0


def test_two_ahead_needs_three_layers():
    r = readahead_recall(hand_trace(), (2,), ahead=2)
    assert r.pairs == 0 and np.isnan(r.recall[2])


def test_against_brute_force():
    tr = synthetic_trace(n_tokens=9, n_layers=4, n_experts=16, top_k=3, seed=5)
    for ahead in (1, 2):
        g = tr.guess_logits(ahead)
        r = readahead_recall(tr, (2, 5, 16), ahead=ahead, warmup=2)
        for K in (2, 5, 16):
            hits, top1, wr, n = 0.0, 0, 0.0, 0
            for t in range(2, tr.n_tokens):
                for l in range(tr.n_layers - ahead):
                    guess = set(np.argsort(-g[t, l], kind="stable")[:K].tolist())
                    real, w = tr.selected[t, l + ahead].tolist(), tr.weights[t, l + ahead]
                    inside = [e in guess for e in real]
                    hits += sum(inside) / len(real)
                    top1 += inside[0]
                    wr += float(np.sum(w[inside]) / np.sum(w))
                    n += 1
            assert r.pairs == n
            assert r.recall[K] == pytest.approx(hits / n)
            assert r.top1[K] == pytest.approx(top1 / n)
            assert r.weight_recall[K] == pytest.approx(wr / n)
        assert r.recall[16] == 1.0
