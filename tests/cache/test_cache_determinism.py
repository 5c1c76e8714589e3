"""design §5's determinism invariant: which slot holds what at every decision point depends only
on the turns and the configuration, never on I/O timing.

The same turn sequence is run with ReadDone notices never sent, sent at once for every read,
and sent at hypothesis-drawn points (including stale ones). The decisions (Read, Cancel, Evict,
Use) and the decision view of every state must match exactly; only the WaitFor lists and the
late count may differ, and only in the direction timing explains.
"""

from __future__ import annotations

from hypothesis import given
from hypothesis import strategies as st

from cache_checks import IoModel, drive, pending_reads
from strata.cache.machine import decision_view, initial_state
from strata.cache.types import DECISIONS, ReadDone, WaitFor
from strategies import cache_configs, cache_turn_sequences

NEVER, AT_ONCE = "never", "at once"


def run(config, turns, notices):
    """Returns per turn event: (decisions, decision view, waited slots), and the final state.
    `notices`: NEVER, AT_ONCE, or a hypothesis `data` drawing which reads complete when."""
    state, io, trace = initial_state(config), IoModel(config.capacity, config.layer_pins), []
    for event in turns:
        pending = pending_reads(state)
        if notices == AT_ONCE:
            done = pending
        elif notices == NEVER:
            done = []
        else:
            done = notices.draw(st.lists(st.sampled_from(pending), unique=True) if pending else st.just([]))
            if notices.draw(st.booleans()):  # a stale notice: an old ticket of some slot
                done = done + [ReadDone(notices.draw(st.integers(0, config.capacity - 1)),
                                        notices.draw(st.integers(0, state.next_ticket)))]
        for notice in done:
            state, _ = drive(state, notice, io)
        state, actions = drive(state, event, io)
        waited = frozenset(s for a in actions if isinstance(a, WaitFor) for s in a.slots)
        trace.append((tuple(a for a in actions if isinstance(a, DECISIONS)), decision_view(state), waited))
    return trace, state


@given(data=st.data())
def test_decisions_do_not_depend_on_read_completion(data):
    config = data.draw(cache_configs(), label="config")
    turns = data.draw(cache_turn_sequences(config), label="turns")
    never, s_never = run(config, turns, NEVER)
    at_once, s_at_once = run(config, turns, AT_ONCE)
    drawn, s_drawn = run(config, turns, data)
    for i, (a, b, c) in enumerate(zip(never, at_once, drawn)):
        assert a[:2] == b[:2] == c[:2], f"decisions diverge at event {i}: {turns[i]}"
        assert b[2] <= c[2] <= a[2], "a wait that timing does not explain"
    ra_hits = s_never.totals.readahead_hits
    assert s_at_once.totals.readahead_hits == s_drawn.totals.readahead_hits == ra_hits
    assert s_never.totals.late_readaheads == ra_hits  # no notice: every claimed read-ahead waits
    assert s_at_once.totals.late_readaheads == 0
    assert 0 <= s_drawn.totals.late_readaheads <= ra_hits
