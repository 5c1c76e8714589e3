"""Hand-worked scenarios from design §5 with exact slot contents and actions.

Slot tables read 'F' free, 'L' limbo, 'R<layer>:<expert>' claimed, 'P<layer>:<expert>' read
ahead, '*' pinned by the current stamp. Fresh arenas hand out free slots lowest first.
"""

from __future__ import annotations

import pytest

from strata.errors import ArenaTooSmallError, ConfigError
from strata.cache.machine import initial_state, lru_order, slot_table, step, victim
from strata.cache.types import (
    DECISIONS, AfterLayer, AtLayer, BeginWindow, CacheConfig, CacheFullError, CacheProtocolError, Cancel,
    Evict, HoldRegion, Read, ReadDone, Use, WaitFor, min_capacity,
)

SMALL = CacheConfig(capacity=8, n_layers=2, n_experts=8, top_k=2, prefetch_depth=2)  # = min_capacity


def play(events, config=SMALL, state=None):
    """Step through events; return the final state and each event's actions."""
    s = state if state is not None else initial_state(config)
    out = []
    for event in events:
        s, actions = step(s, event)
        out.append(actions)
    return s, out


def decisions(actions):
    return tuple(a for a in actions if isinstance(a, DECISIONS))


def test_smallest_legal_capacity():
    assert min_capacity(48, 10, 16) == 48 * 10 + 2 * 16  # a window's selections + PRE + limbo
    assert min_capacity(48, 10, 16, split_turn=False) == 48 * 10 + 16
    assert min_capacity(48, 10, 16, window=2) == 48 * 20 + 32
    assert min_capacity(48, 10, 16, prefetch2=True) == 480 + 5 * 16
    assert min_capacity(2, 3, 5, n_experts=4) == 2 * 3 + 2 * 4  # K can't exceed the experts
    assert SMALL.min_capacity == 8


def test_a_miss_then_a_hit():
    s, (_, acts) = play([BeginWindow(), AtLayer(0, (3, 5))])
    assert acts == (Read(0, 0, 3, True, 1), Read(1, 0, 5, True, 2), WaitFor((0, 1)), Use(0, (3, 5), (0, 1)))
    assert slot_table(s) == ("R0:3*", "R0:5*", "F", "F", "F", "F", "F", "F")
    assert lru_order(s) == (1, 0, 7, 6, 5, 4, 3, 2)
    assert s.turn.urgent_misses_by_rank == (1, 1) and s.turn.reads_issued == 2
    s, acts = play([AfterLayer(0), AtLayer(1, (0,)), AfterLayer(1), BeginWindow(), AtLayer(0, (5, 3))], state=s)
    assert acts[-1] == (Use(0, (5, 3), (1, 0)),)  # two hits: no read, no wait
    assert s.turn.hits == 2 and s.turn.urgent_misses == 0
    assert lru_order(s)[:2] == (0, 1)  # touched in rank order: 5 then 3
    assert slot_table(s)[:3] == ("R0:3*", "R0:5*", "R1:0")  # 1:0 is from the previous window


def _up_to_readahead():
    return [BeginWindow(), AtLayer(0, (3, 5)), AfterLayer(0, (1, 4))]


def test_readahead_hit():
    s, acts = play(_up_to_readahead())
    assert acts[2] == (Read(2, 1, 1, False, 3), Read(3, 1, 4, False, 4))
    assert slot_table(s) == ("R0:3*", "R0:5*", "P1:1*", "P1:4*", "F", "F", "F", "F")
    assert s.slot_of(1, 4) == -1  # a read-ahead is not in smap until claimed
    s, acts = play([ReadDone(2, 3), ReadDone(3, 4), AtLayer(1, (4, 6))], state=s)
    assert acts[2] == (Read(4, 1, 6, True, 5), WaitFor((4,)), Use(1, (4, 6), (3, 4)))
    assert slot_table(s) == ("R0:3*", "R0:5*", "P1:1*", "R1:4*", "R1:6*", "F", "F", "F")
    assert s.turn.readahead_hits == 1 and s.turn.late_readaheads == 0
    assert s.turn.urgent_misses_by_rank == (0, 1)


def test_late_readahead_waits_but_decides_the_same():
    on_time, on_time_acts = play(_up_to_readahead() + [ReadDone(2, 3), ReadDone(3, 4), AtLayer(1, (4, 6))])
    s, acts = play(_up_to_readahead() + [AtLayer(1, (4, 6))])
    assert acts[-1] == (Read(4, 1, 6, True, 5), WaitFor((3, 4)), Use(1, (4, 6), (3, 4)))
    assert s.turn.late_readaheads == 1 and s.turn.readahead_hits == 1
    assert decisions(acts[-1]) == decisions(on_time_acts[-1])
    assert slot_table(s) == slot_table(on_time)


