"""The runtime's fast cache twin (`strata.cache.fast.FastCache`) against the reference
machine (`strata.cache.machine.step`), STYLE §1 and §8.

- a differential test over hypothesis-drawn configurations (every knob, capacities from below
  the minimum up) and turn sequences (decode windows, held prompt regions with passes), with
  ReadDone notices (genuine and stale, one by one or batched) and illegal events interleaved:
  the same actions at every step, the same errors at the same point, the same whole state
  (`inflight` and every count included) along the way and at the end;
- the cache's RuleBasedStateMachine (tests/cache/test_cache_machine.py) with the twin stepped beside
  the reference on every event it draws;
- the FastCache interface the Streamer uses (`read_done_many`, `resident_mask`, `totals`).

The runtime side (the Streamer drives FastCache by default) is checked by the runtime tests,
which replay the runtime's turns through the reference: tests/runtime/test_runtime_decode.py and
tests/runtime/test_runtime_determinism.py (parametrized over both caches).
"""

from __future__ import annotations

import numpy as np
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from cache_checks import pending_reads
from strata.cache.machine import CacheState, decision_view, initial_state, step
from strata.cache.state import _ARRAYS
from strata.cache.types import (
    AfterLayer, AtLayer, BeginWindow, CacheConfig, CacheFullError, CacheProtocolError, HoldRegion, Phase,
    Read, ReadDone,
)
from strata.cache.fast import FastCache, ReferenceCache, open_cache
from strategies import cache_configs, cache_turn_sequences
from test_cache_machine import CacheMachine

_SCALARS = ("stamp", "front", "back", "next_ticket", "phase", "layer", "prompt")


def assert_same_state(ref: CacheState, fast: FastCache) -> None:
    """The twin's state is the reference's: every array (dtype too), scalar and count."""
    got = fast.state()
    for name in _ARRAYS + ("turn_counts", "total_counts"):
        want, have = getattr(ref, name), getattr(got, name)
        assert have.dtype == want.dtype and np.array_equal(have, want), f"{name} differs"
    for name in _SCALARS:
        assert getattr(got, name) == getattr(ref, name), f"{name} differs"
    assert decision_view(got) == decision_view(ref) == fast.decision_view()
    assert fast.totals == ref.totals and fast.turn == ref.turn


def outcome(fn, *args):
    """(result, None) or (None, the cache error)."""
    try:
        return fn(*args), None
    except (CacheFullError, CacheProtocolError) as err:
        return None, err


def illegal_events(state: CacheState) -> list:
    """Events the reference may refuse in this state (the test keeps those it does refuse)."""
    cfg, layer, E = state.config, state.layer, state.config.n_experts
    too_many = tuple(range(min(E, cfg.max_selected + 1)))
    return [
        BeginWindow(), HoldRegion(state.prompt), HoldRegion(not state.prompt),
        AtLayer(layer, (0, 0)) if E > 1 else AtLayer(layer, (0,)), AtLayer(layer, (E,)), AtLayer(layer, too_many),
        AtLayer(layer + 1, ()), AtLayer(max(layer - 1, 0), ()),
        AfterLayer(layer, (E,)), AfterLayer(layer, (1, 1)), AfterLayer(layer, (), (E,)), AfterLayer(layer + 1),
        "not an event",
    ]


