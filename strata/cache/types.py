"""The vocabulary of the expert-cache state machine (design §5): configuration, events, actions,
statistics and errors. The machine itself is `strata.cache.machine`; docs/cache.md explains it.

Keys are (layer, expert) pairs; inside the machine they are encoded as `layer * n_experts + expert`.
"""

from __future__ import annotations

import enum
from dataclasses import dataclass

from strata.errors import ArenaTooSmallError, ConfigError, StrataError

__all__ = [
    "SlotState", "Phase", "CacheConfig", "min_capacity", "CacheFullError", "CacheProtocolError",
    "BeginWindow", "AtLayer", "AfterLayer", "HoldRegion", "ReadDone", "Event",
    "Read", "Cancel", "WaitFor", "Evict", "Use", "Action", "DECISIONS", "CacheStats", "stats_delta", "stats_sum",
]


class SlotState(enum.IntEnum):
    FREE = 0  # holds nothing; sits at the LRU back
    RES = 1  # claimed: in `smap`, the GPU may read it
    PRE = 2  # read-ahead issued (in flight or done), not yet claimed; in the read-ahead map only
    LIMBO = 3  # retired read-ahead, possibly still reading; never a victim until released


class Phase(enum.IntEnum):
    """Which event the machine expects next (ReadDone is welcome at any time)."""

    IDLE = 0  # between windows: BeginWindow or HoldRegion
    AT_LAYER = 1  # AtLayer(state.layer)
    AFTER_LAYER = 2  # AfterLayer(state.layer)


class CacheFullError(ArenaTooSmallError):
    """`victim()` found no slot: everything is pinned by the current window, in limbo or (in
    decode) an unclaimed read-ahead. A clear error instead of a loop (design §5)."""


class CacheProtocolError(StrataError, ValueError):
    """Events arrived out of order (e.g. `AtLayer(3)` after `AtLayer(1)`) or name an invalid
    layer/expert, or a turn selects the same expert twice."""


# ------------------------------------------------------------------ configuration


def min_capacity(n_layers: int, top_k: int, prefetch_depth: int, *, window: int = 1,
                 split_turn: bool = True, prefetch2: bool = False, n_experts: int | None = None,
                 layer_pins: bool = False) -> int:
    """The smallest arena (in slots) on which `victim()` can never fail in decode.

    A window pins every layer's selections (n_layers × top_k × window distinct slots at most;
    with `layer_pins` a pin lasts one layer's turn, so one layer's: top_k × window);
    read-aheads need slots beside them. Unclaimed read-aheads alive at one victim search:
    - split turn: one layer's PRE (K) + the previous layer's retired ones in LIMBO (K) -> 2K;
    - old in-turn order: unused read-aheads are freed before the lookups, no limbo -> K;
    - prefetch2 adds a second layer ahead: up to 2K PRE for the next layer (two guesses at it),
      K for the one after, and (split) 2K in limbo -> 5K split, 3K old order.
    The split-turn bound without prefetch2 is tight (tests/cache/test_cache_golden.py builds the
    case that fails at one slot less); the others are sufficient (tests check that they are).
    """
    per_layer, k = top_k * window, prefetch_depth
    if n_experts is not None:  # a turn can't select, nor guess, more experts than there are
        per_layer, k = min(per_layer, n_experts), min(k, n_experts)
    ahead = {(True, False): 2 * k, (False, False): k, (True, True): 5 * k, (False, True): 3 * k}
    return (1 if layer_pins else n_layers) * per_layer + ahead[(split_turn, prefetch2)]


