"""The expert cache as a hypothesis RuleBasedStateMachine over random turn sequences (design §5).

Every step is checked for purity (the old state is untouched and read-only), against a model
of the runtime applying the actions (tests/cache_checks.py), and against the invariants: no
key in two slots, smap and slot states agree, pinned slots are never evicted or reassigned,
LIMBO and (in decode) PRE slots are never victims, capacity held, and after `at_layer` every
selected expert is RES and pinned.
"""

from __future__ import annotations

from hypothesis import settings
from hypothesis import strategies as st
from hypothesis.stateful import RuleBasedStateMachine, initialize, invariant, precondition, rule

from cache_checks import IoModel, assert_unchanged, check_structure, drive, pending_reads, snapshot
from strata.cache.machine import initial_state
from strata.cache.types import (
    AfterLayer, AtLayer, BeginWindow, CacheFullError, Evict, HoldRegion, Phase, Read, ReadDone, SlotState,
    Use,
)
from strategies import cache_configs, cache_guesses, cache_selections

RES, PRE, LIMBO = int(SlotState.RES), int(SlotState.PRE), int(SlotState.LIMBO)


def _when(phase):
    return precondition(lambda self: self.live and self.state.phase == phase)


class CacheMachine(RuleBasedStateMachine):
    below_min = False  # the arena is at least the smallest legal one: victim() never fails

    def __init__(self):
        super().__init__()
        self.state = None
        self.live = False  # set once a config is drawn

    @initialize(data=st.data())
    def setup(self, data):
        self.config = data.draw(cache_configs(below_min=self.below_min), label="config")
        self.state = initial_state(self.config)
        self.io = IoModel(self.config.capacity, self.config.layer_pins)
        self.live = True

    def apply(self, event):
        old, before = self.state, snapshot(self.state)
        try:
            new, actions = drive(old, event, self.io)
        except CacheFullError as err:
            assert self.config.capacity < self.config.min_capacity, f"legal arena reported full: {err}"
            assert f"{self.config.capacity} slots" in str(err) and "needs at least" in str(err)
            assert_unchanged(old, before)
            self.state, self.io = initial_state(self.config), IoModel(self.config.capacity, self.config.layer_pins)  # start over
            return None
        self.state = new
        _check_decode_transition(old, new, event, actions)
        return actions

    def notices(self, data):
        """0-2 ReadDone notices before the next turn event: genuine ones at random points, and
        stale ones (which must change nothing)."""
        for _ in range(data.draw(st.integers(0, 2), label="notices")):
            pending = pending_reads(self.state)
            if pending and data.draw(st.booleans(), label="genuine"):
                event = data.draw(st.sampled_from(pending), label="done")
            else:
                event = ReadDone(data.draw(st.integers(0, self.config.capacity - 1)),
                                 data.draw(st.integers(0, self.state.next_ticket)))
            self.apply(event)

    @_when(Phase.IDLE)
    @rule(data=st.data())
    def begin_window(self, data):
        self.notices(data)
        if data.draw(st.integers(0, 3), label="toggle region") == 0:
            actions = self.apply(HoldRegion(not self.state.prompt))
            assert not self.state.limbo, "limbo survives a region edge"
            assert all(type(a).__name__ == "WaitFor" for a in actions)
        stamp = self.state.stamp
        self.apply(BeginWindow())
        assert self.state.stamp == stamp + (0 if self.state.prompt else 1)

    @_when(Phase.AT_LAYER)
    @rule(data=st.data())
    def at_layer(self, data):
        self.notices(data)
        layer, prompt = self.state.layer, self.state.prompt
        selected = data.draw(cache_selections(self.config, prompt), label="selected")
        actions = self.apply(AtLayer(layer, selected))
        if actions is None:
            return
        uses = [a for a in actions if isinstance(a, Use)]
        assert sorted(e for u in uses for e in u.experts) == sorted(selected)
        assert all(u.layer == layer for u in uses)
        if not prompt:
            assert len(uses) == 1 and uses[0].experts == selected and actions[-1] == uses[0]
        s = self.state
        for e, slot in zip(uses[-1].experts, uses[-1].slots):  # decode: all; prompt: the last pass
            assert s.slot_of(layer, e) == slot and s.slot_state[slot] == RES and s.pinned(slot)
        assert s.turn.lookups == len(selected)
        assert s.turn.hits + s.turn.readahead_hits + s.turn.urgent_misses + s.turn.prompt_misses == len(selected)

    @_when(Phase.AFTER_LAYER)
    @rule(data=st.data())
    def after_layer(self, data):
        self.notices(data)
        layer, old = self.state.layer, self.state
        guesses = data.draw(cache_guesses(self.config), label="guesses")
        guesses2 = data.draw(cache_guesses(self.config), label="guesses2")
        actions = self.apply(AfterLayer(layer, guesses, guesses2))
        if actions is None:
            return
        reads = [a for a in actions if isinstance(a, Read)]
        assert all(not a.urgent and a.layer in (layer + 1, layer + 2) for a in reads)
        wanted = {(layer + 1, g) for g in guesses[:self.config.prefetch_depth]}
        if self.config.prefetch2:
            wanted |= {(layer + 2, g) for g in guesses2[:self.config.prefetch_depth]}
        assert {(a.layer, a.expert) for a in reads} <= wanted
        if not old.prompt:  # a guess absent before is read ahead now (decode never runs out)
            for m, g in wanted:
                if m < self.config.n_layers and old.slot_of(m, g) < 0 and old.pmap[m * old.config.n_experts + g] < 0:
                    assert any((a.layer, a.expert) == (m, g) for a in reads)

    @invariant()
    def structure(self):
        if self.state is not None:
            check_structure(self.state)