def test_retired_readahead_passes_through_limbo():
    s, _ = play(_up_to_readahead() + [AtLayer(1, (4, 6))])
    s, (acts,) = play([AfterLayer(1)], state=s)
    assert acts == (Cancel(2, 3),)  # 1:1 was never claimed; its read is still in flight
    assert slot_table(s) == ("R0:3*", "R0:5*", "L", "R1:4*", "R1:6*", "F", "F", "F")
    assert s.limbo == (2,) and s.inflight[2]
    # Next window: limbo is not a victim, even though the window's misses need slots.
    s, (_, acts) = play([BeginWindow(), AtLayer(0, (0, 1))], state=s)
    assert decisions(acts) == (Read(5, 0, 0, True, 6), Read(6, 0, 1, True, 7), Use(0, (0, 1), (5, 6)))
    assert slot_table(s)[2] == "L"
    # After the layer: wait for it (it had a whole layer), free it to the LRU back, reuse it first.
    s, (acts,) = play([AfterLayer(0, (2,))], state=s)
    assert acts == (WaitFor((2,)), Read(2, 1, 2, False, 8))
    assert s.limbo == () and slot_table(s)[2] == "P1:2*"


def test_limbo_released_without_wait_when_its_read_is_done():
    s, _ = play(_up_to_readahead() + [AtLayer(1, (4, 6)), AfterLayer(1), ReadDone(2, 3), BeginWindow(),
                                      AtLayer(0, (0, 1))])
    s, (acts,) = play([AfterLayer(0)], state=s)
    assert acts == ()
    assert slot_table(s)[2] == "F" and lru_order(s)[-1] == 2 and victim(s) == 2


def test_limbo_frees_in_slot_order_to_the_lru_back():
    cfg = CacheConfig(capacity=12, n_layers=2, n_experts=8, top_k=2, prefetch_depth=4)
    s, _ = play([BeginWindow(), AtLayer(0, (0, 1)), AfterLayer(0, (7, 2, 5, 3)), AtLayer(1, (2,)),
                 AfterLayer(1)], config=cfg)
    assert s.limbo == (2, 4, 5)  # 1:7, 1:5, 1:3 retired; 1:2 (slot 3) claimed
    s, _ = play([BeginWindow(), AtLayer(0, (0, 1)), AfterLayer(0)], state=s)
    assert lru_order(s)[-3:] == (5, 4, 2)  # lowest slot back-most: handed out first


def _fill_then_guess(touch: bool):
    cfg = CacheConfig(capacity=8, n_layers=2, n_experts=8, top_k=2, prefetch_depth=2, prefetch_touch=touch)
    w = [BeginWindow(), AtLayer(0, (3, 5)), AfterLayer(0), AtLayer(1, (1, 2)), AfterLayer(1),
         BeginWindow(), AtLayer(0, (0, 1)), AfterLayer(0), AtLayer(1, (3, 4)), AfterLayer(1),
         BeginWindow(), AtLayer(0, (3, 5)), AfterLayer(0, (1,)), AtLayer(1, (6,))]
    return play(w, config=cfg)


def test_prefetch_touch_off_leaves_resident_guesses_where_they_are():
    s, acts = _fill_then_guess(touch=False)
    assert acts[-2] == ()  # 1:1 is resident: nothing to read, and not touched
    assert acts[-1] == (Evict(2, 1, 1), Read(2, 1, 6, True, 9), WaitFor((2,)), Use(1, (6,), (2,)))


def test_prefetch_touch_on_moves_resident_guesses_to_the_front():
    s, acts = _fill_then_guess(touch=True)
    assert acts[-2] == ()
    assert acts[-1] == (Evict(3, 1, 2), Read(3, 1, 6, True, 9), WaitFor((3,)), Use(1, (6,), (3,)))
    assert s.slot_of(1, 1) == 2  # the guessed expert survived because it was touched


