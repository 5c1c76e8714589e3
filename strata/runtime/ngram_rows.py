"""The row cache: PLE n-gram rows streamed from a row store into a small fixed cache of pages.

A PLE layer needs, for every token, one row per n-gram head of its table; the ids are hashed
from the last few tokens, so they are known as soon as the token is. The engine therefore issues
every PLE layer's reads before layer 0 (`prefetch`: an exact read-ahead, not a guess) and each
PLE layer waits only for its own pages (`rows`), by which time the layers before it have
computed while the disk worked.

- Slots: `capacity` pages of `page_bytes` in one anonymous mapping (strata.runtime.page_reader);
  the row-store page is the unit of reading and of caching.
- Replacement: least recently used among unpinned pages. A prefetched page is pinned until its
  layer's `rows` has used it, so no read-ahead is evicted before its use; a page still reading is
  never a victim (its slot would be overwritten under the read): unpinned while reading (its
  window was superseded) it waits in limbo until the read is done.
- A prefetch that would leave no slot free stops at a layer boundary: the layers it did not reach
  read at use. `rows` takes any number of ids (a long prompt), in chunks of the free slots.
- Counters, per PLE layer: rows read (their page was read for this request), rows hit (already
  cached), pages and bytes read, seconds waited; totals over the cache's life (`stats`) and the
  latest prefetch window's (`last_window`: one token when decoding).

Which pages and rows a request names, and their decoding out of the slots: strata.runtime.row_locator
(made once per table, a prefetch's layers located in one pass).

`StreamedNgramRows` is an `NgramRows` (strata.reference.ngram_rows): the same float32 values as
`ResidentNgramRows` over the same stored rows, bit for bit.
"""

from __future__ import annotations

import collections
from typing import Callable, Mapping

import numpy as np

from strata.formats.ngram_rows_file import NgramRowsFile
from strata.runtime.io import IOHook, ReadRequest
from strata.runtime.ngram_stats import RowCounts, RowStats  # noqa: F401 - re-exported
from strata.runtime.advised_reader import AdvisedReader, advice_available
from strata.runtime.page_reader import PAGES_PER_JOB, PageReader, page_slots
from strata.runtime.row_locator import RowLocator

__all__ = ["RowCounts", "RowStats", "RowIds", "StreamedNgramRows"]


RowIds = Callable[[np.ndarray, np.ndarray], Mapping[int, np.ndarray]]
"""The model's n-gram hash behind a callable: (the tokens before a window, the window's tokens
[T]) -> PLE layer -> row ids [T, heads] (Qwen4-Exp: strata.reference.ngram_hash). The ids of a
token depend on it and the few before it only, so they are known before layer 0."""


