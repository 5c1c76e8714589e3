"""The row cache's other reader: the kernel reads ahead, the owner thread copies.

`PageReader` (strata.runtime.page_reader) reads each page on a Python thread; measured on the
H200's host (benchmarks/ngram_rows.py, a token of 561 pages from the page cache) it costs ~30 µs
of GIL-serialized Python per page, ~17 ms a token. This reader issues no Python work to other
threads at all: `submit_many` asks the kernel to read each page ahead (`posix_fadvise(WILLNEED)`:
the reads go to the disk's queue at once, as deep as it is), and the page is copied into its slot
with one buffered `preadv` when it is needed (`wait`), blocking only if the kernel has not
finished it. About 3 µs of Python per page (fadvise, pread, CRC-32; this project's 2-core machine,
warm page cache; not yet measured on the H200). After the copy the page is
dropped from the page cache again (`DONTNEED`): the row cache, not the kernel, holds the rows.

Same interface and rules as `PageReader`: tickets, `wait` (seconds blocked), `finish` (raises the
read's error, one line naming layer, page and offset), the same `IOHook` around each read (run in
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
from strata.formats.ngram_rows_file import NgramRowsFile
from strata.runtime.io import IOHook, ReadRequest

__all__ = ["AdvisedReader", "advice_available"]

_QUEUED, _DONE = range(2)


def advice_available() -> bool:
    return hasattr(os, "posix_fadvise")


class _Job:
    """One page's read: its ReadRequest is built only for a hook or an error message (a named
    tuple per page costs more than the read's own Python)."""

    __slots__ = ("ticket", "page", "slot", "offset", "urgent", "status", "error", "asked")

    def __init__(self, ticket: int, page: int, slot: int, offset: int, urgent: bool, asked: float) -> None:
        self.ticket, self.page, self.slot, self.offset, self.urgent = ticket, page, slot, offset, urgent
        self.status, self.error, self.asked = _QUEUED, None, asked


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
        self._jobs: dict[int, _Job] = {}
        self._next = 0
        self.pages_read = 0
        tables = sorted(store.tables.values(), key=lambda t: t.first_page)
        self._firsts, self._layers = [t.first_page for t in tables], [t.layer for t in tables]

    def submit_many(self, reads, *, urgent: bool) -> list[int]:
        """Ask the kernel for each (global page, slot) now; returns tickets, in order."""
        base, stride, advise, fd = self.store.data_offset, self.store.page_bytes, os.posix_fadvise, self._fd
        n_pages, jobs, tickets, t = self.store.n_pages, self._jobs, [], self._next
        now = time.perf_counter() if self.latency is not None else 0.0
        for page, slot in reads:
            if not 0 <= page < n_pages:
                self.store.page_offset(page)  # raises the store's own error
            offset = base + page * stride
            jobs[t] = _Job(t, page, slot, offset, urgent, now)
            tickets.append(t)
            t += 1
            advise(fd, offset, stride, os.POSIX_FADV_WILLNEED)
        self._next = t
        return tickets

    def pending(self, ticket: int) -> bool:
        """Always False: no thread writes a slot behind the owner's back."""
        return False

    def cancel(self, ticket: int) -> bool:
        """Forget a read never waited for (its slot was never written): True. False once copied."""
        job = self._jobs.get(ticket)
        if job is None or job.status == _DONE:
            return False
        del self._jobs[ticket]
        return True

    def wait(self, tickets) -> float:
        """Copy each of these pages into its slot (blocking on the kernel's read if unfinished);
        the seconds it took."""
        start = time.perf_counter()
        for t in tickets:
            job = self._jobs.get(t)
            if job is not None and job.status != _DONE:
                try:
                    self._read(job)
                except RowReadError as e:
                    job.error = e
                except Exception as e:  # noqa: BLE001 - any failure is the read's, raised at finish
                    job.error = RowReadError(f"{self._where(self._request(job))}: read failed: {e!r}")
                job.status = _DONE
                self.pages_read += job.error is None
        return time.perf_counter() - start

    def finish(self, ticket: int) -> None:
        """Raise the read's error, if any, and forget it (it must have been waited for)."""
        job = self._jobs.pop(ticket)
        if job.status != _DONE:  # pragma: no cover - the row cache waits before it finishes
            raise RuntimeError(f"read {ticket} finished before it was waited for")
        if job.error is not None:
            raise job.error

    def close(self) -> None:
        if self._fd >= 0:
            os.close(self._fd)
            self._fd = -1

    def _request(self, job: _Job) -> ReadRequest:
        """The job as the IOHook sees it: layer = the table's key, expert = the page within it."""
        i = bisect.bisect_right(self._firsts, job.page) - 1
        return ReadRequest(job.ticket, job.slot, self._layers[i], job.page - self._firsts[i], job.urgent, job.offset)

    def _read(self, job: _Job) -> None:
        buf, hook = self.slots[job.slot], self.hook
        r = self._request(job) if hook is not None or self.latency is not None else None
        if self.latency is not None:
            time.sleep(max(0.0, job.asked + self.latency(r) - time.perf_counter()))
        try:
            if hook is not None:
                hook.before(r)
            got = os.preadv(self._fd, [buf], job.offset)
            if hook is not None:
                got = hook.after(r, buf, got)
        except OSError as e:
            raise RowReadError(f"{self._where(self._request(job))}: read error: {e.strerror or e}") from None
        if got != len(buf):
            raise RowReadError(f"{self._where(self._request(job))}: short read: {got} of {len(buf)} bytes")
        if self.drop_after_copy:
            os.posix_fadvise(self._fd, job.offset, len(buf), os.POSIX_FADV_DONTNEED)
        if self.verify:
            try:
                self.store.check_page(job.page, buf)
            except FormatError as e:
                raise RowReadError(str(e)) from None

    def _where(self, r: ReadRequest) -> str:
        return f"{self.store.path}: layer {r.layer} page {r.expert} at offset {r.offset}"