def test_guesses_are_cut_to_k_and_present_ones_left_alone():
    cfg = CacheConfig(capacity=10, n_layers=3, n_experts=8, top_k=2, prefetch_depth=2)
    s, acts = play([BeginWindow(), AtLayer(0, (3, 5)), AfterLayer(0, (1, 4, 6))], config=cfg)
    assert acts[-1] == (Read(2, 1, 1, False, 3), Read(3, 1, 4, False, 4))  # the third guess is past K
    s, acts = play([AtLayer(1, (1, 2)), AfterLayer(1, (0, 1)), AtLayer(2, (0, 1)), AfterLayer(2),
                    BeginWindow(), AtLayer(0, (3, 5)), AfterLayer(0, (1, 2))], state=s)
    assert acts[-1] == ()  # 1:1 and 1:2 are resident: nothing to read
    s, acts = play([AtLayer(1, (0,)), AfterLayer(1, (0, 4))], state=s)
    assert [(a.layer, a.expert) for a in acts[-1] if isinstance(a, Read)] == [(2, 4)]  # 2:0 resident


def test_prompt_region_passes_and_readahead():
    cfg = CacheConfig(capacity=8, n_layers=2, n_experts=12, top_k=2, prefetch_depth=2)
    s, acts = play([HoldRegion(True), BeginWindow(), AtLayer(0, tuple(range(10)))], config=cfg)
    assert acts[0] == () and acts[1] == ()
    first = tuple(Read(i, 0, i, True, i + 1) for i in range(8))
    assert acts[2] == first + (WaitFor(tuple(range(8))), Use(0, tuple(range(8)), tuple(range(8))),
                               Evict(0, 0, 0), Read(0, 0, 8, True, 9), Evict(1, 0, 1), Read(1, 0, 9, True, 10),
                               WaitFor((0, 1)), Use(0, (8, 9), (0, 1)))
    assert s.turn.prompt_passes == 2 and s.turn.prompt_misses == 10 and s.turn.urgent_misses == 0
    assert s.stamp == 2  # a prompt stamp per layer and per extra pass
    s, (acts,) = play([AfterLayer(0, (0, 5, 11))], state=s)
    assert acts == (Evict(2, 0, 2), Read(2, 1, 0, False, 11), Evict(3, 0, 3), Read(3, 1, 5, False, 12))
    s, (acts,) = play([AtLayer(1, (5, 6, 7))], state=s)
    assert acts == (Evict(4, 0, 4), Read(4, 1, 6, True, 13), Evict(5, 0, 5), Read(5, 1, 7, True, 14),
                    WaitFor((3, 4, 5)), Use(1, (5, 6, 7), (3, 4, 5)))  # 1:5 claimed first (late)
    s, acts = play([AfterLayer(1), HoldRegion(False)], state=s)
    assert acts == [(Cancel(2, 11),), (WaitFor((2,)),)]  # limbo released at the region's end
    assert slot_table(s) == ("R0:8", "R0:9", "F", "R1:5*", "R1:6*", "R1:7*", "R0:6", "R0:7")
    assert not s.prompt and s.limbo == ()


def test_prompt_evicts_unclaimed_readaheads_and_stops_reading_ahead_when_full():
    cfg = CacheConfig(capacity=8, n_layers=2, n_experts=12, top_k=2, prefetch_depth=2)
    s, acts = play([HoldRegion(True), BeginWindow(), AtLayer(0, tuple(range(8))), AfterLayer(0, (0, 5))],
                   config=cfg)
    assert acts[-1] == ()  # the pass pinned all 8 slots: read-ahead is optional in a prompt
    s, acts = play([HoldRegion(True), BeginWindow(), AtLayer(0, tuple(range(10))), AfterLayer(0, (0, 5))],
                   config=cfg)
    layer1 = (1, 2, 3, 4, 6, 7, 8, 9)  # neither read-ahead (1:0 in slot 2, 1:5 in slot 3) is used
    s, (acts,) = play([AtLayer(1, layer1)], state=s)
    assert acts == (Evict(4, 0, 4), Read(4, 1, 1, True, 13), Evict(5, 0, 5), Read(5, 1, 2, True, 14),
                    Evict(6, 0, 6), Read(6, 1, 3, True, 15), Evict(7, 0, 7), Read(7, 1, 4, True, 16),
                    Evict(0, 0, 8), Read(0, 1, 6, True, 17), Evict(1, 0, 9), Read(1, 1, 7, True, 18),
                    Cancel(2, 11), WaitFor((2,)), Evict(2, 1, 0), Read(2, 1, 8, True, 19),
                    Cancel(3, 12), WaitFor((3,)), Evict(3, 1, 5), Read(3, 1, 9, True, 20),
                    WaitFor((4, 5, 6, 7, 0, 1, 2, 3)), Use(1, layer1, (4, 5, 6, 7, 0, 1, 2, 3)))
    s, (acts,) = play([AfterLayer(1)], state=s)
    assert acts == ()  # nothing left to retire


