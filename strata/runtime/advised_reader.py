"""The row cache's other reader: the kernel reads ahead, the owner thread copies.

`PageReader` (strata.runtime.page_reader) reads each page on a Python thread; measured on the
H200's host (benchmarks/ngram_rows.py, a token of 561 pages from the page cache) it costs ~30 µs
of GIL-serialized Python per page, ~17 ms a token. This reader issues no Python work to other
threads at all: `submit_many` asks the kernel to read each page ahead (`posix_fadvise(WILLNEED)`:
the reads go to the disk's queue at once, as deep as it is), and the page is copied into its slot
with one buffered `preadv` when it is needed (`wait`), blocking only if the kernel has not
finished it. Without a hook a `wait` copies its whole batch in one loop and checks the lengths
and CRC-32s over the batch with numpy; the whole row cache costs ~11 µs of CPU a page on this
project's 2-core machine, ~5 µs of it the kernel's (fadvise, pread, DONTNEED; docs/perf.md, "PLE
rows from a row store"). After the copy the page is dropped from the page cache again
(`DONTNEED`, one call a page: one over a batch's span would drop every cached page between
them): the row cache, not the kernel, holds the rows.

Same interface and rules as `PageReader`: tickets, `wait` (seconds blocked), `finish` (raises the
read's error, one line naming layer, page and offset; `finish_many` returns a batch's errors), the same `IOHook` around each read (run in
the owner's thread here: a delay hook delays the copy, not a background read; `latency`, for
tests, simulates a disk whose read began at the request). A queued read
that is never waited for is `cancel`led (its slot was never written). Linux only (`posix_fadvise`);
elsewhere the row cache takes `PageReader`. A read cannot time out here (a blocking pread in the
owner's thread): `io_timeout` applies to `PageReader` only.
"""

from __future__ import annotations

import bisect
import os
import time
from typing import Callable

import numpy as np

from strata.errors import FormatError, RowReadError
from strata.formats.checksum import checksum
from strata.formats.ngram_rows_file import NgramRowsFile
from strata.runtime.io import IOHook, ReadRequest

__all__ = ["AdvisedReader", "advice_available"]

# A queued read is a tuple (page, slot, urgent, asked) in `_queued` until it is copied, then its
# error (None: copied and verified) in `_done` until finished: plain tuples and dicts, because
# a token's ~560 pages made a per-page object and its attribute stores ~1 us a page of the
# owner's time (benchmarks/ngram_rows.py, `cpu us/page`).


def advice_available() -> bool:
    return hasattr(os, "posix_fadvise")