def _check_decode_transition(old, new, event, actions) -> None:
    """Inside a decode window the stamp is fixed (with layer_pins: inside a layer's turn; AtLayer
    starts a new one): what it pins keeps its key, and victims are never LIMBO or PRE slots."""
    if old.prompt or not isinstance(event, (AtLayer, AfterLayer)):
        return
    new_turn = isinstance(event, AtLayer) and old.config.layer_pins
    assert new.stamp == old.stamp + new_turn
    E, layer = old.config.n_experts, event.layer
    freed_now = set()  # the old in-turn order frees this layer's unused read-aheads first
    if isinstance(event, AtLayer) and not old.config.split_turn:
        freed_now = {s for s in range(old.config.capacity) if old.slot_state[s] == PRE
                     and old.slot_key[s] // E == layer and old.slot_key[s] % E not in event.selected}
    for a in actions:
        if isinstance(a, (Read, Evict)) and a.slot not in freed_now and not new_turn:
            assert not old.pinned(a.slot), f"{a} hits a slot pinned by the current window"
        if isinstance(a, Evict):
            assert old.slot_state[a.slot] == RES, f"{a}: decode victims are claimed slots only"
    for s in range(old.config.capacity):
        st_old, key = int(old.slot_state[s]), int(old.slot_key[s])
        st_new, key_new = int(new.slot_state[s]), int(new.slot_key[s])
        if st_old == RES and old.pinned(s) and not new_turn:
            assert (st_new, key_new) == (RES, key) and new.pinned(s)
        if st_old == PRE and s not in freed_now:
            retired = isinstance(event, AfterLayer) and key // E == layer and old.config.split_turn
            allowed = {(LIMBO, -1)} if retired else {(PRE, key), (RES, key)}
            assert (st_new, key_new) in allowed, f"read-ahead slot {s} became {st_new} {key_new}"
        if st_old == LIMBO and isinstance(event, AtLayer):
            assert st_new == LIMBO, "limbo slot reused before release"


class SmallArenaMachine(CacheMachine):
    below_min = True  # any arena: victim() may fail, and must fail with CacheFullError


# one step = one turn event (plus notices): 60 steps cover a few windows of up to 4 layers
TestCacheMachine = CacheMachine.TestCase
TestCacheMachine.settings = settings(settings.default, stateful_step_count=60)
TestSmallArena = SmallArenaMachine.TestCase
TestSmallArena.settings = settings(settings.default, stateful_step_count=60)
