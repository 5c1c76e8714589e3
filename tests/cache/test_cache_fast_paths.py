"""The fast cache twin's shortcuts (strata/cache/fast.py) against the reference, on
longer decode runs than the hypothesis tests draw: the all-hit and read-ahead-claim turns taken
in `step` (their pins, ticks and LRU moves held until the next step), the skipped prefix of the
LRU at a tight arena, and the action builders.

`state()` settles held turns itself, so the runs here compare it only at the end: every other
step reads the held work through `step`'s own `_settle`.
"""

from __future__ import annotations

from dataclasses import FrozenInstanceError, fields

import pytest

from strata.cache.machine import initial_state, step
from strata.cache.types import (
    AfterLayer, AtLayer, BeginWindow, CacheConfig, Cancel, Evict, Read, ReadDone, Use, WaitFor,
)
from strata.cache import fast as fast_cache
from strata.cache.fast import FastCache
from strata.testing.traces import synthetic_routing_trace
from test_cache_fast import assert_same_state


def test_action_builders_build_the_dataclasses():
    built = [fast_cache._read(3, 1, 7, True, 9), fast_cache._use(2, (5, 6), (10, 11)), fast_cache._evict(4, 0, 1),
             fast_cache._cancel(8, 12), fast_cache._wait_for((1, 2))]
    want = [Read(3, 1, 7, True, 9), Use(2, (5, 6), (10, 11)), Evict(4, 0, 1), Cancel(8, 12), WaitFor((1, 2))]
    for got, ref in zip(built, want):
        assert type(got) is type(ref) and got == ref and hash(got) == hash(ref) and repr(got) == repr(ref)
        with pytest.raises(FrozenInstanceError):
            setattr(got, fields(got)[0].name, 0)  # still frozen


@pytest.mark.parametrize("capacity_share, touch, notices", [
    (0.25, False, "next turn"),  # the benchmark's shape: mostly all-hit turns, some claims, misses
    (0.25, False, "never"),  # every claim is late: the held turns carry a WaitFor
    (0.25, True, "next turn"),  # prefetch_touch: touches of slots a victim search skipped
    (0.0, False, "next turn"),  # the smallest arena: victim searches skip pinned and read-ahead slots
    (0.0, True, "never"),
])
def test_long_decode_runs_take_the_reference_decisions(capacity_share, touch, notices):
    n_layers, n_experts, top_k, k = 6, 32, 4, 6
    trace = synthetic_routing_trace(40, n_layers, n_experts, top_k, k, seed=3)
    cfg = CacheConfig(capacity=1, n_layers=n_layers, n_experts=n_experts, top_k=top_k, prefetch_depth=k,
                      prefetch_touch=touch)
    capacity = max(int(capacity_share * n_layers * n_experts), cfg.min_capacity)
    cfg = CacheConfig(capacity=capacity, n_layers=n_layers, n_experts=n_experts, top_k=top_k, prefetch_depth=k,
                      prefetch_touch=touch)
    ref, fast = initial_state(cfg), FastCache(cfg)
    sel, guesses = trace.selected.tolist(), trace.guesses.tolist()
    pending: list = []
    held = 0
    for t in range(len(sel)):
        events = [BeginWindow()]
        for layer in range(n_layers):
            events += [AtLayer(layer, sel[t][layer]), AfterLayer(layer, guesses[t][layer])]
        for event in events:
            if isinstance(event, AtLayer) and notices == "next turn":
                for slot, ticket in pending:
                    ref, _ = step(ref, ReadDone(slot, ticket))
                fast.read_done_many(pending)
            ref, want = step(ref, event)
            got = fast.step(event)
            assert got == want, (t, event)
            held += bool(fast._held)
            if isinstance(event, AfterLayer):
                pending = [(a.slot, a.ticket) for a in got if isinstance(a, Read)]
    assert held > 0  # the shortcut was taken
    assert_same_state(ref, fast)