def test_old_in_turn_order_frees_unused_readaheads_before_the_lookups():
    cfg = CacheConfig(capacity=6, n_layers=2, n_experts=8, top_k=2, prefetch_depth=2, split_turn=False)
    assert cfg.min_capacity == 6
    s, acts = play(_up_to_readahead() + [AtLayer(1, (4, 6))], config=cfg)
    assert acts[2] == (Read(2, 1, 1, False, 3), Read(3, 1, 4, False, 4))
    assert acts[3] == (Cancel(2, 3), WaitFor((2,)),  # the reference engine's MoCE wait, inside the turn
                       Read(2, 1, 6, True, 5), WaitFor((3, 2)), Use(1, (4, 6), (3, 2)))
    s, (acts,) = play([AfterLayer(1)], state=s)
    assert acts == () and s.limbo == ()
    assert slot_table(s) == ("R0:3*", "R0:5*", "R1:6*", "R1:4*", "F", "F")


def test_prefetch2_reads_two_layers_ahead_and_keeps_them_past_the_next_retire():
    cfg = CacheConfig(capacity=16, n_layers=3, n_experts=8, top_k=2, prefetch_depth=2, prefetch2=True)
    s, acts = play([BeginWindow(), AtLayer(0, (3, 5)), AfterLayer(0, (1,), (2, 7))], config=cfg)
    assert acts[-1] == (Read(2, 1, 1, False, 3), Read(3, 2, 2, False, 4), Read(4, 2, 7, False, 5))
    s, acts = play([AtLayer(1, (0,)), AfterLayer(1, (2, 6))], state=s)
    assert acts[-1] == (Cancel(2, 3), Read(6, 2, 6, False, 7))  # 2:2 already read ahead: left alone
    assert slot_table(s)[2:7] == ("L", "P2:2*", "P2:7*", "R1:0*", "P2:6*")
    s, acts = play([AtLayer(2, (7, 2))], state=s)
    assert s.turn.readahead_hits == 2 and decisions(acts[-1]) == (Use(2, (7, 2), (4, 3)),)


def test_no_victim_is_a_clear_error():
    cfg = CacheConfig(capacity=3, n_layers=2, n_experts=8, top_k=2, prefetch_depth=0)
    s, _ = play([BeginWindow(), AtLayer(0, (0, 1)), AfterLayer(0)], config=cfg)
    with pytest.raises(CacheFullError, match=r"3 slots .*3 pinned.*at least 4 slots") as err:
        step(s, AtLayer(1, (2, 3)))
    assert isinstance(err.value, ArenaTooSmallError)
    assert slot_table(s) == ("R0:0*", "R0:1*", "F")  # the failed step changed nothing


def test_min_capacity_is_tight_with_the_split_turn():
    """At one slot less than min_capacity, pinned selections + a layer's read-aheads + the
    previous layer's limbo leave no victim."""
    events = [BeginWindow(), AtLayer(0, (0,)), AfterLayer(0, (1,)), AtLayer(1, (2,)), AfterLayer(1, (3,)),
              AtLayer(2, (4,))]
    cfg = CacheConfig(capacity=5, n_layers=3, n_experts=8, top_k=1, prefetch_depth=1)
    assert cfg.min_capacity == 5
    s, _ = play(events, config=cfg)
    assert slot_table(s) == ("R0:0*", "L", "R1:2*", "P2:3*", "R2:4*")
    tight = CacheConfig(capacity=4, n_layers=3, n_experts=8, top_k=1, prefetch_depth=1)
    with pytest.raises(CacheFullError):
        play(events, config=tight)


def test_layer_pins_need_one_layers_selections_and_are_tight():
    """With layer_pins a decode pin lasts one layer's turn: the same turns run on one layer's
    selections plus PRE and limbo (1 + 2 = 3 slots, not 5), earlier layers' slots are reused,
    and one slot less has no victim."""
    events = [BeginWindow(), AtLayer(0, (0,)), AfterLayer(0, (1,)), AtLayer(1, (2,)), AfterLayer(1, (3,)),
              AtLayer(2, (4,))]
    cfg = CacheConfig(capacity=3, n_layers=3, n_experts=8, top_k=1, prefetch_depth=1, layer_pins=True)
    assert cfg.min_capacity == 3 and min_capacity(48, 10, 16, layer_pins=True) == 10 + 2 * 16
    s, _ = play(events, config=cfg)
    assert slot_table(s) == ("P2:3", "L", "R2:4*")  # layer 0's slot took layer 2's read-ahead
    tight = CacheConfig(capacity=2, n_layers=3, n_experts=8, top_k=1, prefetch_depth=1, layer_pins=True)
    with pytest.raises(CacheFullError):
        play(events, config=tight)


