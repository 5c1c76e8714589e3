"""The row cache's reader pool: a few threads `preadv` row-store pages into cache slots.

The expert pool (strata.runtime.io) reads one record per arena slot from an `.experts` file;
this one reads one page per row-cache slot from an n-gram row store, with the same rules:
urgent reads (a layer waits on them now) before read-aheads, FIFO within each (in batches of
up to PAGES_PER_JOB pages of one layer per wake-up, done together); every page checked
against its CRC-32 when it lands (`verify`); a failure is kept with its read and raised in the
owner's thread when the page is used (`error`); waits time out (never a hang). The same `IOHook`
runs around each read, so strata.testing.faults' delays and faults apply: a request's `layer`
is the table's layer and its `expert` the page within that table.
"""

from __future__ import annotations

import bisect
import heapq
import itertools
import mmap
import os
import queue
import threading
import time

import numpy as np

from strata.errors import FormatError, RowReadError
from strata.formats.ngram_rows_file import NgramRowsFile
from strata.runtime.io import AHEAD, SWITCH_INTERVAL, URGENT, IOHook, ReadRequest, _SwitchInterval

__all__ = ["PageReader", "page_slots"]

_QUEUED, _RUNNING, _DONE = range(3)
# A worker takes up to this many pages of one layer per wake-up, reads them in turn and marks them
# done together (a layer waits for all its pages anyway): the queue, heap, lock and the owner's
# wake-up cost once per batch instead of once per page
# (a token of the reference engine's shape reads ~576 pages, and every Python step a worker takes
# holds the GIL the decode thread wants).
PAGES_PER_JOB = 4


def page_slots(capacity: int, page_bytes: int) -> np.ndarray:
    """`capacity` page buffers in one anonymous mapping (page-aligned, as O_DIRECT wants; the
    kernel backs only the slots touched). Shapes: -> uint8 [capacity, page_bytes]"""
    return np.frombuffer(mmap.mmap(-1, capacity * page_bytes), np.uint8).reshape(capacity, page_bytes)


class _Job:
    __slots__ = ("req", "page", "status", "error")

    def __init__(self, req: ReadRequest, page: int) -> None:
        self.req, self.page, self.status, self.error = req, page, _QUEUED, None


