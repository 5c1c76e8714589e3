"""One byte budget for expert records and PLE pages, against today's two caches: a replay model.

A PLE model (Qwen4-Exp) reads, per token, expert records (the cache machine's arena) and PLE
n-gram pages (the row cache, strata.runtime.ngram_rows). Today each has its own budget:
`ple_reserve` for the pages, the rest for the arena. This model asks what one shared budget
would do, over a routing trace and the tokens' n-gram pages, counting decisions only (no I/O
timing): misses, PLE pages read at use (the PLE waits), bytes read.

Both layouts run the same rules, so the comparison isolates the sharing:

- Experts (the cache machine's decode turn, split-turn order, no prefetch touch): a window pins
  what it selects; a selected expert is a hit, a read-ahead claim, or an urgent miss; after layer
  l the unclaimed read-aheads of l wait one layer in limbo, then up to K guesses for l+1 are read
  ahead. Victims: least recently used, never pinned by the window, a read-ahead or in limbo.
  Separate, on a pool of whole records, its counts equal `strata.cache.replay`'s
  (tests/tools/test_tools_one_arena.py holds it to that).
- PLE pages (the row cache's rules): before layer 0 every PLE layer's pages are read ahead, in
  layer order, pinned until their layer uses them; a layer whose new pages would leave less than
  one page of room stops the read-ahead, and the layers it did not reach read at use (a PLE
  wait). Used pages go to the LRU front.
- Combined: one pool of `budget` bytes, one LRU over records and pages, each weighing its bytes;
  a victim search evicts the LRU-back-most eligible item of either kind until the new one fits.

The PLE layer uses its pages before its layer's expert turn (the PLE module is part of the
mixer; the MoE follows it).
"""

from __future__ import annotations

import collections
from dataclasses import dataclass

import numpy as np

from strata.errors import ArenaTooSmallError

__all__ = ["ArenaCounts", "simulate", "ple_pages_per_token"]


@dataclass(frozen=True)
class ArenaCounts:
    """Totals over a replay (decode tokens). Per-token values: divide by `tokens`."""

    tokens: int
    urgent_misses: int  # expert records read at their turn (the GPU waits)
    readahead_hits: int
    reads_ahead: int  # expert records read ahead (guesses)
    ple_pages_read: int  # PLE pages read (ahead or at use)
    ple_waits: int  # PLE pages read at use: not read ahead before layer 0
    bytes_read: int  # expert records + PLE pages

    def per_token(self) -> dict:
        t = max(self.tokens, 1)
        return dict(misses=self.urgent_misses / t, reads_ahead=self.reads_ahead / t,
                    ple_reads=self.ple_pages_read / t, ple_waits=self.ple_waits / t, bytes=self.bytes_read / t)


class _Pool:
    """Bytes, an LRU (oldest first) and the items that may not be victims now."""

    def __init__(self, capacity: int) -> None:
        self.capacity, self.used = capacity, 0
        self.lru: collections.OrderedDict = collections.OrderedDict()  # key -> bytes
        self.protected: set = set()

    def touch(self, key) -> None:
        self.lru.move_to_end(key)

    def room(self, exclude=()) -> int:
        """Free bytes plus what could be evicted, less the items in `exclude` (about to be pinned)."""
        evictable = sum(b for k, b in self.lru.items() if k not in self.protected and k not in exclude)
        return self.capacity - self.used + evictable

    def admit(self, key, nbytes: int, evicted: list) -> None:
        """Make room (LRU-back-most eligible first), then add `key` at the LRU front."""
        while self.capacity - self.used < nbytes:
            victim = next((k for k in self.lru if k not in self.protected), None)
            if victim is None:
                raise ArenaTooSmallError(f"arena of {self.capacity} bytes: no victim for a {nbytes}-byte item "
                                         f"({len(self.protected)} items pinned, read ahead or in limbo)")
            self.used -= self.lru.pop(victim)
            evicted.append(victim)
        self.lru[key] = nbytes
        self.used += nbytes

    def drop(self, key) -> None:
        self.used -= self.lru.pop(key)
        self.protected.discard(key)


