"""The read-ahead on a structured synthetic routing trace (strata/testing/traces.py): urgent
misses fall from no prefetch, to K = 10 with the old LRU touch, to K = 16 without it — the
direction of the reference engine's 19.65 -> 9.82 -> 6.99 (benchmarks/cache.py prints our numbers)."""

from __future__ import annotations

import numpy as np
import pytest

from strata.cache.replay import replay
from strata.cache.types import CacheConfig
from strata.testing.traces import recall_at, synthetic_routing_trace

TOKENS, LAYERS, EXPERTS, TOP_K = 120, 8, 128, 10
CAPACITY = 400  # ~40% of the 1,024 (layer, expert) keys, like the reference engine's 5,385 of 12,288


@pytest.fixture(scope="module")
def trace():
    return synthetic_routing_trace(TOKENS, LAYERS, EXPERTS, TOP_K, 16, seed=3)


def _urgent_per_token(trace, k, touch):
    cfg = CacheConfig(capacity=CAPACITY, n_layers=LAYERS, n_experts=EXPERTS, top_k=TOP_K, prefetch_depth=k,
                      prefetch_touch=touch)
    totals = replay(cfg, trace.selected, trace.guesses).totals
    assert totals.lookups == TOKENS * LAYERS * TOP_K
    return totals.urgent_misses / TOKENS, totals


def test_trace_is_deterministic_and_well_formed(trace):
    again = synthetic_routing_trace(TOKENS, LAYERS, EXPERTS, TOP_K, 16, seed=3)
    np.testing.assert_array_equal(trace.selected, again.selected)
    np.testing.assert_array_equal(trace.guesses, again.guesses)
    for rows in (trace.selected, trace.guesses[:, :-1]):
        assert all(len(set(r)) == len(r) for r in rows.reshape(-1, rows.shape[-1]).tolist())
    assert 0.55 < recall_at(trace, 10) < recall_at(trace, 16) < 0.95  # the reference engine: 0.678, 0.821


def test_urgent_misses_fall_with_readahead_depth(trace):
    none, t0 = _urgent_per_token(trace, 0, False)
    stock, t10 = _urgent_per_token(trace, 10, True)
    deep, t16 = _urgent_per_token(trace, 16, False)
    assert none > stock > deep, (none, stock, deep)
    assert t0.readahead_hits == 0 < t10.readahead_hits < t16.readahead_hits


def test_late_count_is_timing_only(trace):
    cfg = CacheConfig(capacity=CAPACITY, n_layers=LAYERS, n_experts=EXPERTS, top_k=TOP_K, prefetch_depth=16)
    on_time = replay(cfg, trace.selected[:30], trace.guesses[:30]).totals
    late = replay(cfg, trace.selected[:30], trace.guesses[:30], read_aheads_land=False).totals
    assert on_time.late_readaheads == 0 and late.late_readaheads == late.readahead_hits
    assert {**vars(on_time), "late_readaheads": 0} == {**vars(late), "late_readaheads": 0}
