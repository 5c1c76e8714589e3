"""The made models' routing has the skew and locality of a trained model (docs/testing.md)."""

import numpy as np

from strata.reference.model import ModelState, forward
from tests.models import tiny_params

TEXT = b"The quick brown fox jumps over the lazy dog. def fibonacci(n): return n if n < 2 else fib(n-1)\n"
# Against uniform routing (overlap k/E, top-1/8 share 1/8), the made routing must show at least this factor.
MIN_FACTOR_OVER_UNIFORM = 2.0


def routing_statistics(params, tokens):
    _, _, tr = forward(params, ModelState.empty(params.cfg), tokens, trace=True)
    k, n_experts = params.cfg.n_experts_per_token, params.cfg.n_experts
    overlaps, shares = [], []
    for layer in tr.selections:
        sets = [set(s.experts.tolist()) for s in layer]
        overlaps.append(np.mean([len(a & b) / k for a, b in zip(sets, sets[1:])]))
        counts = np.sort(np.bincount(np.concatenate([s.experts for s in layer]), minlength=n_experts))[::-1]
        shares.append(counts[: max(1, n_experts // 8)].sum() / counts.sum())
    return float(np.mean(overlaps)), float(np.mean(shares))


def test_routing_is_skewed_and_local():
    params = tiny_params(seed=0, n_experts=32)
    tokens = np.frombuffer(TEXT, np.uint8).astype(np.int64)
    overlap, share = routing_statistics(params, tokens)
    k, n = params.cfg.n_experts_per_token, params.cfg.n_experts
    assert overlap >= MIN_FACTOR_OVER_UNIFORM * k / n, overlap
    assert share >= MIN_FACTOR_OVER_UNIFORM / 8, share
    assert overlap < 0.9 and share < 0.9  # and not degenerate: routing still moves
