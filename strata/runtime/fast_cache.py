"""The fast twin of the expert-cache state machine (SPEC §5; STYLE §1, §2).

`FastCache(config).step(event)` returns exactly the actions that `strata.reference.cache.step`
returns for the same event sequence: same types, fields, order and tickets. It is held to the
reference by tests/test_fast_cache.py (a differential hypothesis test over every knob, with
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
  it is the oldest eligible slot of a doubly linked list of the other slots in touch order.
- **Lazy skipping.** Within one stamp (and one region mode) an ineligible slot of the list
  (pinned by the current stamp, LIMBO, or PRE in decode) stays ineligible until it moves: a
  pin lasts the stamp, LIMBO leaves only by `free`, and a PRE slot leaves PRE only by a claim
  (which touches it) or by retirement to LIMBO. So a cursor remembers the prefix of the list
  already found ineligible; a victim search resumes after it, and the cursor is reset when
  the stamp or the region mode changes. Each slot is skipped at most once per stamp unless it
  moves, and the victim is the reference's argmin exactly.
- **Limbo and read-aheads** are kept as a set and per-layer sets, sorted (they are at most a
  few K) where the reference walks slots in slot order.

Counters: `_turn` holds the current turn's counts and `_base` the totals before it, so an
increment touches one list. `decision_view()` and `state()` rebuild the reference's
`CacheState` (slow, for tests and debugging).

Errors: a `CacheProtocolError` is raised before anything changes, as in the reference. A
`CacheFullError` is raised at the same point as the reference's, but the reference's input
state survives it and this object's does not: it is marked failed, and every later step
raises (the runtime treats the error as fatal anyway).
"""

from __future__ import annotations

from collections import deque
from collections.abc import Iterable
from operator import add
from typing import Protocol

import numpy as np

from strata.reference.cache import step
from strata.reference.cache_state import (
    _AFTER, _AT, _CANCELLED, _DECODE_TURNS, _EVICTIONS, _FIELDS, _HITS, _IDLE, _LATE, _LOOKUPS, _PASSES,
    _PROMPT_MISSES, _PROMPT_TURNS, _RA_HITS, _RANK0, _READS, _READS_AHEAD, _URGENT, _WINDOWS, FREE, LIMBO,
    PRE, RES, CacheState, _frozen, decision_view, initial_state,
)
from strata.reference.cache_types import (
    AfterLayer, AtLayer, BeginWindow, CacheConfig, CacheFullError, CacheProtocolError, CacheStats, Cancel,
    Evict, HoldRegion, Read, ReadDone, Use, WaitFor,
)

__all__ = ["ExpertCache", "FastCache", "ReferenceCache", "open_cache"]