@dataclass(frozen=True)
class CacheConfig:
    """Everything that decides which slot holds what. Defaults are the reference engine's (design §6)."""

    capacity: int  # arena slots
    n_layers: int
    n_experts: int  # routed experts per layer
    top_k: int  # experts a position selects per layer
    window: int = 1  # positions per decode window (T >= 1); a stamp lasts one window
    prefetch_depth: int = 10  # K: guesses read ahead per layer (16 is the recommended bench setting)
    prefetch_touch: bool = False  # move resident guesses to the LRU front (the old behaviour)
    prefetch2: bool = False  # also read ahead two layers ahead (AfterLayer.guesses2)
    split_turn: bool = True  # retire/read ahead after the GPU is released (False: the old in-turn order)
    # a decode pin lasts one layer's turn, not the window: for a runtime whose compute of layer l
    # has finished before AtLayer(l+1) (numpy's); the arena then needs one layer's selections only
    layer_pins: bool = False

    def __post_init__(self) -> None:
        for name in ("capacity", "n_layers", "n_experts", "top_k", "window"):
            value = getattr(self, name)
            if not isinstance(value, int) or value < 1:
                raise ConfigError(f"cache config: {name} must be a positive int, got {value!r}")
        if self.top_k > self.n_experts:
            raise ConfigError(f"cache config: top_k {self.top_k} > n_experts {self.n_experts}")
        if not isinstance(self.prefetch_depth, int) or self.prefetch_depth < 0:
            raise ConfigError(f"cache config: prefetch_depth must be an int >= 0, got {self.prefetch_depth!r}")
        for name in ("prefetch_touch", "prefetch2", "split_turn", "layer_pins"):
            if not isinstance(getattr(self, name), bool):
                raise ConfigError(f"cache config: {name} must be a bool, got {getattr(self, name)!r}")

    @property
    def max_selected(self) -> int:
        """The most experts one decode turn may select (the union over the window's positions)."""
        return min(self.top_k * self.window, self.n_experts)

    @property
    def min_capacity(self) -> int:
        return min_capacity(self.n_layers, self.top_k, self.prefetch_depth, window=self.window,
                            split_turn=self.split_turn, prefetch2=self.prefetch2, n_experts=self.n_experts,
                            layer_pins=self.layer_pins)


# ------------------------------------------------------------------ events


def _ints(values) -> tuple[int, ...]:
    return tuple(int(v) for v in values)


@dataclass(frozen=True, slots=True)
class BeginWindow:
    """A new decode window (or, inside a held region, a new prompt chunk) starts at layer 0.
    In decode it advances the pin stamp: the previous window's pins no longer protect anything."""


@dataclass(frozen=True, slots=True)
class AtLayer:
    """The host's turn for `layer`: `selected` in rank order (decode: the union over the window's
    positions, at most top_k × window; prompt: the union over the chunk, any order)."""

    layer: int
    selected: tuple[int, ...]

    def __post_init__(self) -> None:
        object.__setattr__(self, "selected", _ints(self.selected))


@dataclass(frozen=True, slots=True)
class AfterLayer:
    """The GPU was released after `layer`: `guesses` are ranked guesses for layer+1 (only the
    first K are used), `guesses2` for layer+2 (used only when prefetch2 is on). Guesses for a
    layer past the last are ignored."""

    layer: int
    guesses: tuple[int, ...] = ()
    guesses2: tuple[int, ...] = ()

    def __post_init__(self) -> None:
        object.__setattr__(self, "guesses", _ints(self.guesses))
        object.__setattr__(self, "guesses2", _ints(self.guesses2))


@dataclass(frozen=True, slots=True)
class HoldRegion:
    """Prompt processing starts (`begin=True`) or ends. Limbo is released at both edges so
    prompt stream-ins cannot leak into decode (or decode read-aheads into the prompt)."""

    begin: bool


@dataclass(frozen=True, slots=True)
class ReadDone:
    """The read with `ticket` into `slot` has completed (or was dropped). Never changes a
    decision; a stale notice (the ticket is not the slot's read in flight) is ignored."""

    slot: int
    ticket: int


Event = BeginWindow | AtLayer | AfterLayer | HoldRegion | ReadDone


# ------------------------------------------------------------------ actions


