"""Checks shared by the expert-cache tests: the state's structural invariants, and a model of
the runtime (`IoModel`) that applies the actions and fails when they would let the GPU read a
slot being written, overwrite a slot the current window reads, or overlap two reads in one slot."""

from __future__ import annotations

import numpy as np

from strata.cache.machine import CacheState, step, victim
from strata.cache.types import (
    AfterLayer, AtLayer, BeginWindow, Cancel, Evict, HoldRegion, Phase, Read, ReadDone, SlotState, Use,
    WaitFor,
)

FREE, RES, PRE, LIMBO = (int(s) for s in SlotState)
_ARRAYS = ("slot_state", "slot_key", "pin", "tick", "ticket", "inflight", "smap", "pmap",
           "turn_counts", "total_counts")


def snapshot(state: CacheState) -> dict:
    return {name: getattr(state, name).copy() for name in _ARRAYS}


def assert_unchanged(state: CacheState, before: dict) -> None:
    """Purity: a state's arrays are read-only and equal to what they were before a step."""
    for name, value in before.items():
        array = getattr(state, name)
        assert not array.flags.writeable, name
        assert np.array_equal(array, value), f"step changed the old state's {name}"


def check_structure(state: CacheState) -> None:
    """Invariants that hold after every step."""
    cfg = state.config
    cap, E = cfg.capacity, cfg.n_experts
    ss, key, pin = state.slot_state.tolist(), state.slot_key.tolist(), state.pin.tolist()
    inflight = state.inflight.tolist()
    assert len(ss) == cap and len(state.smap) == cfg.n_layers * E  # capacity is never exceeded
    held = [key[s] for s in range(cap) if ss[s] in (RES, PRE)]
    assert len(held) == len(set(held)), "a (layer, expert) in two slots"
    for s in range(cap):
        if ss[s] == RES:
            assert state.smap[key[s]] == s and state.pmap[key[s]] == -1
            assert not inflight[s], "a claimed slot is still reading after its turn"
        elif ss[s] == PRE:
            assert state.pmap[key[s]] == s and state.smap[key[s]] == -1
        else:
            assert key[s] == -1 and pin[s] != state.stamp
            if ss[s] == FREE:
                assert not inflight[s]
    smap, pmap = state.smap.tolist(), state.pmap.tolist()
    for k in range(len(smap)):
        assert smap[k] == -1 or (ss[smap[k]] == RES and key[smap[k]] == k), "smap and slot states disagree"
        assert pmap[k] == -1 or (ss[pmap[k]] == PRE and key[pmap[k]] == k), "read-ahead map disagrees"
    assert len(set(state.tick.tolist())) == cap, "LRU order is not strict"
    n_pre, n_limbo = ss.count(PRE), ss.count(LIMBO)
    per_layer = cfg.prefetch_depth
    assert n_pre <= (3 if cfg.prefetch2 else 1) * per_layer
    assert n_limbo <= (2 if cfg.prefetch2 else 1) * per_layer
    if not cfg.split_turn:
        assert n_limbo == 0, "limbo is a split-turn thing"
    if state.phase == Phase.IDLE:
        assert n_pre == 0, "a read-ahead outlived its window"
    totals = state.totals
    assert totals.urgent_misses == sum(totals.urgent_misses_by_rank)
    assert totals.reads_issued == state.next_ticket - 1
    assert totals.late_readaheads <= totals.readahead_hits
    check_victim(state)


def check_victim(state: CacheState) -> None:
    """victim() is the LRU-back-most slot that is unpinned, not LIMBO and (decode) not PRE."""
    ss, pin, tick = state.slot_state.tolist(), state.pin.tolist(), state.tick.tolist()
    eligible = [s for s in range(len(ss)) if pin[s] != state.stamp and ss[s] != LIMBO
                and not (ss[s] == PRE and not state.prompt)]
    expected = min(eligible, key=lambda s: tick[s]) if eligible else -1
    assert victim(state) == expected


class IoModel:
    """What the runtime would do with the actions, with the checks a real one relies on."""

    def __init__(self, capacity: int, layer_pins: bool = False):
        self.layer_pins = layer_pins  # the GPU has finished layer l's reads when AtLayer(l+1) comes
        self.content: list = [None] * capacity  # (layer, expert) the slot holds or is receiving
        self.reading: list = [None] * capacity  # ticket of a read that may still be writing
        self.last_ticket: list = [None] * capacity
        self.window: set[int] = set()  # slots the GPU may read during this decode window
        self.prompt = False

    def event(self, event) -> None:
        if isinstance(event, ReadDone) and self.reading[event.slot] == event.ticket:
            self.reading[event.slot] = None
        elif isinstance(event, (BeginWindow, HoldRegion)):
            self.window = set()  # the previous window's command buffer has finished
            if isinstance(event, HoldRegion):
                self.prompt = event.begin
        elif isinstance(event, AtLayer) and self.layer_pins:
            self.window = set()  # the last layer's compute has finished

    def apply(self, actions) -> None:
        for a in actions:
            if isinstance(a, Read):
                assert self.reading[a.slot] is None, f"{a}: the slot's previous read may still be writing"
                assert a.slot not in self.window, f"{a}: overwrites a slot this window reads"
                self.content[a.slot] = (a.layer, a.expert)
                self.reading[a.slot] = a.ticket
                self.last_ticket[a.slot] = a.ticket
            elif isinstance(a, Evict):
                assert self.content[a.slot] == (a.layer, a.expert), a
                assert a.slot not in self.window, f"{a}: evicts a slot this window reads"
                self.content[a.slot] = None
            elif isinstance(a, Cancel):
                assert a.ticket == self.last_ticket[a.slot], f"{a}: not the slot's last read"
            elif isinstance(a, WaitFor):
                assert a.slots, "an empty wait"
                for s in a.slots:
                    assert self.reading[s] is not None, f"{a}: waits for slot {s}, which is known done"
                    self.reading[s] = None
            elif isinstance(a, Use):
                assert len(set(a.slots)) == len(a.slots)
                for e, s in zip(a.experts, a.slots):
                    assert self.content[s] == (a.layer, e), f"{a}: slot {s} holds {self.content[s]}"
                    assert self.reading[s] is None, f"{a}: the GPU would read slot {s} while it is written"
                if not self.prompt:
                    self.window |= set(a.slots)
            else:
                raise AssertionError(f"unknown action {a!r}")


def pending_reads(state: CacheState) -> list[ReadDone]:
    """ReadDone notices the runtime could send now (reads not yet known complete)."""
    return [ReadDone(int(s), int(state.ticket[s])) for s in np.flatnonzero(state.inflight)]


def drive(state: CacheState, event, io: IoModel | None = None):
    """step() with the purity and I/O checks; returns (state, actions)."""
    before = snapshot(state)
    new, actions = step(state, event)
    assert_unchanged(state, before)
    assert isinstance(actions, tuple)
    if isinstance(event, ReadDone):
        assert actions == ()
    if io is not None:
        io.event(event)
        io.apply(actions)
    return new, actions


__all__ = ["snapshot", "assert_unchanged", "check_structure", "check_victim", "IoModel", "pending_reads",
           "drive", "AfterLayer", "AtLayer"]