_NONE = -1


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

    `step(event) -> actions` is the twin of `strata.reference.cache.step(state, event)`;
    `read_done_many(notices)` applies (slot, ticket) notices in order, as ReadDone steps would.
    """

    def __init__(self, config: CacheConfig) -> None:
        self.config = cfg = config
        cap, n_keys = cfg.capacity, cfg.n_layers * cfg.n_experts
        self._E = cfg.n_experts
        self._cap = cap
        # the reference's arrays, as lists
        self._state = [FREE] * cap
        self._key = [_NONE] * cap
        self._pin = [_NONE] * cap
        self._tick = list(range(-cap, 0))
        self._ticket = [0] * cap
        self._inflight = [False] * cap
        self._smap = [_NONE] * n_keys
        self._pmap = [_NONE] * n_keys
        # residency masks for the runtime's MoCE bonus, kept beside smap and pmap  # [n_keys]
        self._res_mask = np.zeros(n_keys, bool)
        self._pre_mask = np.zeros(n_keys, bool)
        self._stamp, self._front, self._back, self._next_ticket = 0, 0, -cap, 1
        self._phase, self._layer, self._prompt = _IDLE, 0, False
        n_counts = _RANK0 + cfg.max_selected
        self._turn = [0] * n_counts
        self._base = [0] * n_counts
        # LRU: FREE slots back-most first; the others in a circular list through node `cap`
        self._free = deque(range(cap))
        self._nxt = [cap] * (cap + 1)  # toward the front (newer)
        self._prv = [cap] * (cap + 1)  # toward the back (older)
        self._cursor = cap  # the list up to here (from the oldest) is known ineligible
        self._limbo: set[int] = set()
        self._pre_of_layer: list[set[int]] = [set() for _ in range(cfg.n_layers)]
        self._actions: list = []
        self._failed: CacheFullError | None = None

    # ---------------------------------------------------------- the interface

    def step(self, event) -> tuple:
        """Apply one event; return the actions, in order (the reference's, exactly)."""
        if self._failed is not None:
            raise CacheProtocolError(f"the expert cache failed earlier and cannot continue: {self._failed}")
        if isinstance(event, ReadDone):
            self._read_done(event.slot, event.ticket)
            return ()
        self._actions = []
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
        return tuple(self._actions)

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
            return self._res_mask[lo:hi] | self._pre_mask[lo:hi]
        return self._res_mask[lo:hi].copy()

    @property
    def totals(self) -> CacheStats:
        return _stats([b + t for b, t in zip(self._base, self._turn)])

    @property
    def turn(self) -> CacheStats:
        return _stats(self._turn)

    def state(self) -> CacheState:
        """The equivalent reference `CacheState` (a copy; slow, for tests and debugging)."""
        cfg = self.config
        turn = np.array(self._turn, np.int64)
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
            turn_counts=_frozen(turn), total_counts=_frozen(np.array(self._base, np.int64) + turn),
        )

    def decision_view(self) -> tuple:
        """`strata.reference.cache.decision_view` of the equivalent state."""
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
        self._turn[_WINDOWS] += 1

    def _hold_region(self, begin: bool) -> None:
        self._expect(_IDLE, "HoldRegion")
        if begin == self._prompt:
            raise CacheProtocolError(f"HoldRegion(begin={begin}) while a region is {'held' if begin else 'not held'}")
        self._release_limbo()
        self._prompt = begin
        self._cursor = self._cap  # PRE slots change eligibility with the mode

    def _at_layer(self, layer: int, selected: tuple[int, ...]) -> None:
        self._expect(_AT, f"AtLayer({layer})", layer)
        limit = self._E if self._prompt else self.config.max_selected
        self._check_experts(selected, limit, "selected")
        self._base = list(map(add, self._base, self._turn))
        self._turn = turn = [0] * len(self._turn)
        self._phase = _AFTER
        if self._prompt:
            self._new_stamp()
        if not self.config.split_turn:
            self._retire_unused_pre(layer, keep=selected, to_limbo=False)
        turn[_LOOKUPS] += len(selected)
        if self._prompt:
            self._prompt_layer(layer, selected)
        else:
            self._decode_layer(layer, selected)

    def _after_layer(self, ev: AfterLayer) -> None:
        self._expect(_AFTER, f"AfterLayer({ev.layer})", ev.layer)
        cfg = self.config
        k, n_layers = cfg.prefetch_depth, cfg.n_layers
        guesses = ev.guesses[:k] if ev.layer + 1 < n_layers else ()
        guesses2 = ev.guesses2[:k] if cfg.prefetch2 and ev.layer + 2 < n_layers else ()
        self._check_experts(guesses, k, "guesses")
        self._check_experts(guesses2, k, "guesses2")
        if cfg.split_turn:
            self._release_limbo()
            self._retire_unused_pre(ev.layer, keep=(), to_limbo=True)
        self._ahead(ev.layer + 1, guesses)
        self._ahead(ev.layer + 2, guesses2)
        if ev.layer == n_layers - 1:
            self._phase, self._layer = _IDLE, 0
        else:
            self._phase, self._layer = _AT, ev.layer + 1

    # ---------------------------------------------------------- the turn's parts

    def _decode_layer(self, layer: int, selected: tuple[int, ...]) -> None:
        """`_find` + `_touch` inlined for the hits: a decode turn is ~10 lookups, most of them hits,
        and two method calls per lookup were a third of the turn (benchmarks/host_turn.py)."""
        base, slots, waits, turn = layer * self._E, [], [], self._turn
        smap, pmap, pin, stamp = self._smap, self._pmap, self._pin, self._stamp
        nxt, prv, end, tick = self._nxt, self._prv, self._cap, self._tick
        hits = 0
        turn[_DECODE_TURNS] += 1
        for rank, e in enumerate(selected):
            key = base + e
            s = smap[key]
            if s != _NONE:
                hits += 1
            elif pmap[key] != _NONE:  # a read-ahead claimed: `_find`'s other branch
                s = self._find(key, waits)
                slots.append(s)
                continue
            else:  # an urgent miss
                s = self._victim()
                if s == _NONE:
                    raise self._full_error()
                self._evict(s)
                self._assign(s, key, RES, True)
                waits.append(s)
                turn[_URGENT] += 1
                turn[_RANK0 + rank] += 1
                slots.append(s)
                continue
            pin[s] = stamp  # a hit: pin, then `_touch` (inlined)
            p, n = prv[s], nxt[s]
            if s == self._cursor:
                self._cursor = p
            nxt[p] = n
            prv[n] = p
            last = prv[end]
            nxt[last] = s
            prv[s] = last
            nxt[s] = end
            prv[end] = s
            tick[s] = self._front
            self._front += 1
            slots.append(s)
        turn[_HITS] += hits
        self._finish_pass(layer, selected, slots, waits)

    def _prompt_layer(self, layer: int, selected: tuple[int, ...]) -> None:
        base, waits, experts, slots, missing = layer * self._E, [], [], [], []
        turn = self._turn
        turn[_PROMPT_TURNS] += 1
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
            self._evict(s)
            self._assign(s, base + e, RES, True)
            turn[_PROMPT_MISSES] += 1
            experts.append(e)
            slots.append(s)
            waits.append(s)
        self._finish_pass(layer, experts, slots, waits)

    def _find(self, key: int, waits: list) -> int:
        s = self._smap[key]
        if s != _NONE:
            self._turn[_HITS] += 1
        else:
            s = self._pmap[key]
            if s == _NONE:
                return _NONE
            self._pmap[key] = _NONE
            self._pre_mask[key] = False
            self._smap[key] = s
            self._res_mask[key] = True
            self._state[s] = RES
            self._pre_of_layer[key // self._E].discard(s)
            self._turn[_RA_HITS] += 1
            if self._inflight[s]:  # timing only: the wait list and the late count
                self._turn[_LATE] += 1
                waits.append(s)
        self._pin[s] = self._stamp
        self._touch(s)
        return s

    def _finish_pass(self, layer, experts, slots, waits) -> None:
        if waits:
            self._wait(waits)
        if self._prompt:
            self._turn[_PASSES] += 1
        self._actions.append(Use(layer, tuple(experts), tuple(slots)))

    def _ahead(self, layer: int, guesses: tuple[int, ...]) -> None:
        if layer >= self.config.n_layers:
            return
        base, smap, pmap, touch = layer * self._E, self._smap, self._pmap, self.config.prefetch_touch
        for g in guesses:
            key = base + g
            s = smap[key]
            if s != _NONE:
                if touch:
                    self._touch(s)
                continue
            if pmap[key] != _NONE:
                continue
            s = self._victim()
            if s == _NONE:
                if self._prompt:
                    return  # the prompt pass just filled the arena: read-ahead is optional
                raise self._full_error()
            self._evict(s)
            self._assign(s, key, PRE, False)

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
        for s in mine:
            self._actions.append(Cancel(s, ticket[s]))
            k = key[s]
            pmap[k] = _NONE
            pre_mask[k] = False
            key[s] = _NONE
            pin[s] = _NONE
        self._turn[_CANCELLED] += len(mine)
        if to_limbo:
            for s in mine:
                self._state[s] = LIMBO
            self._limbo.update(mine)
        else:
            inflight = self._inflight
            self._wait([s for s in mine if inflight[s]])
            self._free_slots(mine)

    # ---------------------------------------------------------- slots

    def _victim(self) -> int:
        """The reference's victim: the back-most FREE slot, else the oldest eligible listed one."""
        if self._free:
            return self._free[0]
        stamp, decode, pin, state, nxt = self._stamp, not self._prompt, self._pin, self._state, self._nxt
        cursor, end = self._cursor, self._cap
        s = nxt[cursor]
        while s != end:
            st = state[s]
            if pin[s] != stamp and st != LIMBO and not (decode and st == PRE):
                self._cursor = cursor
                return s
            cursor = s
            s = nxt[s]
        self._cursor = cursor
        return _NONE

    def _new_stamp(self) -> None:
        self._stamp += 1
        self._cursor = self._cap  # the old stamp's pins no longer protect: rescan from the back

    def _evict(self, s: int) -> None:
        st, key = self._state[s], self._key[s]
        if st == RES:
            self._smap[key] = _NONE
            self._res_mask[key] = False
        elif st == PRE:  # only in a prompt: decode never picks a PRE slot
            self._pmap[key] = _NONE
            self._pre_mask[key] = False
            self._pre_of_layer[key // self._E].discard(s)
            self._actions.append(Cancel(s, self._ticket[s]))
            self._turn[_CANCELLED] += 1
            if self._inflight[s]:
                self._wait([s])
        else:
            return
        self._actions.append(Evict(s, key // self._E, key % self._E))
        self._turn[_EVICTIONS] += 1

    def _assign(self, s: int, key: int, state: int, urgent: bool) -> None:
        was_free = self._state[s] == FREE
        self._state[s] = state
        self._key[s] = key
        if state == RES:
            self._smap[key] = s
            self._res_mask[key] = True
        else:
            self._pmap[key] = s
            self._pre_mask[key] = True
            self._pre_of_layer[key // self._E].add(s)
        self._pin[s] = self._stamp
        if was_free:  # the victim was the back-most FREE slot: it joins the list at the front
            if self._free.popleft() != s:
                raise AssertionError(f"fast cache: assigned FREE slot {s} is not the LRU back")
            self._append(s)
            self._tick[s] = self._front
            self._front += 1
        else:
            self._touch(s)
        t = self._next_ticket
        self._next_ticket += 1
        self._ticket[s] = t
        self._inflight[s] = True
        E = self._E
        self._actions.append(Read(s, key // E, key % E, urgent, t))
        turn = self._turn
        turn[_READS] += 1
        if not urgent:
            turn[_READS_AHEAD] += 1

    def _wait(self, slots: list) -> None:
        if slots:
            self._actions.append(WaitFor(tuple(slots)))
            inflight = self._inflight
            for s in slots:
                inflight[s] = False

    def _free_slots(self, slots: list) -> None:
        """`slots` (sorted, none FREE) become FREE at the LRU back, the lowest slot back-most."""
        state, key, pin, inflight, tick = self._state, self._key, self._pin, self._inflight, self._tick
        t = self._back - len(slots)
        for s in slots:
            state[s] = FREE
            key[s] = _NONE
            pin[s] = _NONE
            inflight[s] = False
            tick[s] = t
            t += 1
            self._unlink(s)
        self._back -= len(slots)
        self._free.extendleft(reversed(slots))

    def _touch(self, s: int) -> None:
        """Move a listed slot to the LRU front (`_unlink` + `_append`, inlined: the hot path)."""
        nxt, prv, end = self._nxt, self._prv, self._cap
        p, n = prv[s], nxt[s]
        if s == self._cursor:
            self._cursor = p
        nxt[p] = n
        prv[n] = p
        last = prv[end]
        nxt[last] = s
        prv[s] = last
        nxt[s] = end
        prv[end] = s
        self._tick[s] = self._front
        self._front += 1

    def _unlink(self, s: int) -> None:
        nxt, prv = self._nxt, self._prv
        p, n = prv[s], nxt[s]
        if s == self._cursor:
            self._cursor = p  # what was known ineligible before it still is
        nxt[p] = n
        prv[n] = p

    def _append(self, s: int) -> None:
        nxt, prv, end = self._nxt, self._prv, self._cap
        last = prv[end]
        nxt[last] = s
        prv[s] = last
        nxt[s] = end
        prv[end] = s

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