class AdvisedReader:
    """Pages of `store` into `slots` (uint8 [capacity, page_bytes]): kernel read-ahead, copy at use."""

    def __init__(self, store: NgramRowsFile, slots: np.ndarray, *, verify: bool = True,
                 hook: IOHook | None = None, drop_after_copy: bool = True,
                 latency: Callable[[ReadRequest], float] | None = None) -> None:
        if not advice_available():  # pragma: no cover - platform
            raise OSError("posix_fadvise is not available here: use the threaded PageReader")
        self.store, self.slots, self.verify, self.hook = store, slots, verify, hook
        self.drop_after_copy = drop_after_copy
        # tests: a simulated disk latency, counted from the kernel's request (submit), so a read
        # asked for early costs nothing at use (strata.testing.faults.FixedDelay.latency_s)
        self.latency = latency
        self._fd = os.dup(store.fileno())  # buffered: the kernel's read-ahead lands in the page cache
        self.note = "kernel read-ahead (posix_fadvise), buffered copies"
        self._queued: dict[int, tuple[int, int, bool, float]] = {}  # ticket -> (page, slot, urgent, asked)
        self._done: dict[int, RowReadError | None] = {}  # ticket -> its read's error, until finished
        self._next = 0
        self.pages_read = 0
        tables = sorted(store.tables.values(), key=lambda t: t.first_page)
        self._firsts, self._layers = [t.first_page for t in tables], [t.layer for t in tables]
        # each slot as a memoryview, made once: indexing the numpy array per page cost ~0.3 us
        self._views = list(memoryview(slots.reshape(-1)).cast("B")[i * slots.shape[1]:(i + 1) * slots.shape[1]]
                           for i in range(slots.shape[0])) if slots.size else []

    def submit_many(self, reads, *, urgent: bool) -> list[int]:
        """Ask the kernel for each (global page, slot) now; returns tickets, in order."""
        base, stride, advise, fd = self.store.data_offset, self.store.page_bytes, os.posix_fadvise, self._fd
        n_pages, queued, t0 = self.store.n_pages, self._queued, self._next
        now = time.perf_counter() if self.latency is not None else 0.0
        willneed = os.POSIX_FADV_WILLNEED
        t = t0
        for page, slot in reads:
            if not 0 <= page < n_pages:
                self.store.page_offset(page)  # raises the store's own error
            queued[t] = (page, slot, urgent, now)
            t += 1
            advise(fd, base + page * stride, stride, willneed)
        self._next = t
        return list(range(t0, t))

    def pending(self, ticket: int) -> bool:
        """Always False: no thread writes a slot behind the owner's back."""
        return False

    def cancel(self, ticket: int) -> bool:
        """Forget a read never waited for (its slot was never written): True. False once copied."""
        return self._queued.pop(ticket, None) is not None

    def wait(self, tickets) -> float:
        """Copy each of these pages into its slot (blocking on the kernel's read if unfinished);
        the seconds it took."""
        start = time.perf_counter()
        queued = self._queued
        todo = [(t, queued.pop(t)) for t in tickets if t in queued]
        if not todo:
            return time.perf_counter() - start
        if self.hook is None and self.latency is None:
            self._copy_all(todo)
        else:
            for t, job in todo:
                self._done[t] = self._copy_one(t, job)
            if self.drop_after_copy:
                self._drop_copied(np.fromiter((job[0] for _, job in todo), np.int64, len(todo)))
        self.pages_read += sum(self._done[t] is None for t, _ in todo)
        return time.perf_counter() - start

    def finish(self, ticket: int) -> None:
        """Raise the read's error, if any, and forget it (it must have been waited for)."""
        if ticket in self._queued:  # pragma: no cover - the row cache waits before it finishes
            raise RuntimeError(f"read {ticket} finished before it was waited for")
        error = self._done.pop(ticket)
        if error is not None:
            raise error

    def finish_many(self, tickets) -> list[tuple[int, RowReadError]]:
        """`finish` for each of these (all waited for): forgets them all and returns (position in
        `tickets`, error) of each that failed, in order, instead of raising."""
        done, queued = self._done, self._queued
        if any(t in queued for t in tickets):  # pragma: no cover - the row cache waits before it finishes
            raise RuntimeError("a read finished before it was waited for")
        errors = [done.pop(t) for t in tickets]
        return [(i, e) for i, e in enumerate(errors) if e is not None]

    def close(self) -> None:
        if self._fd >= 0:
            os.close(self._fd)
            self._fd = -1

    def _copy_all(self, todo: list) -> None:
        """The plain path (no hook, no simulated latency): every page's pread in one loop, its
        length and CRC-32 checked over the batch with numpy, then the pages dropped from the page
        cache (`_drop_copied`). Each page's
        outcome goes to `_done`, exactly as `_copy_one` would give it."""
        fd, base, stride, views, preadv = self._fd, self.store.data_offset, self.store.page_bytes, self._views, os.preadv
        crc = checksum if self.verify else None
        got, crcs = [], []
        for t, (page, slot, _, _) in todo:
            view = views[slot]
            try:
                got.append(preadv(fd, [view], base + page * stride))
            except OSError:
                got.append(-1)  # `_copy_one` below gives it its message
                crcs.append(0)
                continue
            if crc is not None:
                crcs.append(crc(view))
        pages = np.fromiter((job[0] for _, job in todo), np.int64, len(todo))
        bad = np.asarray(got) != stride
        if crc is not None:
            bad |= np.asarray(crcs, np.int64) != self.store.crcs_of(pages)
        done = self._done
        for t, _ in todo:
            done[t] = None
        for i in np.flatnonzero(bad).tolist():  # re-read one at a time: the message names the failure
            t, job = todo[i]
            done[t] = self._copy_one(t, job)
        if self.drop_after_copy:
            self._drop_copied(pages)

    def _drop_copied(self, pages: np.ndarray) -> None:
        """Drop the copied pages from the page cache, one DONTNEED each. Not one over their span:
        that would also drop every other cached page between them (a warm store's whole table)."""
        base, stride, advise, dontneed = self.store.data_offset, self.store.page_bytes, os.posix_fadvise, \
            os.POSIX_FADV_DONTNEED
        for p in pages.tolist():
            advise(self._fd, base + p * stride, stride, dontneed)

    def _copy_one(self, ticket: int, job: tuple) -> RowReadError | None:
        """One page through the hook (and the simulated latency); its error, or None."""
        try:
            self._read(ticket, job)
            return None
        except RowReadError as e:
            return e
        except Exception as e:  # noqa: BLE001 - any failure is the read's, raised at finish
            return RowReadError(f"{self._where(self._request(ticket, job))}: read failed: {e!r}")

    def _request(self, ticket: int, job: tuple) -> ReadRequest:
        """The job as the IOHook sees it: layer = the table's key, expert = the page within it."""
        page, slot, urgent, _ = job
        i = bisect.bisect_right(self._firsts, page) - 1
        return ReadRequest(ticket, slot, self._layers[i], page - self._firsts[i], urgent,
                           self.store.data_offset + page * self.store.page_bytes)

    def _read(self, ticket: int, job: tuple) -> None:
        page, slot, _, asked = job
        buf, hook = self.slots[slot], self.hook
        offset = self.store.data_offset + page * self.store.page_bytes
        r = self._request(ticket, job) if hook is not None or self.latency is not None else None
        if self.latency is not None:
            time.sleep(max(0.0, asked + self.latency(r) - time.perf_counter()))
        try:
            if hook is not None:
                hook.before(r)
            got = os.preadv(self._fd, [buf], offset)
            if hook is not None:
                got = hook.after(r, buf, got)
        except OSError as e:
            raise RowReadError(f"{self._where(self._request(ticket, job))}: read error: {e.strerror or e}") from None
        if got != len(buf):
            raise RowReadError(f"{self._where(self._request(ticket, job))}: short read: {got} of {len(buf)} bytes")
        if self.verify:
            try:
                self.store.check_page(page, buf)
            except FormatError as e:
                raise RowReadError(str(e)) from None

    def _where(self, r: ReadRequest) -> str:
        return f"{self.store.path}: layer {r.layer} page {r.expert} at offset {r.offset}"
