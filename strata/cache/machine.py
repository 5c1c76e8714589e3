"""The expert-cache state machine (design §5): `step(state, event) -> (state, actions)`.

The one definition of which slot holds what. The runtime applies the actions to real I/O, the
replay tools drive it over recorded routing; both read the same decisions. docs/cache.md walks
through states, events, the victim rule and why decisions never depend on I/O timing.

Purity: a `CacheState` is frozen and its arrays are read-only. `step` copies the arrays, works
on the copies (a private `_Turn`), and freezes them into a new state; the old state stays valid.
Copying ~10 arrays of a few thousand entries costs microseconds, far less than the Python of a
turn, so copy-on-every-step is both the simplest and fast enough (benchmarks/cache.py).
"""

from __future__ import annotations

import numpy as np

from strata.cache.state import (
    _AFTER, _ARRAYS, _AT, _CANCELLED, _DECODE_TURNS, _EVICTIONS, _HITS, _IDLE, _LATE, _LOOKUPS, _NONE,
    _PASSES, _PROMPT_MISSES, _PROMPT_TURNS, _RA_HITS, _RANK0, _READS, _READS_AHEAD, _URGENT, _WINDOWS,
    FREE, LIMBO, PRE, RES, CacheState, _frozen, _victim, decision_view, initial_state, lru_order,
    slot_table, victim,
)
from strata.cache.types import (
    AfterLayer, AtLayer, BeginWindow, CacheFullError, CacheProtocolError, Cancel, Evict, HoldRegion,
    Read, ReadDone, Use, WaitFor,
)

__all__ = ["step", "CacheState", "initial_state", "victim", "slot_table", "lru_order", "decision_view"]


# ------------------------------------------------------------------ step


def step(state: CacheState, event) -> tuple[CacheState, tuple]:
    """Apply one event; return the new state and the actions for the runtime, in order.

    Raises CacheProtocolError for events out of order, CacheFullError when victim() finds
    nothing. The input state is never modified.
    """
    if isinstance(event, ReadDone):
        return _read_done(state, event), ()
    turn = _Turn(state)
    if isinstance(event, AtLayer):
        turn.at_layer(event)
    elif isinstance(event, AfterLayer):
        turn.after_layer(event)
    elif isinstance(event, BeginWindow):
        turn.begin_window()
    elif isinstance(event, HoldRegion):
        turn.hold_region(event.begin)
    else:
        raise CacheProtocolError(f"not a cache event: {event!r}")
    return turn.freeze(), tuple(turn.actions)


def _read_done(state: CacheState, event: ReadDone) -> CacheState:
    s = event.slot
    if not (0 <= s < state.config.capacity and state.inflight[s] and state.ticket[s] == event.ticket):
        return state  # stale or unknown: the read was already waited for, or the slot moved on
    inflight = state.inflight.copy()
    inflight[s] = False
    return CacheState(
        config=state.config, slot_state=state.slot_state, slot_key=state.slot_key, pin=state.pin,
        tick=state.tick, ticket=state.ticket, inflight=_frozen(inflight), smap=state.smap, pmap=state.pmap,
        stamp=state.stamp, front=state.front, back=state.back, next_ticket=state.next_ticket,
        phase=state.phase, layer=state.layer, prompt=state.prompt, turn_counts=state.turn_counts,
        total_counts=state.total_counts)


