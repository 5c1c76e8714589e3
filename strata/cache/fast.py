"""The fast twin of the expert-cache state machine (design §5; STYLE §1, §2).

`FastCache(config).step(event)` returns exactly the actions that `strata.cache.machine.step`
returns for the same event sequence: same types, fields, order and tickets. It is held to the
reference by tests/cache/test_cache_fast.py (a differential hypothesis test over every knob, with
ReadDone notices and errors) and by the runtime tests, which replay the runtime's turns
through the reference. The reference stays the definition; read docs/cache.md there.

Why a twin: the reference copies its ~10 arrays on every step and scans them with numpy for
the victim, limbo and read-aheads, ~70–120 µs a turn (benchmarks/cache.py) plus a full state
rebuild per ReadDone. Here the state lives in Python lists mutated in place, and every search
the reference does over all slots is an O(1) (amortized) lookup in a structure kept beside it:

- **LRU.** The reference keeps one tick per slot; the victim is the argmin of the eligible
  ticks. Ticks fall in two groups: FREE slots have back ticks (< 0), every other slot a front
  tick (>= 0), because a slot leaves FREE only by `assign`, which touches it, and enters FREE
  only by `free`, which hands out back ticks. FREE slots are always eligible (their pin is -1),
  so the victim is the back-most FREE slot when there is one: a deque in tick order. Otherwise
  it is the oldest eligible slot of the other slots in touch order, an OrderedDict (a touch is
  one C-level `move_to_end`, ~30 ns; the doubly linked list of Python lists it replaced cost
  ~250 ns, and a decode turn touches ~10 slots).
- **Lazy skipping.** Within one stamp (and one region mode) an ineligible slot (pinned by the
  current stamp, LIMBO, or PRE in decode) stays ineligible until it moves: a pin lasts the
  stamp, LIMBO leaves only by `free`, and a PRE slot leaves PRE only by a claim (which touches
  it) or by retirement to LIMBO. So a victim search moves the ineligible slots it passes at
  the old end of the LRU into `_skipped` (oldest first; every one older than every slot still
  in the LRU) and the next search starts after them. A touch or a free takes a slot out of
  `_skipped`; a new stamp or region mode puts them all back at the old end, in order. Each
  slot is skipped at most once per stamp unless it moves, and the victim is the reference's
  argmin exactly.
- **Limbo and read-aheads** are kept as a set and per-layer sets, sorted (they are at most a
  few K) where the reference walks slots in slot order.

Counters: `_count` holds the totals and `_mark` a copy of them taken when the current turn
began (AtLayer), so an increment touches one list and a turn starts with one list copy; the
turn's counts are the difference. `decision_view()` and `state()` rebuild the reference's
`CacheState` (slow, for tests and debugging).

Actions are built by `_read`, `_use`, ... below: the same frozen dataclass instances, equal to
the ones the reference builds, without the dataclass `__init__` (its `object.__setattr__` per
field made a `Read` cost ~550 ns, ~350 ns this way).

Errors: a `CacheProtocolError` is raised before anything changes, as in the reference. A
`CacheFullError` is raised at the same point as the reference's, but the reference's input
state survives it and this object's does not: it is marked failed, and every later step
raises (the runtime treats the error as fatal anyway).
"""

from __future__ import annotations

from collections import OrderedDict, deque
from collections.abc import Iterable
from dataclasses import fields
from operator import itemgetter, sub
from typing import Protocol

import numpy as np

from strata.cache.machine import step
from strata.cache.state import (
    _AFTER, _AT, _CANCELLED, _DECODE_TURNS, _EVICTIONS, _FIELDS, _HITS, _IDLE, _LATE, _LOOKUPS, _PASSES,
    _PROMPT_MISSES, _PROMPT_TURNS, _RA_HITS, _RANK0, _READS, _READS_AHEAD, _URGENT, _WINDOWS, FREE, LIMBO,
    PRE, RES, CacheState, _frozen, decision_view, initial_state,
)
from strata.cache.types import (
    AfterLayer, AtLayer, BeginWindow, CacheConfig, CacheFullError, CacheProtocolError, CacheStats, Cancel,
    Evict, HoldRegion, Read, ReadDone, Use, WaitFor,
)

__all__ = ["ExpertCache", "FastCache", "ReferenceCache", "open_cache"]

_NONE = -1


# ------------------------------------------------------------------ action builders