@given(data=st.data())
def test_fast_twin_takes_the_reference_decisions(data):
    config = data.draw(cache_configs(below_min=data.draw(st.booleans(), label="below min")), label="config")
    turns = data.draw(cache_turn_sequences(config, max_windows=6), label="turns")
    ref, fast = initial_state(config), FastCache(config)
    for i, event in enumerate(turns):
        pending = pending_reads(ref)
        done = data.draw(st.lists(st.sampled_from(pending), unique=True)) if pending else []
        if data.draw(st.booleans()):  # a stale notice: an old ticket of some slot
            done.append(ReadDone(data.draw(st.integers(0, config.capacity - 1)),
                                 data.draw(st.integers(0, ref.next_ticket))))
        for notice in done:
            ref, _ = step(ref, notice)
        if data.draw(st.booleans(), label="batched"):
            fast.read_done_many((n.slot, n.ticket) for n in done)
        else:
            assert all(fast.step(n) == () for n in done)
        if data.draw(st.integers(0, 5)) == 0:  # an illegal event: refused by both, nothing changes
            bad = data.draw(st.sampled_from(illegal_events(ref)), label="illegal")
            _, ref_err = outcome(step, ref, bad)
            if isinstance(ref_err, CacheProtocolError):
                _, fast_err = outcome(fast.step, bad)
                assert type(fast_err) is CacheProtocolError and str(fast_err) == str(ref_err)
                assert_same_state(ref, fast)
        ref_out, ref_err = outcome(step, ref, event)
        actions, fast_err = outcome(fast.step, event)
        if ref_err is not None:  # only a full arena: the sequences are legal
            assert isinstance(ref_err, CacheFullError) and config.capacity < config.min_capacity
            assert type(fast_err) is CacheFullError and str(fast_err) == str(ref_err), f"event {i}: {event}"
            with pytest.raises(CacheProtocolError, match="failed earlier"):
                fast.step(event)
            return
        assert fast_err is None, f"event {i}: {event}: the twin raised {fast_err!r}"
        ref, ref_actions = ref_out
        assert actions == ref_actions, f"event {i}: {event}"
        if i % 7 == 0 or isinstance(event, (BeginWindow, HoldRegion)):
            assert_same_state(ref, fast)
    assert_same_state(ref, fast)


class TwinMachine(CacheMachine):
    """The reference machine's rules and invariants, with FastCache stepped beside it."""

    def twin(self) -> FastCache:
        if getattr(self, "fast", None) is None or self.fast.config is not self.config:
            self.fast = FastCache(self.config)
        return self.fast

    def apply(self, event):
        actions, err = outcome(self.twin().step, event)
        ref_actions = super().apply(event)  # None: the reference found the arena full and started over
        if ref_actions is None:
            assert type(err) is CacheFullError
            self.fast = FastCache(self.config)
        else:
            assert err is None and actions == ref_actions, event
        return ref_actions

    def teardown(self):
        if self.live:
            assert_same_state(self.state, self.twin())


class SmallArenaTwinMachine(TwinMachine):
    below_min = True


TestTwinMachine = TwinMachine.TestCase
TestTwinMachine.settings = settings(settings.default, stateful_step_count=60)
TestSmallArenaTwin = SmallArenaTwinMachine.TestCase
TestSmallArenaTwin.settings = settings(settings.default, stateful_step_count=60)


def test_interface_the_streamer_uses():
    config = CacheConfig(capacity=12, n_layers=2, n_experts=6, top_k=2, prefetch_depth=2)
    ref, fast = ReferenceCache(config), open_cache(config)
    assert isinstance(fast, FastCache) and isinstance(open_cache(config, reference=True), ReferenceCache)
    reads = []
    for event in (BeginWindow(), AtLayer(0, (3, 1)), AfterLayer(0, (2, 5)), AtLayer(1, (2, 4))):
        actions = fast.step(event)
        assert actions == ref.step(event)
        reads += [(a.slot, a.ticket) for a in actions if isinstance(a, Read)]
    for cache in (ref, fast):
        np.testing.assert_array_equal(cache.resident_mask(0), [0, 1, 0, 1, 0, 0])
        np.testing.assert_array_equal(cache.resident_mask(1), [0, 0, 1, 0, 1, 0])  # 5: read ahead, unclaimed
        np.testing.assert_array_equal(cache.resident_mask(1, pre=True), [0, 0, 1, 0, 1, 1])
        cache.read_done_many(reads + [(0, 999), (99, 1)])  # stale and unknown notices are ignored
    assert_same_state(ref.state(), fast)
    assert fast.totals.readahead_hits == 1 and fast.turn.urgent_misses == 1
    mask = fast.resident_mask(1)
    mask[:] = True  # a copy: the caller may keep or change it
    assert not fast.resident_mask(1)[0]
    assert fast.state().phase == Phase.AFTER_LAYER