class _Turn:
    """One step's working copy. Mutable, private, gone when `step` returns."""

    def __init__(self, s: CacheState):
        self.old = s
        self.cfg = cfg = s.config
        self.E = cfg.n_experts
        for name in _ARRAYS:
            setattr(self, name, getattr(s, name).copy())
        self.stamp, self.front, self.back, self.next_ticket = s.stamp, s.front, s.back, s.next_ticket
        self.phase, self.layer, self.prompt = s.phase, s.layer, s.prompt
        self.turn_counts = s.turn_counts
        self.delta = [0] * len(s.total_counts)
        self.actions: list = []

    def freeze(self) -> CacheState:
        delta = np.array(self.delta, np.int64)
        return CacheState(
            config=self.cfg, **{name: _frozen(getattr(self, name)) for name in _ARRAYS},
            stamp=self.stamp, front=self.front, back=self.back, next_ticket=self.next_ticket,
            phase=self.phase, layer=self.layer, prompt=self.prompt,
            turn_counts=_frozen(self.turn_counts + delta), total_counts=_frozen(self.old.total_counts + delta),
        )

    # ---------------------------------------------------------- events

    def begin_window(self) -> None:
        self._expect(_IDLE, "BeginWindow")
        if not self.prompt:
            self.stamp += 1  # a decode stamp lasts one window; a prompt stamp one layer (pass)
        self.phase, self.layer = _AT, 0
        self.delta[_WINDOWS] += 1

    def hold_region(self, begin: bool) -> None:
        self._expect(_IDLE, "HoldRegion")
        if begin == self.prompt:
            raise CacheProtocolError(f"HoldRegion(begin={begin}) while a region is {'held' if begin else 'not held'}")
        self.release_limbo()
        self.prompt = begin

    def at_layer(self, ev: AtLayer) -> None:
        self._expect(_AT, f"AtLayer({ev.layer})", ev.layer)
        limit = self.E if self.prompt else self.cfg.max_selected
        self._check_experts(ev.selected, limit, "selected")  # may be empty: drop-tail can skip all
        self.turn_counts = np.zeros_like(self.turn_counts)
        self.phase = _AFTER
        if self.prompt or self.cfg.layer_pins:  # a prompt's or a layer-pinned decode's stamp lasts one layer
            self.stamp += 1
        if not self.cfg.split_turn:
            self.retire_unused_pre(ev.layer, keep=ev.selected, to_limbo=False)
        self.delta[_LOOKUPS] += len(ev.selected)
        if self.prompt:
            self.prompt_layer(ev.layer, ev.selected)
        else:
            self.decode_layer(ev.layer, ev.selected)

    def after_layer(self, ev: AfterLayer) -> None:
        self._expect(_AFTER, f"AfterLayer({ev.layer})", ev.layer)
        k, n_layers = self.cfg.prefetch_depth, self.cfg.n_layers
        guesses = ev.guesses[:k] if ev.layer + 1 < n_layers else ()
        guesses2 = ev.guesses2[:k] if self.cfg.prefetch2 and ev.layer + 2 < n_layers else ()
        self._check_experts(guesses, k, "guesses")
        self._check_experts(guesses2, k, "guesses2")
        if self.cfg.split_turn:  # the reference engine's split turn (§2.4); off: the layer's turn already retired
            self.release_limbo()
            self.retire_unused_pre(ev.layer, keep=(), to_limbo=True)
        self.ahead(ev.layer + 1, guesses)
        self.ahead(ev.layer + 2, guesses2)
        last = ev.layer == self.cfg.n_layers - 1
        self.phase, self.layer = (_IDLE, 0) if last else (_AT, ev.layer + 1)

    # ---------------------------------------------------------- the turn's parts

    def decode_layer(self, layer: int, selected: tuple[int, ...]) -> None:
        """Rank order: hit -> pin; read-ahead -> claim; else urgent miss. Then wait, then use."""
        base, slots, waits = layer * self.E, [], []
        self.delta[_DECODE_TURNS] += 1
        for rank, e in enumerate(selected):
            s = self.find(base + e, waits)
            if s == _NONE:
                s = self.take_victim()
                self.assign(s, base + e, RES, urgent=True)
                waits.append(s)
                self.delta[_URGENT] += 1
                self.delta[_RANK0 + rank] += 1
            slots.append(s)
        self.finish_pass(layer, selected, slots, waits)

    def prompt_layer(self, layer: int, selected: tuple[int, ...]) -> None:
        """Everything already present is claimed in the first pass (it needs no slot); misses
        then fill what victim() offers; when it offers nothing the pass is closed, the GPU runs
        it, and the stamp advances so the pass's slots can be reused by the next pass."""
        base, waits, experts, slots, missing = layer * self.E, [], [], [], []
        self.delta[_PROMPT_TURNS] += 1
        for e in selected:
            s = self.find(base + e, waits)
            if s == _NONE:
                missing.append(e)
            else:
                experts.append(e)
                slots.append(s)
        for e in missing:
            s = self.victim()
            if s == _NONE and experts:
                self.finish_pass(layer, experts, slots, waits)
                experts, slots, waits = [], [], []
                self.stamp += 1
                s = self.victim()
            if s == _NONE:  # only when limbo fills the arena (the layer before selected nothing)
                raise self.full_error()
            self.evict(s)
            self.assign(s, base + e, RES, urgent=True)
            self.delta[_PROMPT_MISSES] += 1
            experts.append(e)
            slots.append(s)
            waits.append(s)
        self.finish_pass(layer, experts, slots, waits)

    def find(self, key: int, waits: list) -> int:
        """A hit (pin, LRU front) or a read-ahead hit (claim into smap, pin, front; late if its
        read is not known done: then the turn waits for it). -1 on a miss."""
        s = int(self.smap[key])
        if s != _NONE:
            self.delta[_HITS] += 1
        else:
            s = int(self.pmap[key])
            if s == _NONE:
                return _NONE
            self.pmap[key] = _NONE
            self.smap[key] = s
            self.slot_state[s] = RES
            self.delta[_RA_HITS] += 1
            if self.inflight[s]:  # timing only: changes the wait list and the count, nothing else
                self.delta[_LATE] += 1
                waits.append(s)
        self.pin[s] = self.stamp
        self.touch(s)
        return s

    def finish_pass(self, layer, experts, slots, waits) -> None:
        if waits:
            self.wait(waits)
        if self.prompt:
            self.delta[_PASSES] += 1
        self.actions.append(Use(layer, tuple(experts), tuple(slots)))

    def ahead(self, layer: int, guesses: tuple[int, ...]) -> None:
        """Read ahead the guesses for `layer`: resident ones are left alone (or touched),
        read-aheads already issued are left alone, the rest become PRE with a low-priority read."""
        if layer >= self.cfg.n_layers:
            return
        base = layer * self.E
        for g in guesses:
            key = base + g
            s = int(self.smap[key])
            if s != _NONE:
                if self.cfg.prefetch_touch:
                    self.touch(s)
                continue
            if self.pmap[key] != _NONE:
                continue
            s = self.victim()
            if s == _NONE:
                if self.prompt:
                    return  # the prompt pass just filled the arena: read-ahead is optional
                raise self.full_error()
            self.evict(s)
            self.assign(s, key, PRE, urgent=False)

    def release_limbo(self) -> None:
        """Wait for limbo slots still reading (they had a whole layer), then free them."""
        limbo = np.flatnonzero(self.slot_state == LIMBO)
        if len(limbo):
            self.wait([int(s) for s in limbo if self.inflight[s]])
            self.free(limbo)

    def retire_unused_pre(self, layer: int, keep, to_limbo: bool) -> None:
        """This layer's unclaimed read-aheads (those not in `keep`): cancel every one, then park
        them in limbo (split turn) or wait for them and free them at once (old order)."""
        pre = np.flatnonzero(self.slot_state == PRE)
        keys = self.slot_key[pre]
        mine = pre[(keys // self.E) == layer]
        if len(keep):
            kept = np.isin(self.slot_key[mine] % self.E, np.asarray(keep))
            mine = mine[~kept]
        if not len(mine):
            return
        for s in mine.tolist():
            self.actions.append(Cancel(s, int(self.ticket[s])))
            self.pmap[self.slot_key[s]] = _NONE
        self.delta[_CANCELLED] += len(mine)
        self.slot_key[mine] = _NONE
        self.pin[mine] = _NONE
        if to_limbo:
            self.slot_state[mine] = LIMBO
        else:
            self.wait([s for s in mine.tolist() if self.inflight[s]])
            self.free(mine)

    # ---------------------------------------------------------- slots

    def victim(self) -> int:
        return _victim(self.slot_state, self.pin, self.tick, self.stamp, not self.prompt)

    def take_victim(self) -> int:
        s = self.victim()
        if s == _NONE:
            raise self.full_error()
        self.evict(s)
        return s

    def evict(self, s: int) -> None:
        state, key = int(self.slot_state[s]), int(self.slot_key[s])
        if state == RES:
            self.smap[key] = _NONE
        elif state == PRE:  # only in a prompt: decode never picks a PRE slot
            self.pmap[key] = _NONE
            self.actions.append(Cancel(s, int(self.ticket[s])))
            self.delta[_CANCELLED] += 1
            if self.inflight[s]:
                self.wait([s])
        else:
            return
        self.actions.append(Evict(s, key // self.E, key % self.E))
        self.delta[_EVICTIONS] += 1

    def assign(self, s: int, key: int, state: int, urgent: bool) -> None:
        self.slot_state[s] = state
        self.slot_key[s] = key
        (self.smap if state == RES else self.pmap)[key] = s
        self.pin[s] = self.stamp
        self.touch(s)  # a read-ahead goes to the front too: in a prompt it is a possible victim
        t = self.next_ticket
        self.next_ticket += 1
        self.ticket[s] = t
        self.inflight[s] = True
        self.actions.append(Read(s, key // self.E, key % self.E, urgent, t))
        self.delta[_READS] += 1
        if not urgent:
            self.delta[_READS_AHEAD] += 1

    def wait(self, slots: list) -> None:
        if slots:
            self.actions.append(WaitFor(tuple(slots)))
            self.inflight[slots] = False

    def free(self, slots: np.ndarray) -> None:
        """FREE, unpinned, at the LRU back in slot order (the lowest slot back-most)."""
        slots = np.sort(slots)
        self.slot_state[slots] = FREE
        self.slot_key[slots] = _NONE
        self.pin[slots] = _NONE
        self.inflight[slots] = False
        n = len(slots)
        self.tick[slots] = np.arange(self.back - n, self.back, dtype=np.int64)
        self.back -= n

    def touch(self, s: int) -> None:
        self.tick[s] = self.front
        self.front += 1

    # ---------------------------------------------------------- checks

    def _expect(self, phase: int, what: str, layer: int | None = None) -> None:
        if self.phase != phase or (layer is not None and layer != self.layer):
            wants = {_IDLE: "BeginWindow or HoldRegion", _AT: f"AtLayer({self.layer})",
                     _AFTER: f"AfterLayer({self.layer})"}[self.phase]
            raise CacheProtocolError(f"cache: got {what}, expected {wants}")

    def _check_experts(self, experts: tuple[int, ...], limit: int, what: str) -> None:
        if len(experts) > limit or len(set(experts)) != len(experts) or \
                any(not 0 <= e < self.E for e in experts):
            raise CacheProtocolError(
                f"cache: {what} {experts} must be at most {limit} distinct experts in [0, {self.E})")

    def full_error(self) -> CacheFullError:
        cfg = self.cfg
        pinned = int(np.count_nonzero(self.pin == self.stamp))
        limbo = int(np.count_nonzero(self.slot_state == LIMBO))
        pre = int(np.count_nonzero(self.slot_state == PRE))
        mode = "prompt" if self.prompt else "decode"
        return CacheFullError(
            f"expert cache: no victim in an arena of {cfg.capacity} slots ({mode}, layer {self.layer}): "
            f"{pinned} pinned by the current stamp, {limbo} in limbo, {pre} unclaimed read-aheads; "
            f"this configuration needs at least {cfg.min_capacity} slots "
            f"({cfg.n_layers} layers x {cfg.max_selected} selected + read-ahead depth {cfg.prefetch_depth})")