def _setters(cls, names: tuple[str, ...]) -> tuple:
    """The slot descriptors' setters of a frozen, slotted action dataclass, in field order."""
    if tuple(f.name for f in fields(cls)) != names:
        raise AssertionError(f"fast cache: {cls.__name__}'s fields are not {names}: update its builder")
    return tuple(cls.__dict__[n].__set__ for n in names)


_new = object.__new__
_READ_SLOT, _READ_LAYER, _READ_EXPERT, _READ_URGENT, _READ_TICKET = _setters(
    Read, ("slot", "layer", "expert", "urgent", "ticket"))
_USE_LAYER, _USE_EXPERTS, _USE_SLOTS = _setters(Use, ("layer", "experts", "slots"))
_EVICT_SLOT, _EVICT_LAYER, _EVICT_EXPERT = _setters(Evict, ("slot", "layer", "expert"))
_CANCEL_SLOT, _CANCEL_TICKET = _setters(Cancel, ("slot", "ticket"))
(_WAIT_SLOTS,) = _setters(WaitFor, ("slots",))


def _read(slot: int, layer: int, expert: int, urgent: bool, ticket: int) -> Read:
    a = _new(Read)
    _READ_SLOT(a, slot)
    _READ_LAYER(a, layer)
    _READ_EXPERT(a, expert)
    _READ_URGENT(a, urgent)
    _READ_TICKET(a, ticket)
    return a


def _use(layer: int, experts: tuple, slots: tuple) -> Use:
    a = _new(Use)
    _USE_LAYER(a, layer)
    _USE_EXPERTS(a, experts)
    _USE_SLOTS(a, slots)
    return a


def _evict(slot: int, layer: int, expert: int) -> Evict:
    a = _new(Evict)
    _EVICT_SLOT(a, slot)
    _EVICT_LAYER(a, layer)
    _EVICT_EXPERT(a, expert)
    return a


def _cancel(slot: int, ticket: int) -> Cancel:
    a = _new(Cancel)
    _CANCEL_SLOT(a, slot)
    _CANCEL_TICKET(a, ticket)
    return a


def _wait_for(slots: tuple) -> WaitFor:
    a = _new(WaitFor)
    _WAIT_SLOTS(a, slots)
    return a


class ExpertCache(Protocol):
    """What the runtime's Streamer needs from a cache machine (FastCache or ReferenceCache)."""

    config: CacheConfig

    def step(self, event) -> tuple: ...

    def read_done_many(self, notices: Iterable[tuple[int, int]]) -> None: ...

    def resident_mask(self, layer: int, *, pre: bool = False) -> np.ndarray: ...

    @property
    def totals(self) -> CacheStats: ...

    def state(self) -> CacheState: ...


def open_cache(config: CacheConfig, *, reference: bool = False) -> ExpertCache:
    """The runtime's cache machine: the fast twin, or (reference=True) the pure reference."""
    return ReferenceCache(config) if reference else FastCache(config)


