"""The expert cache's state (design §5): slots, maps, LRU ticks, pins, counters; the victim rule
and read-only views. `strata.cache.machine.step` is the only way to move from one state to
the next.

LRU: every slot has a `tick`; larger = nearer the front. Touching a slot gives it a fresh front
tick; freed slots get fresh back ticks (below every other), in slot order with the lowest slot
at the very back. Ticks are never reused, so the order is strict and `victim()` is an argmin.
"""

from __future__ import annotations

from dataclasses import dataclass

import numpy as np

from strata.cache.types import CacheConfig, CacheStats, Phase, SlotState

__all__ = ["CacheState", "initial_state", "victim", "slot_table", "lru_order", "decision_view"]

FREE, RES, PRE, LIMBO = (int(s) for s in SlotState)
_NONE = -1
_BIG = np.iinfo(np.int64).max

_IDLE, _AT, _AFTER = (int(p) for p in Phase)

# counter layout of `turn_counts` / `total_counts`; urgent misses by rank follow _RANK0
_FIELDS = ("windows", "decode_turns", "prompt_turns", "lookups", "hits", "readahead_hits",
           "late_readaheads", "urgent_misses", "prompt_misses", "prompt_passes", "reads_issued",
           "reads_ahead", "reads_cancelled", "evictions")
(_WINDOWS, _DECODE_TURNS, _PROMPT_TURNS, _LOOKUPS, _HITS, _RA_HITS, _LATE, _URGENT, _PROMPT_MISSES,
 _PASSES, _READS, _READS_AHEAD, _CANCELLED, _EVICTIONS) = range(len(_FIELDS))
_RANK0 = len(_FIELDS)

_ARRAYS = ("slot_state", "slot_key", "pin", "tick", "ticket", "inflight", "smap", "pmap")


@dataclass(frozen=True, slots=True, eq=False)
class CacheState:
    """Everything the machine knows. Arrays are read-only; use `step` to move on.

    Shapes: slot arrays [capacity]; `smap`, `pmap` [n_layers * n_experts]; counts
    [len(_FIELDS) + max_selected].
    """

    config: CacheConfig
    slot_state: np.ndarray  # int8 SlotState
    slot_key: np.ndarray  # int32 key of a RES/PRE slot; -1 for FREE and LIMBO
    pin: np.ndarray  # int64 the stamp that last pinned the slot; -1 after it is freed
    tick: np.ndarray  # int64 LRU position, larger = nearer the front; all distinct
    ticket: np.ndarray  # int64 ticket of the slot's last read; 0 = never read
    inflight: np.ndarray  # bool: the last read is not known to be complete (I/O timing only)
    smap: np.ndarray  # int32 key -> RES slot, -1 if none
    pmap: np.ndarray  # int32 key -> PRE slot (the read-ahead map), -1 if none
    stamp: int  # the current pin stamp
    front: int  # next front tick (increasing)
    back: int  # lowest back tick handed out so far (decreasing)
    next_ticket: int
    phase: int  # Phase: the event expected next
    layer: int  # the layer AtLayer expects (_AT) or AfterLayer expects (_AFTER)
    prompt: bool  # a region is held: prompt chunks, stamp per layer and pass
    turn_counts: np.ndarray  # int64 counts of the current turn
    total_counts: np.ndarray  # int64 counts since the start

    @property
    def turn(self) -> CacheStats:
        return _stats(self.turn_counts)

    @property
    def totals(self) -> CacheStats:
        return _stats(self.total_counts)

    @property
    def limbo(self) -> tuple[int, ...]:
        return tuple(int(s) for s in np.flatnonzero(self.slot_state == LIMBO))

    def slot_of(self, layer: int, expert: int) -> int:
        """The RES slot holding (layer, expert), or -1."""
        return int(self.smap[layer * self.config.n_experts + expert])

    def pinned(self, slot: int) -> bool:
        """Pinned with the current stamp: the GPU may read it in this window (or prompt pass)."""
        return int(self.pin[slot]) == self.stamp


def _stats(counts: np.ndarray) -> CacheStats:
    values = counts.tolist()
    return CacheStats(**dict(zip(_FIELDS, values)), urgent_misses_by_rank=tuple(values[_RANK0:]))


def _frozen(a: np.ndarray) -> np.ndarray:
    a.setflags(write=False)
    return a


def initial_state(config: CacheConfig) -> CacheState:
    """All slots FREE, in slot order with slot 0 at the LRU back; no window open."""
    cap, n_keys = config.capacity, config.n_layers * config.n_experts
    counts = np.zeros(_RANK0 + config.max_selected, np.int64)
    return CacheState(
        config=config,
        slot_state=_frozen(np.zeros(cap, np.int8)),
        slot_key=_frozen(np.full(cap, _NONE, np.int32)),
        pin=_frozen(np.full(cap, _NONE, np.int64)),
        tick=_frozen(np.arange(-cap, 0, dtype=np.int64)),
        ticket=_frozen(np.zeros(cap, np.int64)),
        inflight=_frozen(np.zeros(cap, bool)),
        smap=_frozen(np.full(n_keys, _NONE, np.int32)),
        pmap=_frozen(np.full(n_keys, _NONE, np.int32)),
        stamp=0, front=0, back=-cap, next_ticket=1, phase=_IDLE, layer=0, prompt=False,
        turn_counts=_frozen(counts.copy()), total_counts=_frozen(counts),
    )


def victim(state: CacheState) -> int:
    """The slot `step` would take next, or -1: the LRU-back-most slot not pinned with the
    current stamp, not LIMBO, and (in decode) not PRE."""
    return _victim(state.slot_state, state.pin, state.tick, state.stamp, not state.prompt)


def _victim(slot_state, pin, tick, stamp, decode) -> int:
    # Fast path, same answer: the LRU back-most slot is almost always eligible (pinned slots,
    # read-aheads and limbo were all put at the front when they got their state).
    s = int(np.argmin(tick))
    st = slot_state[s]
    if pin[s] != stamp and st != LIMBO and not (decode and st == PRE):
        return s
    ok = pin != stamp
    ok &= slot_state != LIMBO
    if decode:
        ok &= slot_state != PRE
    if not ok.any():
        return _NONE
    return int(np.argmin(np.where(ok, tick, _BIG)))


# ------------------------------------------------------------------ views


def slot_table(state: CacheState) -> tuple[str, ...]:
    """One string per slot: 'F', 'L', 'R<layer>:<expert>' or 'P<layer>:<expert>', with '*'
    when pinned by the current stamp. For tests and debugging."""
    out, E = [], state.config.n_experts
    for s in range(state.config.capacity):
        st, key = int(state.slot_state[s]), int(state.slot_key[s])
        text = "FRPL"[st] if key < 0 else f"{'FRPL'[st]}{key // E}:{key % E}"
        out.append(text + ("*" if state.pinned(s) and st in (RES, PRE) else ""))
    return tuple(out)


def lru_order(state: CacheState) -> tuple[int, ...]:
    """Slots from the LRU front (most recent) to the back."""
    return tuple(int(s) for s in np.argsort(-state.tick, kind="stable"))


def decision_view(state: CacheState) -> tuple:
    """Everything that decides future slot choices: the whole state except the in-flight flags
    and the late count (the only parts ReadDone may change). Equal views => equal futures."""
    late = np.array(state.total_counts)
    late[_LATE] = 0
    arrays = tuple(getattr(state, n).tobytes() for n in _ARRAYS if n != "inflight")
    return arrays + (state.stamp, state.front, state.back, state.next_ticket, state.phase,
                     state.layer, state.prompt, late.tobytes())
