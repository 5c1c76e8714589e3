"""The streamer: owns the expert-cache state and applies its actions to real I/O (design §5).

Every slot decision is the reference machine's (`strata.cache.machine.step`), taken by its
fast twin `strata.cache.fast.FastCache` (held to it by tests; `reference=True`, i.e.
`Config.reference_cache`, steps the reference itself); this module only carries the actions out: `Read` -> the reader pool, `Cancel` -> drop a queued read, `WaitFor` -> block on
those slots' reads, `Evict` -> bookkeeping, `Use` -> hand the slots to compute (after checking
that each holds the expert it should, read without error). Reads that completed are fed back
as `ReadDone` before each turn; they can change only the late count and which waits are
needed, never a decision (the state machine's determinism invariant), so the decision trace
of a run depends on its turns alone, whatever the I/O timing.

Residency for MoCE (`resident_mask`): RES slots (claimed, in `smap`) count as resident. An
unclaimed read-ahead (PRE) counts only with `moce_pre`: it is in the arena or on its way, but
claiming one that is still in flight makes the turn wait ("late"), so by default the bonus goes
only to experts that cost nothing. Both are decision-only state, so routing stays deterministic.
"""

from __future__ import annotations

import time
from typing import Callable

import numpy as np

from strata.cache.machine import CacheState
from strata.cache.types import (
    AfterLayer, AtLayer, BeginWindow, CacheConfig, CacheStats, Cancel, Evict, HoldRegion, Read, Use, WaitFor,
)
from strata.cache.fast import open_cache
from strata.runtime.io import ReaderPool

__all__ = ["Streamer", "TurnTimes"]


class TurnTimes:
    """Seconds spent in the host's turns, accumulated (the stream report's host/waiting/after)."""

    __slots__ = ("host", "waiting", "after", "overlap")

    def __init__(self) -> None:
        self.host = self.waiting = self.after = self.overlap = 0.0


class Streamer:
    """Feeds turns to the cache state machine and applies what it says.

    `trace` (when kept) is the list of turn events in order: replaying them through `step`
    from `initial_state(config)` gives the same decisions and the same `decision_view`.
    `reference`: step the pure reference machine instead of the fast twin (slow; A/B, debugging).
    """

    def __init__(self, config: CacheConfig, pool: ReaderPool, *, keep_trace: bool = False,
                 moce_pre: bool = False, reference: bool = False) -> None:
        self.config = config
        self.pool = pool
        self.cache = open_cache(config, reference=reference)
        self.trace: list | None = [] if keep_trace else None
        self.decisions: list | None = [] if keep_trace else None
        self.times = TurnTimes()
        self.moce_pre = moce_pre
        self._ticket = [0] * config.capacity  # each slot's latest read (the pool checks its layer and expert)

    # -------------------------------------------------------- turns

    def begin_window(self) -> None:
        self._host_step(BeginWindow())

    def hold_region(self, begin: bool) -> None:
        self._host_step(HoldRegion(begin))

    def at_layer(self, layer: int, selected, *, on_use: Callable[[Use], None],
                 overlap: Callable[[], None] | None = None) -> None:
        """The host's turn for `layer`. `on_use` runs for each pass (decode: one) once its
        reads are complete; `overlap` runs once, after this turn's reads are issued and
        before the wait for them (the shared expert: work placed between signal and wait)."""
        start = time.perf_counter()
        actions = self._step(AtLayer(layer, tuple(selected)))
        outside, waited = self._apply(actions, on_use=on_use, overlap=overlap)
        self.times.host += time.perf_counter() - start - outside
        self.times.waiting += waited

    def after_layer(self, layer: int, guesses=(), guesses2=(), *, in_turn: bool = False) -> None:
        """After `layer`'s compute was handed off: retire, release limbo, read ahead.
        `in_turn` (split turn off): this runs inside the host's turn and is timed as host."""
        start = time.perf_counter()
        _, waited = self._apply(self._step(AfterLayer(layer, tuple(guesses), tuple(guesses2))))
        dt = time.perf_counter() - start
        if in_turn:
            self.times.host += dt
            self.times.waiting += waited
        else:  # a wait here (limbo still reading) is part of the after time, not of the turn's
            self.times.after += dt

    # -------------------------------------------------------- views

    def resident_mask(self, layer: int) -> np.ndarray:
        """bool [E]: the experts of `layer` that count as resident for the MoCE bonus."""
        return self.cache.resident_mask(layer, pre=self.moce_pre)

    @property
    def totals(self) -> CacheStats:
        return self.cache.totals

    @property
    def state(self) -> CacheState:
        """The cache's state as a reference `CacheState` (with the fast twin, a copy built on
        each access: for tests and debugging, not for the loop)."""
        return self.cache.state()

    # -------------------------------------------------------- applying actions

    def _step(self, event) -> tuple:
        self.cache.read_done_many(self.pool.completed())
        actions = self.cache.step(event)
        if self.trace is not None:
            self.trace.append(event)
            self.decisions.extend(a for a in actions if not isinstance(a, WaitFor))
        return actions

    def _host_step(self, event) -> None:
        """A step outside any layer's turn (window and region edges): host time, its waits included."""
        start = time.perf_counter()
        _, waited = self._apply(self._step(event))
        self.times.host += time.perf_counter() - start
        self.times.waiting += waited

    def _apply(self, actions: tuple, *, on_use=None, overlap=None) -> tuple[float, float]:
        """Carry out `actions` in order; return (seconds spent in the callbacks — compute, not
        host work —, seconds spent waiting for reads)."""
        outside = waited = 0.0
        overlap_at = -1
        if overlap is not None:  # before the wait that precedes the (decode) Use, else at the Use
            overlap_at = len(actions) - 1
            if len(actions) >= 2 and isinstance(actions[-2], WaitFor):
                overlap_at -= 1
        pool, ticket = self.pool, self._ticket
        reads: list = []  # consecutive Reads go to the pool in one batch (one lock, one wake-up each)
        for i, a in enumerate(actions):
            if i == overlap_at:
                if reads:
                    pool.submit_many(reads)
                    reads = []
                t = time.perf_counter()
                overlap()
                dt = time.perf_counter() - t
                self.times.overlap += dt
                outside += dt
            kind = type(a)  # exact types: the machine's actions are final dataclasses
            if kind is Read:
                ticket[a.slot] = a.ticket
                reads.append((a.ticket, a.slot, a.layer, a.expert, a.urgent))
                continue
            if kind is Evict:  # bookkeeping only (the cache's): the batch of reads goes on
                continue
            if reads:
                pool.submit_many(reads)
                reads = []
            if kind is Cancel:
                pool.cancel(a.ticket)
            elif kind is WaitFor:
                waited += pool.wait([ticket[s] for s in a.slots])
            elif kind is Use:
                layer = a.layer
                # each slot's latest read is the one this runtime issued for it, of (layer, expert),
                # done without error: else ExpertReadError names the slot, what it should hold and holds
                pool.check_many(a.slots, [ticket[s] for s in a.slots], layer, a.experts)
                if on_use is None:
                    raise AssertionError(f"a Use of layer {layer} outside a layer turn")
                t = time.perf_counter()
                on_use(a)
                outside += time.perf_counter() - t
            else:
                raise AssertionError(f"not a cache action: {a!r}")
        if reads:
            pool.submit_many(reads)
        return outside, waited