# "advise": the kernel reads ahead, the owner copies (strata.runtime.advised_reader; Linux); "threads":
# Python reader threads (strata.runtime.page_reader; O_DIRECT where allowed, and where fadvise is
# missing); "auto": advise where it exists
READERS = ("auto", "advise", "threads")
class StreamedNgramRows:
    """PLE rows from a row store through a cache of `capacity` pages (module docstring). One
    owner thread calls it (the engine's); its reader threads only fill slots."""

    def __init__(self, store: NgramRowsFile, *, capacity: int, threads: int = 4, verify: bool = True,
                 direct: bool = True, timeout: float = 60.0, hook: IOHook | None = None,
                 pages_per_job: int = PAGES_PER_JOB, row_ids: "RowIds | None" = None,
                 context_tokens: int | None = None, reader: str = "auto",
                 latency: Callable[[ReadRequest], float] | None = None) -> None:
        if capacity < 2:  # one page for a prefetch, one spare for a layer that reads at use
            raise ValueError(f"a row cache needs at least 2 pages, got {capacity}")
        self.store, self.capacity, self.row_ids = store, capacity, row_ids
        self.context_tokens = context_tokens  # history the hash reads (Qwen4-Exp: ngram_size - 1); None: all
        self.slots = page_slots(capacity, store.page_bytes)  # [capacity, page_bytes]
        if reader not in READERS:
            raise ValueError(f"reader must be one of {READERS}, got {reader!r}")
        if reader == "advise" or (reader == "auto" and advice_available()):
            self.reader = AdvisedReader(store, self.slots, verify=verify, hook=hook, latency=latency)
        else:
            self.reader = PageReader(store, self.slots, threads=threads, direct=direct, verify=verify,
                                     timeout=timeout, hook=hook, pages_per_job=pages_per_job)
        self._slot_of: dict[int, int] = {}  # global page -> slot
        self._ticket: dict[int, int] = {}  # page -> its read, until the read has been finished
        self._free = list(range(capacity - 1, -1, -1))
        self._lru: collections.OrderedDict[int, None] = collections.OrderedDict()  # unpinned, oldest first
        # page -> its pins (a plain dict: a Counter's missing keys and deletions run Python code)
        self._pins: dict[int, int] = {}
        self._limbo: set[int] = set()  # unpinned pages whose read is not finished: no victims yet
        self._held: dict[int, list[int]] = {}  # layer -> pages the current prefetch pinned for it
        self._issued: dict[int, set] = {}  # layer -> pages the current prefetch read for it
        # layer -> [rows_read, rows_hit, pages_read, bytes_read, wait_s], RowCounts' order: plain lists,
        # added to twice per PLE layer per token (a frozen dataclass per addition cost 5 µs each)
        self._totals: dict[int, list] = {}
        self._window: dict[int, list] = {}
        self._positions = 0
        self._where = RowLocator(store, self.slots)
        self._located: dict[int, tuple] = {}  # layer -> the latest prefetch's `locate_all` for it

    # -------------------------------------------------------- the protocol

    def prefetch(self, ids_by_layer: Mapping[int, np.ndarray], *, positions: int = 1) -> None:
        """Issue the reads of every listed PLE layer, in layer order, and pin their pages until
        each layer's `rows` uses them. Starts a new window: the previous one's unused pins go.

        Shapes:
            ids_by_layer: layer -> int row ids [*S] (one token's heads: [1, heads] or [heads])
        """
        for layer in list(self._held):
            self._unpin(self._held.pop(layer))
        self._sweep()
        self._issued, self._window = {}, {}
        self._located = self._where.locate_all(ids_by_layer)
        self._positions += positions
        # _pin and _claim inlined: this loop runs for every page of every PLE layer of a token
        slot_of, lru, pins, limbo, free = self._slot_of, self._lru, self._pins, self._limbo, self._free
        reads, stride = [], self.store.page_bytes
        for layer in sorted(ids_by_layer):
            pages = self._located[layer][1]
            new = [p for p in pages if p not in slot_of]
            cached_victims = sum(1 for p in pages if p in lru) if len(new) < len(pages) else 0  # pinned below
            if len(new) > len(free) + len(lru) - cached_victims - 1:  # keep a slot for layers that read at use
                break
            if len(new) < len(pages):
                fresh = set(new)
                for p in pages:
                    if p not in fresh:
                        pins[p] = pins.get(p, 0) + 1
                        lru.pop(p, None)
                        limbo.discard(p)
            for p in new:  # not cached, so neither pinned nor a victim
                pins[p] = 1
                if free:
                    slot = free.pop()
                else:
                    slot = slot_of.pop(lru.popitem(last=False)[0])
                slot_of[p] = slot
                reads.append((p, slot))
            self._held[layer] = pages
            self._issued[layer] = set(new)
            self._count(layer, 0, 0, len(new), len(new) * stride, 0.0)
        self._submit(reads, urgent=False)

    def read_ahead(self, context, tokens: np.ndarray) -> Mapping[int, np.ndarray]:
        """What an engine calls before layer 0 of a window: every PLE layer's ids (`row_ids`, the
        model's hash), prefetched. Returns them (the PLE layers may take them instead of hashing
        again). Only the last `context_tokens` of the context reach the hash, so a long session
        costs nothing per token.

        Shapes: context int [C] (the tokens before the window: a list or array), tokens int [T]
        """
        if self.row_ids is None:
            raise ValueError("read_ahead needs the model's row ids: give StreamedNgramRows(..., row_ids=)")
        if self.context_tokens is not None:
            context = context[max(0, len(context) - self.context_tokens):]
        ids = self.row_ids(np.asarray(context, np.int64), np.asarray(tokens, np.int64))
        self.prefetch(ids, positions=len(tokens))
        return ids

    def rows(self, layer: int, row_ids: np.ndarray) -> np.ndarray:
        """The rows `row_ids` of `layer`'s table, waiting only for pages not yet read.

        Shapes:
            row_ids: int [*S] -> float32 [*S, width]
        """
        ids = np.asarray(row_ids, dtype=np.int64)
        located = self._located.pop(layer, None)
        flat = ids.reshape(-1)
        if located is not None and located[0].shape == flat.shape and (located[0] == flat).all():
            upages, which, within = located[1:]  # the ids the prefetch located (the read-ahead's case)
        else:
            upages, which, within = self._where.pages(layer, ids)
        held = self._held.pop(layer, [])  # pinned by the prefetch: they stay pinned until gathered
        issued = self._issued.pop(layer, set())
        slot_of = self._slot_of
        cached, todo = [], []
        for p in upages:
            (cached if p in slot_of else todo).append(p)
        if len(held) == len(cached) and held == cached:  # the read-ahead's case: every cached page is held
            pinned = []
        else:
            held_set = set(held)
            pinned = [p for p in cached if p not in held_set]  # cached pages the prefetch did not pin
            self._pin(pinned)
        out = np.empty((len(which), self.store.tables[layer].width), np.float32)
        batch, read_now, wait = cached, [], 0.0
        try:
            while True:
                wait += self._settle(batch)
                self._gather(layer, upages, which, within, batch, out)
                self._unpin(pinned)
                self._unpin(held)
                pinned, held = [], []
                if not todo:
                    break
                self._sweep()
                room = self._available()
                if room == 0:  # pragma: no cover - a prefetch always leaves a slot
                    raise RuntimeError(f"row cache of {self.capacity} pages has every page pinned")
                batch, todo = todo[:room], todo[room:]
                reads = [(p, self._claim(p)) for p in batch]
                self._pin(batch)
                pinned = batch
                self._submit(reads, urgent=True)
                read_now += batch
        except BaseException:
            self._unpin(pinned)
            self._unpin(held)
            raise
        n_read = 0
        if issued or read_now:
            fresh = issued.union(read_now)
            is_fresh = [p in fresh for p in upages]
            if all(is_fresh):  # a new token's usual case: every page read for it
                n_read = len(which)
            else:
                per_page = np.bincount(which, minlength=len(upages))  # requested rows of each unique page
                n_read = int(per_page[np.array(is_fresh, bool)].sum())
        self._count(layer, n_read, len(which) - n_read, len(read_now), len(read_now) * self.store.page_bytes, wait)
        return out.reshape(*ids.shape, out.shape[1])

    # -------------------------------------------------------- counters

    def stats(self) -> RowStats:
        """Totals over the cache's life (subtract an earlier one with `minus`)."""
        return RowStats(self._positions, {l: RowCounts(*c) for l, c in self._totals.items()})

    def last_window(self) -> dict[int, RowCounts]:
        """Per PLE layer, the counts since the latest `prefetch` (one token when decoding)."""
        return {l: RowCounts(*c) for l, c in self._window.items()}

    # -------------------------------------------------------- slots

    def _available(self) -> int:
        """Slots a read may take now: free ones and unpinned pages (none of them still reading)."""
        return len(self._free) + len(self._lru)

    def _claim(self, page: int) -> int:
        """A slot for `page`: a free one, else the least recently used unpinned page's."""
        if self._free:
            slot = self._free.pop()
        else:
            victim, _ = self._lru.popitem(last=False)
            slot = self._slot_of.pop(victim)
        self._slot_of[page] = slot
        return slot

    def _sweep(self) -> None:
        """Limbo pages whose read is done become victims; one that failed is dropped, silently:
        no layer used it (a failed read raises only where its rows are needed)."""
        for p in list(self._limbo):
            if self.reader.cancel(self._ticket[p]):  # never read (AdvisedReader): the slot holds nothing
                del self._ticket[p]
                self._drop(p)
                continue
            if self.reader.pending(self._ticket[p]):
                continue
            self._limbo.discard(p)
            try:
                self.reader.finish(self._ticket.pop(p))
            except Exception:  # noqa: BLE001 - see the docstring
                self._drop(p)
                continue
            self._lru[p] = None

    def _pin(self, pages) -> None:
        pins, lru, limbo = self._pins, self._lru, self._limbo
        for p in pages:  # python ints
            pins[p] = pins.get(p, 0) + 1
            lru.pop(p, None)
            limbo.discard(p)

    def _unpin(self, pages) -> None:
        pins, lru, ticket = self._pins, self._lru, self._ticket
        for p in pages:  # python ints
            n = pins.get(p)
            if n is None:  # dropped after a failed read
                continue
            if n > 1:
                pins[p] = n - 1
                continue
            del pins[p]
            if p in ticket:  # still reading, or read and not yet checked
                self._limbo.add(p)
            else:
                lru[p] = None  # most recently used

    def _submit(self, reads: list[tuple[int, int]], *, urgent: bool) -> None:
        """Queue (page, slot) reads and keep each page's ticket until its read is finished."""
        if reads:
            self._ticket.update(zip((p for p, _ in reads), self.reader.submit_many(reads, urgent=urgent)))

    def _settle(self, pages: list[int]) -> float:
        """Wait for these pages' reads and raise any read's error; the seconds blocked. Every
        page's read is finished before the first error is raised (each failed page dropped)."""
        ticket = self._ticket
        reading = [p for p in pages if p in ticket]
        if not reading:
            return 0.0
        tickets = [ticket[p] for p in reading]
        waited = self.reader.wait(tickets)  # may time out (PageReader): the pages stay reading
        for p in reading:
            del ticket[p]
        failed = self.reader.finish_many(tickets)
        for i, _ in failed:
            self._drop(reading[i])
        if failed:
            raise failed[0][1]
        return waited

    def _drop(self, page: int) -> None:
        """Forget a page whose read failed: its slot is free again, a later request re-reads it."""
        self._free.append(self._slot_of.pop(page))
        self._lru.pop(page, None)
        self._pins.pop(page, None)
        self._limbo.discard(page)

    def _gather(self, layer: int, upages: list[int], which: np.ndarray, within: np.ndarray, pages: list[int],
                out: np.ndarray) -> None:
        """Decode into `out` the rows whose page is among `pages` (all resident and read).
        upages: the request's unique pages; which [n]: each row's index into them."""
        if not pages:
            return
        slot_of = self._slot_of
        if len(pages) == len(upages):  # the usual call: every page at once
            slots = np.array([slot_of[p] for p in upages], np.int64)[which]
            self._where.decode(layer, slots, within, out)
            return
        now = set(pages)
        slots = np.array([slot_of[p] if p in now else -1 for p in upages], np.int64)[which]
        mask = slots >= 0
        part = np.empty((int(mask.sum()), out.shape[1]), np.float32)
        self._where.decode(layer, slots[mask], within[mask], part)
        out[mask] = part

    def _count(self, layer: int, *c) -> None:
        """Add (rows_read, rows_hit, pages_read, bytes_read, wait_s) to the layer's counts."""
        for book in (self._totals, self._window):
            acc = book.get(layer)
            if acc is None:
                book[layer] = list(c)
            else:
                for i, v in enumerate(c):
                    acc[i] += v

    # -------------------------------------------------------- lifetime

    def close(self) -> None:
        self.reader.close()

    def __enter__(self) -> "StreamedNgramRows":
        return self

    def __exit__(self, *exc) -> None:
        self.close()