@dataclass(frozen=True, slots=True)
class Read:
    """Start reading (layer, expert) into `slot`: urgent (the GPU waits on it this turn) or
    low priority (a read-ahead). `ticket` names this read in ReadDone and Cancel."""

    slot: int
    layer: int
    expert: int
    urgent: bool
    ticket: int


@dataclass(frozen=True, slots=True)
class Cancel:
    """Drop read `ticket` into `slot` if it is still queued; a no-op if it already completed.
    Issued for every retired read-ahead, so the action stream does not depend on I/O timing."""

    slot: int
    ticket: int


@dataclass(frozen=True, slots=True)
class WaitFor:
    """Block until the reads into these slots have completed (or been dropped). The only
    action whose content depends on ReadDone notices: slots already known done are left out."""

    slots: tuple[int, ...]


@dataclass(frozen=True, slots=True)
class Evict:
    """(layer, expert) leaves `slot` (a claimed expert, or in a prompt an unclaimed read-ahead)."""

    slot: int
    layer: int
    expert: int


@dataclass(frozen=True, slots=True)
class Use:
    """The GPU computes `experts` of `layer` from `slots` (same order); every read they need is
    complete once the preceding actions are applied. Decode: one per AtLayer. Prompt: one per
    pass; the runtime finishes a pass on the GPU before applying what follows it."""

    layer: int
    experts: tuple[int, ...]
    slots: tuple[int, ...]


Action = Read | Cancel | WaitFor | Evict | Use
DECISIONS = (Read, Cancel, Evict, Use)  # the action types that must not depend on I/O timing


# ------------------------------------------------------------------ statistics


@dataclass(frozen=True)
class CacheStats:
    """Counts for one turn (`state.turn`: AtLayer(l) then AfterLayer(l)) or since the start
    (`state.totals`). `late_readaheads` is the only count that depends on ReadDone timing."""

    windows: int = 0  # BeginWindow events (decode windows and prompt chunks)
    decode_turns: int = 0
    prompt_turns: int = 0
    lookups: int = 0  # selected experts looked up (decode and prompt)
    hits: int = 0  # found in smap
    readahead_hits: int = 0  # found as a read-ahead (PRE) and claimed
    late_readaheads: int = 0  # of those, claimed before their ReadDone: the turn waits on them
    urgent_misses: int = 0  # decode misses: the GPU waits on a read it could not hide
    urgent_misses_by_rank: tuple[int, ...] = ()  # decode misses by selected rank 0..max_selected-1
    prompt_misses: int = 0  # prompt stream-ins
    prompt_passes: int = 0  # Use actions in prompt layers (>1 per layer when the union overflows)
    reads_issued: int = 0  # every Read action
    reads_ahead: int = 0  # of those, read-aheads
    reads_cancelled: int = 0  # every Cancel action (retired or evicted read-aheads)
    evictions: int = 0  # every Evict action


def _combine(a: CacheStats, b: CacheStats, sign: int) -> CacheStats:
    ra, rb = a.urgent_misses_by_rank, b.urgent_misses_by_rank
    n = max(len(ra), len(rb))  # a missing by-rank tuple (a fresh state's) counts as zeros
    ra, rb = ra + (0,) * (n - len(ra)), rb + (0,) * (n - len(rb))
    fields = {f: getattr(a, f) + sign * getattr(b, f) for f in CacheStats.__dataclass_fields__
              if f != "urgent_misses_by_rank"}
    return CacheStats(**fields, urgent_misses_by_rank=tuple(x + sign * y for x, y in zip(ra, rb)))


def stats_delta(after: CacheStats, before: CacheStats) -> CacheStats:
    """The counts accumulated between two snapshots of `totals`, field by field."""
    return _combine(after, before, -1)


def stats_sum(a: CacheStats, b: CacheStats) -> CacheStats:
    """a + b, field by field (counts of separate stretches, e.g. every prompt of a run)."""
    return _combine(a, b, 1)