def simulate(selected: np.ndarray, guesses: np.ndarray | None, pages: list, *, record_bytes: int, page_bytes: int,
             budget: int, ple_bytes: int | None, ple_layers: tuple[int, ...], prefetch_depth: int = 10,
             used_pages_last: bool = False) -> ArenaCounts:
    """Replay decode tokens through one budget (`ple_bytes` None) or two (`ple_bytes` for the row
    cache, `budget - ple_bytes` for the arena, each rounded down to whole items as the runtime does).

    Shapes: selected int [T, L, k] (rank order); guesses int [T, L, G] (after layer l, ranked
    guesses for l+1) or None; pages: per token, per PLE index (`ple_layers[i]` is its layer), the
    global page ids its rows fall in (module docstring; `ple_pages_per_token`).
    used_pages_last: a used PLE page goes to the LRU back, the first victim, instead of the front
    (hashed n-gram pages come back only where the text repeats itself).
    Raises ArenaTooSmallError when a victim search finds nothing.
    """
    if ple_bytes is None:
        experts = ple = _Pool(budget)
    else:
        experts = _Pool((budget - ple_bytes) // record_bytes * record_bytes)
        ple = _Pool(ple_bytes // page_bytes * page_bytes)
    n_tokens, n_layers = selected.shape[:2]
    sel = selected.tolist()
    gs = guesses[..., :prefetch_depth].tolist() if guesses is not None else None
    ple_at = {layer: i for i, layer in enumerate(ple_layers)}
    res, pre, limbo, pins = set(), {}, [], set()  # expert keys: resident; read ahead -> layer; limbo; window pins
    held: dict[int, list] = {}  # PLE index -> pages pinned by this token's read-ahead
    c = dict(urgent=0, ra_hits=0, ahead=0, ple_reads=0, ple_waits=0, bytes=0)
    evicted: list = []

    def settle() -> None:  # evicted expert keys leave the resident set
        for key in evicted:
            res.discard(key)
        evicted.clear()

    for t in range(n_tokens):
        experts.protected -= pins  # BeginWindow: the previous window's pins protect nothing
        pins.clear()
        held = _ple_read_ahead(ple, pages[t], page_bytes, c, evicted)
        settle()
        for layer in range(n_layers):
            if layer in ple_at:
                _ple_use(ple, pages[t][ple_at[layer]], held.pop(ple_at[layer], None), page_bytes, c, evicted,
                         used_pages_last)
                settle()
            for e in sel[t][layer]:
                key = (layer, e)
                if key in res:
                    experts.touch(key)
                elif key in pre:
                    del pre[key]
                    res.add(key)
                    experts.touch(key)
                    c["ra_hits"] += 1
                else:
                    experts.admit(key, record_bytes, evicted)
                    settle()
                    res.add(key)
                    c["urgent"] += 1
                    c["bytes"] += record_bytes
                pins.add(key)
                experts.protected.add(key)
            # AfterLayer (split turn): free last layer's limbo, park this layer's unclaimed read-aheads
            for key in limbo:
                experts.drop(key)
            limbo = [k for k, at in pre.items() if at == layer]
            for key in limbo:
                del pre[key]
            if gs is not None and layer + 1 < n_layers:
                for g in gs[t][layer]:
                    key = (layer + 1, g)
                    if key in res or key in pre:
                        continue
                    experts.admit(key, record_bytes, evicted)
                    settle()
                    pre[key] = layer + 1
                    experts.protected.add(key)
                    c["ahead"] += 1
                    c["bytes"] += record_bytes
    return ArenaCounts(n_tokens, c["urgent"], c["ra_hits"], c["ahead"], c["ple_reads"], c["ple_waits"], c["bytes"])


def _ple_read_ahead(pool: _Pool, token_pages: list, page_bytes: int, c: dict, evicted: list) -> dict:
    """Before layer 0: every PLE index's pages, in order, pinned until used; stop at the first
    index whose new pages would leave less than one page of room (the row cache's rule)."""
    held = {}
    for i, pages in enumerate(token_pages):
        mine = {("ple", p) for p in pages}
        new = [k for k in (("ple", p) for p in sorted(set(pages))) if k not in pool.lru]
        if len(new) * page_bytes + page_bytes > pool.room(exclude=mine):
            break
        for key in mine:
            if key in pool.lru:
                pool.touch(key)
        for key in new:
            pool.admit(key, page_bytes, evicted)
            c["ple_reads"] += 1
            c["bytes"] += page_bytes
        pool.protected |= mine
        held[i] = mine
    return held


def _ple_use(pool: _Pool, pages, held, page_bytes: int, c: dict, evicted: list, last: bool) -> None:
    """A PLE layer's turn: its read-ahead pages are used (unpinned, to the LRU front, or the back
    when `last`); pages not read ahead are read now, each a wait."""
    for key in (("ple", p) for p in sorted(set(pages))):  # the row cache's order: pages ascending
        if held is not None and key in held:
            pool.protected.discard(key)
        elif key not in pool.lru:
            pool.admit(key, page_bytes, evicted)
            c["ple_reads"] += 1
            c["ple_waits"] += 1
            c["bytes"] += page_bytes
        pool.lru.move_to_end(key, last=not last)


def ple_pages_per_token(cfg, tokens: np.ndarray, tables) -> list:
    """Per token, per PLE index, the global pages its n-gram rows fall in (the row store's
    layout `tables`: strata.formats.ngram_rows_file.store_layout). Ids from the model's hash.

    Shapes: tokens int [T] -> T lists of (one list per PLE index of page ids)
    """
    from strata.runtime.ngram_source import ModelRowIds

    ids = ModelRowIds(cfg)(np.empty(0, np.int64), np.asarray(tokens, np.int64))  # PLE index -> [T, heads]
    by_index = {t.layer: t for t in tables}
    per_index = {i: (by_index[i].first_page + a // by_index[i].rows_per_page) for i, a in ids.items()}
    return [[per_index[i][t].tolist() for i in sorted(per_index)] for t in range(len(tokens))]
