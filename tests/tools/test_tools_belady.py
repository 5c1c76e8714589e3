"""Belady's MIN: optimal on small streams (checked by exhaustive search), never above the cache
machine's LRU on any trace, monotone in capacity, warm-up handled."""

from functools import lru_cache

import numpy as np
from hypothesis import given
from hypothesis import strategies as st

from strata.tools.belady import belady, request_stream
from strata.tools.closed_loop import LoopConfig
from strata.tools.replay import replay
from test_tools_synthetic import synthetic_trace


def as_selections(keys):
    """A flat key stream as selections [T, 1, 1] (one layer, one expert per token)."""
    return np.asarray(keys, np.int64).reshape(-1, 1, 1)


def optimal_misses(keys, capacity):
    """Fewest misses of any demand-paging policy, by exhaustive search over evictions."""
    keys = tuple(keys)

    @lru_cache(maxsize=None)
    def best(i, cached):
        if i == len(keys):
            return 0
        k = keys[i]
        if k in cached:
            return best(i + 1, cached)
        if len(cached) < capacity:
            return 1 + best(i + 1, cached | {k})
        return 1 + min(best(i + 1, (cached - {v}) | {k}) for v in cached)

    return best(0, frozenset())


def test_hand_case():
    # capacity 2: a b c a b  ->  a, b, c miss (evict b: a comes first), a hits, b misses
    assert belady(as_selections([0, 1, 2, 0, 1]), 4, 2).misses == 4
    # a b a c a b with capacity 2: misses a, b, c(evict b), b -> 4
    assert belady(as_selections([0, 1, 0, 2, 0, 1]), 4, 2).misses == 4
    assert belady(as_selections([0, 1, 0, 2, 0, 1]), 4, 3).misses == 3


@given(keys=st.lists(st.integers(0, 4), min_size=1, max_size=11), capacity=st.integers(1, 3))
def test_min_is_optimal(keys, capacity):
    assert belady(as_selections(keys), 5, capacity).misses == optimal_misses(keys, capacity)


@given(seed=st.integers(0, 2**16), extra=st.integers(0, 24), lam=st.sampled_from([0.0, 0.85]))
def test_belady_never_above_lru(seed, extra, lam):
    tr = synthetic_trace(n_tokens=16, n_layers=3, n_experts=12, top_k=3, seed=seed)
    config = LoopConfig(capacity=9 + extra, prefetch_depth=0, policy=None)
    lru = replay(tr, config).stats.urgent_misses
    assert belady(tr.selected, tr.n_experts, config.capacity).misses <= lru
    # and on a MoCE run's own routed stream, against that run's LRU misses
    from strata.reference.routing import MoCEPolicy

    moce = replay(tr, LoopConfig(capacity=config.capacity, prefetch_depth=0, policy=MoCEPolicy(bonus=lam)),
                  keep_selections=True)
    assert belady(moce.selections, tr.n_experts, config.capacity).misses <= moce.stats.urgent_misses


@given(seed=st.integers(0, 2**16))
def test_monotone_in_capacity(seed):
    tr = synthetic_trace(n_tokens=10, n_layers=2, n_experts=10, top_k=3, seed=seed)
    misses = [belady(tr.selected, tr.n_experts, c).misses for c in range(6, 22, 3)]
    assert misses == sorted(misses, reverse=True)
    assert misses[-1] == len(np.unique(request_stream(tr.selected, tr.n_experts)[0]))  # only cold misses


def test_warmup_and_padding():
    sel = np.array([[[0, 1]], [[2, -1]], [[0, 1]]], np.int64)  # [T=3, L=1, k=2], one dropped slot
    keys, tok = request_stream(sel, 4)
    assert keys.tolist() == [0, 1, 2, 0, 1] and tok.tolist() == [0, 0, 1, 2, 2]
    r = belady(sel, 4, 2, warmup=1)
    assert r.tokens == 2 and r.misses == 2  # c, then one of a/b again (4 total, 2 in the warm-up)