class PageReader:
    """Threads that fill `slots` (uint8 [capacity, page_bytes]) with pages of `store`. One owner
    thread submits, waits and asks for errors; workers only read and mark."""

    def __init__(self, store: NgramRowsFile, slots: np.ndarray, *, threads: int = 4, direct: bool = True,
                 verify: bool = True, timeout: float = 60.0, hook: IOHook | None = None,
                 pages_per_job: int = PAGES_PER_JOB, switch_interval: float = SWITCH_INTERVAL) -> None:
        self.store, self.slots, self.verify, self.timeout, self.hook = store, slots, verify, timeout, hook
        self.pages_per_job = pages_per_job
        tables = sorted(store.tables.values(), key=lambda t: t.first_page)
        self._firsts, self._layers = [t.first_page for t in tables], [t.layer for t in tables]
        self._fd, self.note = self._open(direct)
        self._lock = threading.Lock()
        self._cv = threading.Condition(self._lock)
        self._wake: queue.SimpleQueue = queue.SimpleQueue()  # one token per queued job (as strata.runtime.io)
        self._heap: list = []
        self._seq = itertools.count()
        self._tickets = itertools.count()
        self._jobs: dict[int, _Job] = {}
        self._closed = False
        self.pages_read = 0
        # The expert pool's reason (strata.runtime.io): a reader needs the GIL for microseconds
        # around each pread, and at Python's 5 ms switch interval it waits behind the decode
        # thread for it. Measured on the H200's host before this (benchmarks/ngram_rows.py,
        # buffered reads from the page cache, 0.5 ms layers): 18 ms/token above the layers' time.
        self._switch = switch_interval > 0
        if self._switch:
            _SwitchInterval.enter(switch_interval)
        self._workers = [threading.Thread(target=self._work, name=f"strata-rows-{i}", daemon=True)
                         for i in range(threads)]
        for t in self._workers:
            t.start()

    def _open(self, direct: bool) -> tuple[int, str]:
        if not direct or not hasattr(os, "O_DIRECT"):
            return os.dup(self.store.fileno()), "buffered row reads" + ("" if direct else " (off by config)")
        try:  # the filesystem may accept the flag and still refuse the read (tmpfs, some overlays)
            fd = os.open(self.store.path, os.O_RDONLY | os.O_DIRECT)
        except OSError as e:
            return os.dup(self.store.fileno()), f"buffered row reads (O_DIRECT open failed: {e.strerror})"
        try:
            os.preadv(fd, [self.slots[0]], self.store.page_offset(0))
            return fd, "O_DIRECT row reads"
        except OSError as e:
            os.close(fd)
            return os.dup(self.store.fileno()), f"buffered row reads (O_DIRECT read failed: {e.strerror})"

    # -------------------------------------------------------- owner side

    def submit_many(self, reads, *, urgent: bool) -> list[int]:
        """Queue reads given as (global page, slot); returns their tickets, in order."""
        jobs, batches = [], []
        firsts, layers, base, stride = self._firsts, self._layers, self.store.data_offset, self.store.page_bytes
        for page, slot in reads:
            if not 0 <= page < self.store.n_pages:
                self.store.page_offset(page)  # raises the store's own error
            i = bisect.bisect_right(firsts, page) - 1  # the table holding the page (a few hundred ns)
            req = ReadRequest(next(self._tickets), slot, layers[i], page - firsts[i], urgent, base + page * stride)
            job = _Job(req, page)
            if not batches or len(batches[-1]) == self.pages_per_job or batches[-1][0].req.layer != req.layer:
                batches.append([])
            batches[-1].append(job)
            jobs.append(job)
        with self._lock:
            for job in jobs:
                self._jobs[job.req.ticket] = job
            for batch in batches:
                heapq.heappush(self._heap, (URGENT if urgent else AHEAD, next(self._seq), batch))
        for _ in range(min(len(batches), len(self._workers))):  # a woken worker drains the queue
            self._wake.put(True)
        return [j.req.ticket for j in jobs]

    def pending(self, ticket: int) -> bool:
        """The read is queued or running (its slot must not be reused yet)."""
        job = self._jobs.get(ticket)
        return job is not None and job.status != _DONE

    def cancel(self, ticket: int) -> bool:
        """False: a queued read here is a worker's to finish (its slot stays in limbo until then)."""
        return False

    def wait(self, tickets) -> float:
        """Block until these reads are done; the seconds spent blocked. RowReadError on timeout."""
        start = time.perf_counter()
        deadline = start + self.timeout
        with self._cv:
            jobs = [self._jobs[t] for t in tickets if t in self._jobs]
            while True:
                pending = [j for j in jobs if j.status != _DONE]
                if not pending:
                    break
                left = deadline - time.perf_counter()
                if left <= 0:
                    r = pending[0].req
                    raise RowReadError(f"{self.store.path}: read of layer {r.layer} page {r.expert} at offset "
                                       f"{r.offset} did not complete within {self.timeout:g} s ({len(pending)} pending)")
                self._cv.wait(left)
        return time.perf_counter() - start

    def finish(self, ticket: int) -> None:
        """The owner is done with a completed read: raise its error, if any, and forget it."""
        job = self._jobs.pop(ticket)
        if job.error is not None:
            raise job.error

    def finish_many(self, tickets) -> list[tuple[int, RowReadError]]:
        """`finish` for each of these (all waited for): forgets them all and returns (position in
        `tickets`, error) of each that failed, in order, instead of raising."""
        failed = []
        for i, t in enumerate(tickets):
            try:
                self.finish(t)
            except RowReadError as e:
                failed.append((i, e))
        return failed

    def close(self) -> None:
        with self._cv:
            if self._closed:
                return
            self._closed = True
        for _ in self._workers:
            self._wake.put(False)
        for t in self._workers:
            t.join(timeout=self.timeout)
        if self._switch:
            _SwitchInterval.leave()
        if self._fd >= 0:
            os.close(self._fd)
            self._fd = -1

    # -------------------------------------------------------- workers

    def _work(self) -> None:
        while True:
            self._wake.get()  # a submit's token (at most one per worker per submit), or close's
            while self._run_one():
                pass
            if self._closed:
                return

    def _run_one(self) -> bool:
        """Read the next queued batch; False when the queue is empty or the pool closed.
        Draining the queue per wake-up, instead of a token and a wake-up per batch, keeps the
        thread switches (each one a GIL hand-off the decode thread pays for) to a few per token."""
        with self._lock:
            if self._closed or not self._heap:
                return False
            batch = heapq.heappop(self._heap)[2]
            for job in batch:
                job.status = _RUNNING
        errors = []
        for job in batch:
            try:
                self._read(job)
                errors.append(None)
            except RowReadError as e:
                errors.append(e)
            except BaseException as e:  # noqa: BLE001 - any failure must reach the owner, never hang it
                r = job.req
                errors.append(RowReadError(f"{self.store.path}: reading layer {r.layer} page {r.expert} at "
                                           f"offset {r.offset} failed: {e!r}"))
        with self._cv:  # the batch's pages complete together: one lock and one wake-up per batch
            for job, error in zip(batch, errors):
                job.error, job.status = error, _DONE
                self.pages_read += error is None
            self._cv.notify_all()
        return True

    def _read(self, job: _Job) -> None:
        r, buf = job.req, self.slots[job.req.slot]
        try:
            if self.hook is not None:
                self.hook.before(r)
            got = os.preadv(self._fd, [buf], r.offset)
            if self.hook is not None:
                got = self.hook.after(r, buf, got)
        except OSError as e:
            raise RowReadError(f"{self._where(r)}: read error: {e.strerror or e}") from None
        if got != len(buf):
            raise RowReadError(f"{self._where(r)}: short read: {got} of {len(buf)} bytes")
        if self.verify:
            try:
                self.store.check_page(job.page, buf)
            except FormatError as e:
                raise RowReadError(str(e)) from None

    def _where(self, r: ReadRequest) -> str:
        return f"{self.store.path}: layer {r.layer} page {r.expert} at offset {r.offset}"