class FastCache:
    """A mutable expert cache that takes the reference machine's decisions (see the module doc).

    `step(event) -> actions` is the twin of `strata.cache.machine.step(state, event)`;
    `read_done_many(notices)` applies (slot, ticket) notices in order, as ReadDone steps would.
    """

    def __init__(self, config: CacheConfig) -> None:
        self.config = cfg = config
        cap, n_keys = cfg.capacity, cfg.n_layers * cfg.n_experts
        self._E = cfg.n_experts
        self._cap = cap
        self._n_layers = cfg.n_layers
        self._max_selected = cfg.max_selected
        self._split = cfg.split_turn
        self._layer_pins = cfg.layer_pins
        # the reference's arrays, as lists
        self._state = [FREE] * cap
        self._key = [_NONE] * cap
        self._pin = [_NONE] * cap
        self._tick = list(range(-cap, 0))
        self._ticket = [0] * cap
        self._inflight = [False] * cap
        self._smap = [_NONE] * n_keys
        # smap again, one list per layer: a decode turn looks its experts up in one C call
        self._smap_rows = [[_NONE] * cfg.n_experts for _ in range(cfg.n_layers)]
        self._experts = frozenset(range(cfg.n_experts))  # the valid expert ids
        self._pmap = [_NONE] * n_keys
        # residency masks for the runtime's MoCE bonus, kept beside smap and pmap  # [n_keys]
        # (bytearrays: an item store costs a third of a numpy array's; read through bool views)
        self._res_mask = bytearray(n_keys)
        self._pre_mask = bytearray(n_keys)
        self._res_view = np.frombuffer(self._res_mask, np.bool_)
        self._pre_view = np.frombuffer(self._pre_mask, np.bool_)
        self._stamp, self._front, self._back, self._next_ticket = 0, 0, -cap, 1
        self._phase, self._layer, self._prompt = _IDLE, 0, False
        n_counts = _RANK0 + cfg.max_selected
        self._count = [0] * n_counts  # totals
        self._mark = [0] * n_counts  # the totals when the current turn began
        # LRU: FREE slots back-most first; the others oldest first, less the skipped prefix
        self._free = deque(range(cap))
        self._lru: OrderedDict[int, None] = OrderedDict()
        self._skipped: dict[int, None] = {}  # known ineligible for this stamp and mode, oldest first
        self._limbo: set[int] = set()
        self._pre_of_layer: list[set[int]] = [set() for _ in range(cfg.n_layers)]
        self._actions: list = []
        self._failed: CacheFullError | None = None
        # an all-hit decode turn's slots, not yet pinned, ticked and moved (`_settle`)
        self._held: tuple = ()
        self._held_front = 0

    # ---------------------------------------------------------- the interface

    def step(self, event) -> tuple:
        """Apply one event; return the actions, in order (the reference's, exactly).

        The common decode turn, every selected expert a hit or a read-ahead, is taken here with
        as few calls as can be: it is the host's turn, and after a layer's compute the CPU
        caches are cold, so every function and object touched costs (benchmarks/cache_step.py
        --pollute). Its pins, ticks and LRU moves are held for `_settle`, which the next step
        starts with. Anything else (a miss, an error) takes the general path, `_at_layer`."""
        if self._failed is not None:
            raise CacheProtocolError(f"the expert cache failed earlier and cannot continue: {self._failed}")
        if self._held:
            self._settle()
        if type(event) is AtLayer and self._phase == _AT and not self._prompt and self._split:
            layer, selected = event.layer, event.selected
            n = len(selected)
            if layer == self._layer and 1 < n <= self._max_selected:
                distinct = set(selected)
                if len(distinct) == n and distinct <= self._experts:
                    found = itemgetter(*selected)(self._smap_rows[layer])
                    count = self._count
                    if _NONE not in found:
                        self._mark = count[:]
                        count[_HITS] += n
                        wait = None
                    else:
                        claimed = self._claim_all(layer, selected, found)
                        if claimed is not None:  # else a miss: the general path
                            found, wait = claimed
                    if _NONE not in found:
                        count[_LOOKUPS] += n
                        count[_DECODE_TURNS] += 1
                        self._phase = _AFTER
                        if self._layer_pins:  # `_at_layer`'s: the held pins settle with this turn's stamp
                            self._new_stamp()
                        self._held, self._held_front = found, self._front
                        self._front += n
                        use = _new(Use)
                        _USE_LAYER(use, layer)
                        _USE_EXPERTS(use, selected)
                        _USE_SLOTS(use, found)
                        return (use,) if wait is None else (wait, use)
        if isinstance(event, ReadDone):
            self._read_done(event.slot, event.ticket)
            return ()
        self._actions = actions = []
        try:
            if isinstance(event, AtLayer):
                self._at_layer(event.layer, event.selected)
            elif isinstance(event, AfterLayer):
                self._after_layer(event)
            elif isinstance(event, BeginWindow):
                self._begin_window()
            elif isinstance(event, HoldRegion):
                self._hold_region(event.begin)
            else:
                raise CacheProtocolError(f"not a cache event: {event!r}")
        except CacheFullError as err:
            self._failed = err
            raise
        return tuple(actions)

    def read_done_many(self, notices) -> None:
        """(slot, ticket) pairs, applied in order: the same state as one ReadDone step each."""
        cap, inflight, ticket = self._cap, self._inflight, self._ticket
        for s, t in notices:
            if 0 <= s < cap and inflight[s] and ticket[s] == t:
                inflight[s] = False

    def resident_mask(self, layer: int, *, pre: bool = False) -> np.ndarray:
        """bool [E]: the experts of `layer` in smap (RES), or with `pre` in smap or pmap (PRE)."""
        lo, hi = layer * self._E, (layer + 1) * self._E
        if pre:
            return self._res_view[lo:hi] | self._pre_view[lo:hi]
        return self._res_view[lo:hi].copy()

    @property
    def totals(self) -> CacheStats:
        return _stats(self._count)

    @property
    def turn(self) -> CacheStats:
        return _stats(list(map(sub, self._count, self._mark)))

    def state(self) -> CacheState:
        """The equivalent reference `CacheState` (a copy; slow, for tests and debugging)."""
        if self._held:
            self._settle()
        cfg = self.config
        total = np.array(self._count, np.int64)
        return CacheState(
            config=cfg,
            slot_state=_frozen(np.array(self._state, np.int8)),
            slot_key=_frozen(np.array(self._key, np.int32)),
            pin=_frozen(np.array(self._pin, np.int64)),
            tick=_frozen(np.array(self._tick, np.int64)),
            ticket=_frozen(np.array(self._ticket, np.int64)),
            inflight=_frozen(np.array(self._inflight, bool)),
            smap=_frozen(np.array(self._smap, np.int32)),
            pmap=_frozen(np.array(self._pmap, np.int32)),
            stamp=self._stamp, front=self._front, back=self._back, next_ticket=self._next_ticket,
            phase=self._phase, layer=self._layer, prompt=self._prompt,
            turn_counts=_frozen(total - np.array(self._mark, np.int64)), total_counts=_frozen(total),
        )

    def decision_view(self) -> tuple:
        """`strata.cache.machine.decision_view` of the equivalent state."""
        return decision_view(self.state())

    # ---------------------------------------------------------- events

    def _read_done(self, s: int, t: int) -> None:
        if 0 <= s < self._cap and self._inflight[s] and self._ticket[s] == t:
            self._inflight[s] = False

    def _begin_window(self) -> None:
        self._expect(_IDLE, "BeginWindow")
        if not self._prompt:
            self._new_stamp()  # a decode stamp lasts one window; a prompt stamp one layer (pass)
        self._phase, self._layer = _AT, 0
        self._count[_WINDOWS] += 1

    def _hold_region(self, begin: bool) -> None:
        self._expect(_IDLE, "HoldRegion")
        if begin == self._prompt:
            raise CacheProtocolError(f"HoldRegion(begin={begin}) while a region is {'held' if begin else 'not held'}")
        self._release_limbo()
        self._prompt = begin
        self._unskip()  # PRE slots change eligibility with the mode

    def _at_layer(self, layer: int, selected: tuple[int, ...]) -> None:
        if self._phase != _AT or layer != self._layer:
            self._expect(_AT, f"AtLayer({layer})", layer)
        prompt = self._prompt
        n, limit = len(selected), self._E if self._prompt else self._max_selected
        if n:  # `_check_experts`, inlined
            distinct = set(selected)
            if n > limit or len(distinct) != n or not distinct <= self._experts:
                self._check_experts(selected, limit, "selected")
        count = self._count
        self._mark = count[:]
        self._phase = _AFTER
        if prompt or self._layer_pins:  # a prompt's or a layer-pinned decode's stamp lasts one layer
            self._new_stamp()
        if not self._split:
            self._retire_unused_pre(layer, keep=selected, to_limbo=False)
        count[_LOOKUPS] += n
        if prompt:
            self._prompt_layer(layer, selected)
        else:
            self._decode_layer(layer, selected)

    def _after_layer(self, ev: AfterLayer) -> None:
        layer = ev.layer
        if self._phase != _AFTER or layer != self._layer:
            self._expect(_AFTER, f"AfterLayer({layer})", layer)
        cfg = self.config
        k, n_layers = cfg.prefetch_depth, self._n_layers
        guesses = ev.guesses[:k] if layer + 1 < n_layers else ()
        guesses2 = ev.guesses2[:k] if cfg.prefetch2 and layer + 2 < n_layers else ()
        for what, experts in (("guesses", guesses), ("guesses2", guesses2)):
            if experts:  # `_check_experts`, its raise left to it (slices: never more than k)
                distinct = set(experts)
                if len(distinct) != len(experts) or not distinct <= self._experts:
                    self._check_experts(experts, k, what)
        if self._split:
            self._release_limbo()
            self._retire_unused_pre(layer, keep=(), to_limbo=True)
        if guesses:
            self._ahead(layer + 1, guesses)
        if guesses2:
            self._ahead(layer + 2, guesses2)
        if layer == n_layers - 1:
            self._phase, self._layer = _IDLE, 0
        else:
            self._phase, self._layer = _AT, layer + 1

    # ---------------------------------------------------------- the turn's parts

    def _decode_layer(self, layer: int, selected: tuple[int, ...]) -> None:
        """Rank order: hit -> pin; read-ahead -> claim; else urgent miss. Then wait, then use.
        (A turn of hits only is taken by `step` before it gets here.)"""
        base, smap, count = layer * self._E, self._smap, self._count
        count[_DECODE_TURNS] += 1
        slots, waits = [], []
        pin, tick, stamp, move = self._pin, self._tick, self._stamp, self._lru.move_to_end
        for rank, e in enumerate(selected):  # looked up again: a miss may evict a later selection
            key = base + e
            s = smap[key]
            if s != _NONE:  # a hit: `_find` and `_touch`, inlined
                count[_HITS] += 1
                pin[s] = stamp
                tick[s] = self._front
                self._front += 1
                try:
                    move(s)
                except KeyError:
                    self._relist(s)
            else:
                s = self._claim(key, waits)
                if s == _NONE:  # an urgent miss
                    s = self._victim()
                    if s == _NONE:
                        raise self._full_error()
                    self._replace(s, key, RES, True)
                    waits.append(s)
                    count[_URGENT] += 1
                    count[_RANK0 + rank] += 1
            slots.append(s)
        if waits:
            self._wait(waits)
        self._actions.append(_use(layer, selected, tuple(slots)))

    def _prompt_layer(self, layer: int, selected: tuple[int, ...]) -> None:
        base, waits, experts, slots, missing = layer * self._E, [], [], [], []
        count = self._count
        count[_PROMPT_TURNS] += 1
        for e in selected:
            s = self._find(base + e, waits)
            if s == _NONE:
                missing.append(e)
            else:
                experts.append(e)
                slots.append(s)
        for e in missing:
            s = self._victim()
            if s == _NONE and experts:
                self._finish_pass(layer, experts, slots, waits)
                experts, slots, waits = [], [], []
                self._new_stamp()
                s = self._victim()
            if s == _NONE:
                raise self._full_error()
            self._replace(s, base + e, RES, True)
            count[_PROMPT_MISSES] += 1
            experts.append(e)
            slots.append(s)
            waits.append(s)
        self._finish_pass(layer, experts, slots, waits)

    def _find(self, key: int, waits: list) -> int:
        """A hit (pin, LRU front) or a read-ahead hit (`_claim`); -1 on a miss."""
        s = self._smap[key]
        if s == _NONE:
            return self._claim(key, waits)
        self._count[_HITS] += 1
        self._pin[s] = self._stamp
        self._touch(s)
        return s

    def _claim(self, key: int, waits: list) -> int:
        """A read-ahead hit: claim it into smap, pin, LRU front; late if its read is not known
        done (then the turn waits for it). -1 when `key` is not read ahead either."""
        s = self._pmap[key]
        if s == _NONE:
            return _NONE
        E = self._E
        self._pmap[key] = _NONE
        self._pre_mask[key] = False
        self._smap[key] = s
        self._smap_rows[key // E][key % E] = s
        self._res_mask[key] = True
        self._state[s] = RES
        self._pre_of_layer[key // E].discard(s)
        count = self._count
        count[_RA_HITS] += 1
        if self._inflight[s]:  # timing only: the wait list and the late count
            count[_LATE] += 1
            waits.append(s)
        self._pin[s] = self._stamp
        self._touch(s)
        return s

    def _claim_all(self, layer: int, selected: tuple[int, ...], found: tuple) -> tuple | None:
        """`step`'s decode turn when some selected experts are not hits: None (nothing changed)
        if one is not read ahead either, else the turn's counts are started and the read-aheads
        claimed (`_claim` without its pin and touch, which `_settle` does in rank order):
        (the slots, the WaitFor of the late ones or None)."""
        base, pmap = layer * self._E, self._pmap
        slots = list(found)
        for i, s in enumerate(found):
            if s == _NONE:
                s = pmap[base + selected[i]]
                if s == _NONE:
                    return None
                slots[i] = s
        count = self._count
        self._mark = count[:]
        smap, row, state, inflight = self._smap, self._smap_rows[layer], self._state, self._inflight
        pre_mask, res_mask, pre = self._pre_mask, self._res_mask, self._pre_of_layer[layer]
        waits = []
        for i, s in enumerate(found):
            if s == _NONE:
                s, key = slots[i], base + selected[i]
                pmap[key] = _NONE
                pre_mask[key] = False
                smap[key] = s
                row[key - base] = s
                res_mask[key] = True
                state[s] = RES
                pre.discard(s)
                count[_RA_HITS] += 1
                if inflight[s]:  # timing only: the wait list and the late count
                    count[_LATE] += 1
                    waits.append(s)
                    inflight[s] = False
        count[_HITS] += len(found) - found.count(_NONE)
        return tuple(slots), (_wait_for(tuple(waits)) if waits else None)

    def _finish_pass(self, layer, experts, slots, waits) -> None:
        if waits:
            self._wait(waits)
        if self._prompt:
            self._count[_PASSES] += 1
        self._actions.append(_use(layer, tuple(experts), tuple(slots)))

    def _ahead(self, layer: int, guesses: tuple[int, ...]) -> None:
        """Read ahead the guesses for `layer` (the reference's `ahead`). ~5 of 16 guesses are read
        per decode turn, each a victim search, an eviction and a read: the common victims (a
        FREE slot, a RES one) are handled here with the state in locals, a PRE one (prompt
        only) by `_replace`."""
        if layer >= self._n_layers:
            return
        E, touch = self._E, self.config.prefetch_touch
        base = layer * E
        smap, pmap, rows = self._smap, self._pmap, self._smap_rows
        state, keys, pin, tick, ticket, inflight = (
            self._state, self._key, self._pin, self._tick, self._ticket, self._inflight)
        res_mask, pre_mask, pre_set = self._res_mask, self._pre_mask, self._pre_of_layer[layer]
        free, lru, count = self._free, self._lru, self._count
        append = self._actions.append
        stamp = self._stamp
        new, evict_slot, evict_layer, evict_expert = _new, _EVICT_SLOT, _EVICT_LAYER, _EVICT_EXPERT  # `_evict`
        read_slot, read_layer, read_expert, read_urgent, read_ticket = (  # `_read`
            _READ_SLOT, _READ_LAYER, _READ_EXPERT, _READ_URGENT, _READ_TICKET)
        for g in guesses:
            key = base + g
            s = smap[key]
            if s != _NONE:
                if touch:
                    self._touch(s)
                continue
            if pmap[key] != _NONE:
                continue
            if free:  # the back-most FREE slot: it joins the LRU at the front
                s = free.popleft()
                lru[s] = None
            else:
                s = next(iter(lru), _NONE)  # `_victim`, when the LRU's oldest slot is eligible
                if s == _NONE or pin[s] == stamp or state[s] != RES:
                    s = self._victim()
                    if s == _NONE:
                        if self._prompt:
                            return  # the prompt pass just filled the arena: read-ahead is optional
                        raise self._full_error()
                    if state[s] != RES:
                        self._replace(s, key, PRE, False)
                        continue
                old = keys[s]  # evict
                smap[old] = _NONE
                old_layer, old_expert = divmod(old, E)
                rows[old_layer][old_expert] = _NONE
                res_mask[old] = False
                a = new(Evict)
                evict_slot(a, s)
                evict_layer(a, old_layer)
                evict_expert(a, old_expert)
                append(a)
                count[_EVICTIONS] += 1
                lru.move_to_end(s)  # a victim is listed, never skipped
            state[s] = PRE  # assign
            keys[s] = key
            pmap[key] = s
            pre_mask[key] = True
            pre_set.add(s)
            pin[s] = stamp
            tick[s] = self._front
            self._front += 1
            t = self._next_ticket
            self._next_ticket = t + 1
            ticket[s] = t
            inflight[s] = True
            a = new(Read)
            read_slot(a, s)
            read_layer(a, layer)
            read_expert(a, g)
            read_urgent(a, False)
            read_ticket(a, t)
            append(a)
            count[_READS] += 1
            count[_READS_AHEAD] += 1

    def _release_limbo(self) -> None:
        if self._limbo:
            limbo = sorted(self._limbo)
            inflight = self._inflight
            self._wait([s for s in limbo if inflight[s]])
            self._limbo.clear()
            self._free_slots(limbo)

    def _retire_unused_pre(self, layer: int, keep, to_limbo: bool) -> None:
        pre = self._pre_of_layer[layer]
        if not pre:
            return
        if keep:
            E, key, kept = self._E, self._key, set(keep)
            mine = sorted(s for s in pre if key[s] % E not in kept)
        else:
            mine = sorted(pre)
        if not mine:
            return
        pre.difference_update(mine)
        ticket, key, pin, pmap, pre_mask = self._ticket, self._key, self._pin, self._pmap, self._pre_mask
        append = self._actions.append
        new, cancel_slot, cancel_ticket = _new, _CANCEL_SLOT, _CANCEL_TICKET  # `_cancel`
        for s in mine:
            a = new(Cancel)
            cancel_slot(a, s)
            cancel_ticket(a, ticket[s])
            append(a)
            k = key[s]
            pmap[k] = _NONE
            pre_mask[k] = False
            key[s] = _NONE
            pin[s] = _NONE
        self._count[_CANCELLED] += len(mine)
        if to_limbo:
            state = self._state
            for s in mine:
                state[s] = LIMBO
            self._limbo.update(mine)
        else:
            inflight = self._inflight
            self._wait([s for s in mine if inflight[s]])
            self._free_slots(mine)

    # ---------------------------------------------------------- slots

    def _victim(self) -> int:
        """The reference's victim: the back-most FREE slot, else the oldest eligible listed one.
        The ineligible slots passed on the way are moved to `_skipped` (see the module doc)."""
        if self._free:
            return self._free[0]
        stamp, decode, pin, state = self._stamp, not self._prompt, self._pin, self._state
        passed = []
        victim = _NONE
        for s in self._lru:
            st = state[s]
            if pin[s] != stamp and st != LIMBO and not (decode and st == PRE):
                victim = s
                break
            passed.append(s)
        if passed:
            lru, skipped = self._lru, self._skipped
            for s in passed:
                del lru[s]
                skipped[s] = None
        return victim

    def _new_stamp(self) -> None:
        self._stamp += 1
        self._unskip()  # the old stamp's pins no longer protect

    def _unskip(self) -> None:
        """Put the skipped slots back at the LRU's old end, in order: eligible again, maybe."""
        skipped = self._skipped
        if skipped:
            lru = self._lru
            move = lru.move_to_end
            for s in reversed(skipped):
                lru[s] = None
                move(s, last=False)
            skipped.clear()

    def _replace(self, s: int, key: int, state: int, urgent: bool) -> None:
        """Evict what victim `s` holds, then read `key` into it (the reference's evict + assign)."""
        E = self._E
        actions = self._actions
        count = self._count
        old_state, old = self._state[s], self._key[s]
        # evict
        if old_state == RES:
            self._smap[old] = _NONE
            self._smap_rows[old // E][old % E] = _NONE
            self._res_mask[old] = False
            actions.append(_evict(s, old // E, old % E))
            count[_EVICTIONS] += 1
        elif old_state == PRE:  # only in a prompt: decode never picks a PRE slot
            self._pmap[old] = _NONE
            self._pre_mask[old] = False
            self._pre_of_layer[old // E].discard(s)
            actions.append(_cancel(s, self._ticket[s]))
            count[_CANCELLED] += 1
            if self._inflight[s]:
                self._wait([s])
            actions.append(_evict(s, old // E, old % E))
            count[_EVICTIONS] += 1
        # assign
        self._state[s] = state
        self._key[s] = key
        if state == RES:
            self._smap[key] = s
            self._smap_rows[key // E][key % E] = s
            self._res_mask[key] = True
        else:
            self._pmap[key] = s
            self._pre_mask[key] = True
            self._pre_of_layer[key // E].add(s)
        self._pin[s] = self._stamp
        if old_state == FREE:  # the victim was the back-most FREE slot: it joins the LRU at the front
            if self._free.popleft() != s:
                raise AssertionError(f"fast cache: assigned FREE slot {s} is not the LRU back")
            self._lru[s] = None
        else:
            try:
                self._lru.move_to_end(s)
            except KeyError:
                self._relist(s)
        self._tick[s] = self._front
        self._front += 1
        t = self._next_ticket
        self._next_ticket = t + 1
        self._ticket[s] = t
        self._inflight[s] = True
        actions.append(_read(s, key // E, key % E, urgent, t))
        count[_READS] += 1
        if not urgent:
            count[_READS_AHEAD] += 1

    def _wait(self, slots: list) -> None:
        if slots:
            self._actions.append(_wait_for(tuple(slots)))
            inflight = self._inflight
            for s in slots:
                inflight[s] = False

    def _free_slots(self, slots: list) -> None:
        """`slots` (sorted, none FREE) become FREE at the LRU back, the lowest slot back-most."""
        state, key, pin, inflight, tick = self._state, self._key, self._pin, self._inflight, self._tick
        lru, skipped = self._lru, self._skipped
        t = self._back - len(slots)
        for s in slots:
            state[s] = FREE
            key[s] = _NONE
            pin[s] = _NONE
            inflight[s] = False
            tick[s] = t
            t += 1
            if lru.pop(s, _NONE) is _NONE:
                del skipped[s]
        self._back -= len(slots)
        self._free.extendleft(reversed(slots))

    def _touch(self, s: int) -> None:
        """Move a listed slot to the LRU front."""
        try:
            self._lru.move_to_end(s)
        except KeyError:
            self._relist(s)
        self._tick[s] = self._front
        self._front += 1

    def _settle(self) -> None:
        """Pin, tick and move to the LRU front the held hits of the last (all-hit) decode turn,
        as that turn would have: it holds them so the host's turn skips ~10 x 4 list and dict
        stores. Every step starts here (and `state()`), so nothing reads the pins, ticks or LRU
        before they are right: the stamp is still the turn's, `front` already counts the held
        ticks. With the split turn this runs in AfterLayer, after the GPU was released."""
        held, front = self._held, self._held_front
        self._held = ()
        pin, tick, stamp, move = self._pin, self._tick, self._stamp, self._lru.move_to_end
        for s in held:
            pin[s] = stamp
            tick[s] = front
            front += 1
            try:
                move(s)
            except KeyError:  # skipped by a victim search this stamp (prefetch_touch only)
                self._relist(s)

    def _relist(self, s: int) -> None:
        """A skipped slot that moves (a touch) is the LRU's newest again."""
        del self._skipped[s]
        self._lru[s] = None

    # ---------------------------------------------------------- checks

    def _expect(self, phase: int, what: str, layer: int | None = None) -> None:
        if self._phase != phase or (layer is not None and layer != self._layer):
            wants = {_IDLE: "BeginWindow or HoldRegion", _AT: f"AtLayer({self._layer})",
                     _AFTER: f"AfterLayer({self._layer})"}[self._phase]
            raise CacheProtocolError(f"cache: got {what}, expected {wants}")

    def _check_experts(self, experts: tuple[int, ...], limit: int, what: str) -> None:
        n = len(experts)
        if n and (n > limit or len(set(experts)) != n or min(experts) < 0 or max(experts) >= self._E):
            raise CacheProtocolError(
                f"cache: {what} {experts} must be at most {limit} distinct experts in [0, {self._E})")

    def _full_error(self) -> CacheFullError:
        cfg, stamp = self.config, self._stamp
        pinned = sum(1 for p in self._pin if p == stamp)
        limbo = self._state.count(LIMBO)
        pre = self._state.count(PRE)
        mode = "prompt" if self._prompt else "decode"
        return CacheFullError(
            f"expert cache: no victim in an arena of {cfg.capacity} slots ({mode}, layer {self._layer}): "
            f"{pinned} pinned by the current stamp, {limbo} in limbo, {pre} unclaimed read-aheads; "
            f"this configuration needs at least {cfg.min_capacity} slots "
            f"({cfg.n_layers} layers x {cfg.max_selected} selected + read-ahead depth {cfg.prefetch_depth})")


def _stats(counts: list[int]) -> CacheStats:
    return CacheStats(**dict(zip(_FIELDS, counts)), urgent_misses_by_rank=tuple(counts[_RANK0:]))


class ReferenceCache:
    """The pure reference machine behind FastCache's interface (`Config.reference_cache`):
    every step copies the state (slow; for A/B runs and debugging)."""

    def __init__(self, config: CacheConfig) -> None:
        self.config = config
        self._state = initial_state(config)

    def step(self, event) -> tuple:
        self._state, actions = step(self._state, event)
        return actions

    def read_done_many(self, notices) -> None:
        for s, t in notices:
            self._state, _ = step(self._state, ReadDone(s, t))

    def resident_mask(self, layer: int, *, pre: bool = False) -> np.ndarray:
        lo, hi = layer * self.config.n_experts, (layer + 1) * self.config.n_experts
        mask = self._state.smap[lo:hi] >= 0
        if pre:
            mask |= self._state.pmap[lo:hi] >= 0
        return mask

    @property
    def totals(self) -> CacheStats:
        return self._state.totals

    @property
    def turn(self) -> CacheStats:
        return self._state.turn

    def state(self) -> CacheState:
        return self._state

    def decision_view(self) -> tuple:
        return decision_view(self._state)