def test_stale_read_done_changes_nothing():
    s, _ = play(_up_to_readahead())
    assert step(s, ReadDone(2, 99)) == (s, ())  # wrong ticket
    assert step(s, ReadDone(0, 1)) == (s, ())  # slot 0's read was waited for already
    assert step(s, ReadDone(50, 1)) == (s, ())  # no such slot
    done, acts = step(s, ReadDone(2, 3))
    assert acts == () and not done.inflight[2] and s.inflight[2]


@pytest.mark.parametrize("events, message", [
    ([AtLayer(0, (1,))], "expected BeginWindow"),
    ([BeginWindow(), AtLayer(1, (1,))], r"expected AtLayer\(0\)"),
    ([BeginWindow(), AtLayer(0, (1,)), AfterLayer(1)], r"expected AfterLayer\(0\)"),
    ([BeginWindow(), AtLayer(0, (1, 1))], "distinct"),
    ([BeginWindow(), AtLayer(0, (1, 2, 3))], "at most 2"),
    ([BeginWindow(), AtLayer(0, (8,))], r"in \[0, 8\)"),
    ([BeginWindow(), HoldRegion(True)], "expected AtLayer"),
    ([HoldRegion(False)], "not held"),
    ([BeginWindow(), AtLayer(0, (1,)), AfterLayer(0, (2, 2))], "distinct"),
    (["not an event"], "not a cache event"),
])
def test_protocol_errors(events, message):
    with pytest.raises(CacheProtocolError, match=message):
        play(events)


def test_states_are_immutable():
    s0 = initial_state(SMALL)
    s1, _ = step(s0, BeginWindow())
    with pytest.raises(ValueError):
        s1.pin[0] = 5
    with pytest.raises(AttributeError):
        s1.stamp = 9
    s2, _ = step(s1, AtLayer(0, (1, 2)))
    assert slot_table(s1) == ("F",) * 8 and slot_table(s2)[:2] == ("R0:1*", "R0:2*")
    again, _ = step(s1, AtLayer(0, (1, 2)))  # the old state is still a valid starting point
    assert slot_table(again) == slot_table(s2)


@pytest.mark.parametrize("fields, message", [
    (dict(capacity=0), "capacity must be a positive int"),
    (dict(top_k=9), "top_k 9 > n_experts 8"),
    (dict(prefetch_depth=-1), "prefetch_depth"),
    (dict(split_turn=1), "split_turn must be a bool"),
])
def test_config_rejects_bad_values(fields, message):
    base = dict(capacity=8, n_layers=2, n_experts=8, top_k=2)
    with pytest.raises(ConfigError, match=message):
        CacheConfig(**{**base, **fields})
    with pytest.raises(TypeError):
        CacheConfig(**base, prefetch=16)  # unknown knob


def test_empty_selection_and_a_prompt_pass_that_cannot_start():
    """Drop-tail may leave a layer with nothing to compute; a prompt layer then pins nothing,
    so its retired read-aheads can fill the arena: the next pass can't start (a clear error)."""
    s, acts = play([BeginWindow(), AtLayer(0, ())])
    assert acts[-1] == (Use(0, (), ()),) and s.turn.lookups == 0
    cfg = CacheConfig(capacity=2, n_layers=3, n_experts=8, top_k=1, prefetch_depth=2)
    s, acts = play([HoldRegion(True), BeginWindow(), AtLayer(0, ()), AfterLayer(0, (1, 2)), AtLayer(1, ()),
                    AfterLayer(1)], config=cfg)
    assert s.limbo == (0, 1)
    with pytest.raises(CacheFullError, match="2 in limbo"):
        step(s, AtLayer(2, (3,)))


def test_stats_delta_and_sum_are_inverse_field_by_field():
    """The one count arithmetic (runtime report, replay, quality): a by-rank tuple missing on one
    side counts as zeros, and (a + b) - b == a in every field."""
    from strata.cache.types import CacheStats, stats_delta, stats_sum

    a = CacheStats(windows=3, lookups=20, hits=15, urgent_misses=2, urgent_misses_by_rank=(1, 0, 1), reads_issued=7)
    b = CacheStats(windows=1, lookups=4, hits=4)  # a fresh state's totals: no by-rank tuple yet
    total = stats_sum(a, b)
    assert total.lookups == 24 and total.urgent_misses_by_rank == (1, 0, 1)
    assert stats_delta(total, b) == a
    assert stats_delta(a, a) == CacheStats(urgent_misses_by_rank=(0, 0, 0))
