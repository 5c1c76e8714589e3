"""Small synthetic traces for the analysis-kit tests (imported by the other test_tools_* modules;
no model run): random routers and router
inputs with a shared direction (so some experts are popular and caches have something to hit),
logits and λ = 0 selections computed by the reference routing."""

from __future__ import annotations

import numpy as np

from strata.model_config import RoutingOrder
from strata.reference.routing import RouterRule, route
from strata.tools.closed_loop import GuessRouters
from strata.tools.trace import Trace


def synthetic_trace(n_tokens: int = 24, n_layers: int = 3, n_experts: int = 16, top_k: int = 3, dim: int = 32,
                    seed: int = 0, order: RoutingOrder = RoutingOrder.SOFTMAX_TOPK) -> Trace:
    rng = np.random.default_rng(seed)
    common = rng.standard_normal(dim).astype(np.float32)
    routers = (rng.standard_normal((n_layers, n_experts, dim)) * 0.5).astype(np.float32)
    routers += (rng.standard_normal((n_layers, n_experts, 1)) * common).astype(np.float32)
    drift = np.cumsum(rng.standard_normal((n_tokens, 1, dim)) * 0.3, axis=0)  # slowly moving context
    h = (common + drift + rng.standard_normal((n_tokens, n_layers, dim))).astype(np.float32)  # [T, L, D]
    f32 = GuessRouters(routers, pred_q8=False)
    logits = np.array([[f32.logits(l, h[t, l]) for l in range(n_layers)] for t in range(n_tokens)], np.float32)
    rule = RouterRule(top_k, order)
    sels = [[route(logits[t, l], rule) for l in range(n_layers)] for t in range(n_tokens)]
    return Trace(
        tokens=np.arange(n_tokens, dtype=np.int64), router_inputs=h, routers=routers, logits=logits,
        selected=np.array([[s.experts for s in row] for row in sels], np.int64),
        weights=np.array([[s.weights for s in row] for row in sels], np.float32), rule=rule,
    )


def test_synthetic_trace_is_a_consistent_trace():
    from strata.tools.trace import reroute_check

    tr = synthetic_trace(n_tokens=8, seed=1)
    assert reroute_check(tr) == 1.0
    assert len(np.unique(tr.selected)) < tr.n_experts * 0.95 or tr.n_experts <= tr.top_k * 2  # skewed
