"""The reader pool: a few threads `preadv` expert records into arena slots (design §1, §5).

- Priority: urgent reads (the turn waits on them) before read-aheads, FIFO within each.
- `cancel(ticket)` drops a read that is still queued; a running one finishes (its slot is in
  limbo until the state machine has waited for it, so it cannot land on a reused slot).
- `wait(tickets)` blocks until each read is done or dropped, with a timeout (never a hang);
  `check(slot, ticket, layer, expert)` is called at the moment of use and raises the read's
  error, if any, in the caller's thread: layer, expert and file offset are in the message.
- Completions are queued for the owner to feed back as `ReadDone` (`completed()`).
- O_DIRECT where the filesystem allows and the arena takes it (`direct_reads_refused`); the
  first EINVAL switches to buffered reads, once.
- `IOHook` (tests): runs in the worker around each read; it may sleep, raise OSError or
  corrupt the bytes, which is how random delays, completion orders and faults are injected
  (strata.testing.faults has the hooks the tests use).
"""

from __future__ import annotations

import errno
import heapq
import itertools
import os
import queue
import sys
import threading
import time
from typing import NamedTuple, Protocol

import numpy as np

from strata.errors import ExpertReadError
from strata.formats.experts_file import ExpertsFile, checksum
from strata.runtime.arena import Arena

__all__ = ["ReadRequest", "IOHook", "ReaderPool"]

URGENT, AHEAD = 0, 1  # queue priorities: smaller first
# While a pool is open the interpreter switches threads every SWITCH_INTERVAL seconds instead of
# Python's 5 ms: a reader needs the GIL for a few microseconds around each pread, and with the
# decode thread busy in numpy it otherwise waits up to 5 ms for it, so read-aheads that the
# disk finishes in 30 µs arrive late (docs/perf.md has the measurement). Restored on close.
SWITCH_INTERVAL = 2e-4
_QUEUED, _RUNNING, _DONE, _DROPPED = range(4)


class ReadRequest(NamedTuple):
    """One read (a named tuple: built per read, in the host's turn among others; 264 ns here against
    706 for the frozen dataclass it was)."""

    ticket: int
    slot: int
    layer: int
    expert: int
    urgent: bool
    offset: int  # byte offset of the record in the .experts file


class IOHook(Protocol):
    def before(self, req: ReadRequest) -> None:
        """In the worker, before the read: may sleep or raise OSError."""

    def after(self, req: ReadRequest, buf: np.ndarray, got: int) -> int:
        """In the worker, after the read filled `buf` with `got` bytes, before verification:
        may alter the bytes; returns the byte count to report (tests shorten it)."""


class _SwitchInterval:
    """Reference-counted sys.setswitchinterval for the pools that are open."""

    lock, users, saved = threading.Lock(), 0, None

    @classmethod
    def enter(cls, seconds: float) -> None:
        with cls.lock:
            if cls.users == 0:
                cls.saved = sys.getswitchinterval()
                sys.setswitchinterval(min(seconds, cls.saved))
            cls.users += 1

    @classmethod
    def leave(cls) -> None:
        with cls.lock:
            cls.users -= 1
            if cls.users == 0 and cls.saved is not None:
                sys.setswitchinterval(cls.saved)


class _Job:
    __slots__ = ("req", "status", "error")

    def __init__(self, req: ReadRequest) -> None:
        self.req, self.status, self.error = req, _QUEUED, None


class ReaderPool:
    """Threads that fill arena slots from an `.experts` file. Thread-safe; one owner thread
    submits, cancels, waits and drains completions."""

    def __init__(self, experts: ExpertsFile, arena: Arena, *, threads: int = 4, direct: bool = True,
                 verify: bool = True, timeout: float = 60.0, hook: IOHook | None = None,
                 switch_interval: float = SWITCH_INTERVAL) -> None:
        if arena.slot_bytes < experts.header.padded_bytes:
            raise ValueError(f"arena slots of {arena.slot_bytes} bytes cannot hold "
                             f"{experts.header.padded_bytes}-byte records")
        self.experts, self.arena = experts, arena
        self.verify, self.timeout, self.hook = verify, timeout, hook
        self.nbytes = experts.header.padded_bytes
        self._views: list = [None] * arena.capacity  # slot -> uint8 [nbytes] view, made on first read
        self._fd, self.direct, self.note = self._open(direct)
        # One lock; the owner sleeps on `_cv` (completions), workers on `_wake`, a queue holding
        # one token per queued job. A completion wakes only the owner, and only while it waits:
        # with one shared condition every completion woke every idle worker, which took the GIL
        # just to go back to sleep (docs/perf.md, "Streaming runtime": 3 wake-ups per read at 4
        # threads). The tokens are a C queue, not a Condition: a submit in the host's turn puts
        # one token per job in C, where Condition.notify ran Python per waiter.
        self._lock = threading.Lock()
        self._cv = threading.Condition(self._lock)
        self._wake: queue.SimpleQueue = queue.SimpleQueue()
        hdr = experts.header
        self._layout = (hdr.data_offset, hdr.n_layers, hdr.n_experts, hdr.padded_bytes)  # record_offset's arithmetic
        self._waiting = False
        self._heap: list = []
        self._seq = itertools.count()
        self._jobs: dict[int, _Job] = {}  # ticket -> job, the latest read of each slot only
        self._slot_job: dict[int, _Job] = {}
        self._done: list[tuple[int, int]] = []  # (slot, ticket) completed or dropped, not yet drained
        self._closed = False
        self._retired_fds: list[int] = []
        self.bytes_read = 0
        self.reads_done = 0
        self.dropped = 0
        self.errors = 0
        self._switch = switch_interval > 0
        if self._switch:
            _SwitchInterval.enter(switch_interval)
        self._workers = [threading.Thread(target=self._work, name=f"strata-io-{i}", daemon=True)
                         for i in range(threads)]
        for t in self._workers:
            t.start()

    # -------------------------------------------------------- opening

    def _open(self, direct: bool) -> tuple[int, bool, str]:
        path = self.experts.path
        refused = getattr(self.arena, "direct_reads_refused", None)  # SlotArena's; None on other arenas
        if direct and hasattr(os, "O_DIRECT") and refused is None:
            try:
                fd = os.open(path, os.O_RDONLY | os.O_DIRECT)
            except OSError as e:
                return os.dup(self.experts.fileno()), False, f"buffered reads (O_DIRECT open failed: {e.strerror})"
            try:  # the filesystem may accept the flag and still refuse the read
                probe = mmapped_probe(self.nbytes)
                os.preadv(fd, [probe], self.experts.record_offset(0, 0))
                return fd, True, "O_DIRECT reads"
            except OSError as e:
                os.close(fd)
                return os.dup(self.experts.fileno()), False, f"buffered reads (O_DIRECT read failed: {e.strerror})"
        why = "off by config" if direct is False else refused or "no O_DIRECT on this system"
        return os.dup(self.experts.fileno()), False, f"buffered reads ({why})"

    # -------------------------------------------------------- owner side

    def submit(self, ticket: int, slot: int, layer: int, expert: int, urgent: bool) -> None:
        self.submit_many([(ticket, slot, layer, expert, urgent)])

    def submit_many(self, reads) -> None:
        """Queue reads given as (ticket, slot, layer, expert, urgent), in order, under one lock."""
        base, n_layers, n_experts, stride = self._layout
        jobs = []
        for t, s, l, e, u in reads:
            if not (0 <= l < n_layers and 0 <= e < n_experts):
                self.experts.record_offset(l, e)  # raises the file's own error
            jobs.append(_Job(ReadRequest(t, s, l, e, u, base + (l * n_experts + e) * stride)))
        heap = self._heap
        with self._lock:
            before = len(heap)
            try:
                self._queue(jobs)
            finally:
                queued = len(heap) - before  # the jobs queued before a refusal, if one came
        put = self._wake.put
        for _ in range(queued):  # one token, one worker's wake-up, per queued job
            put(True)

    def _queue(self, jobs: list) -> None:
        """Under the lock: each job into the heap, after checking its slot is not busy."""
        for job in jobs:
            req = job.req
            old = self._slot_job.get(req.slot)
            if old is not None:
                if old.status in (_QUEUED, _RUNNING):
                    raise RuntimeError(f"read {req.ticket} into slot {req.slot} while read {old.req.ticket} "
                                       f"of layer {old.req.layer} expert {old.req.expert} is in flight")
                self._jobs.pop(old.req.ticket, None)
            self._slot_job[req.slot] = job
            self._jobs[req.ticket] = job
            heapq.heappush(self._heap, (URGENT if req.urgent else AHEAD, next(self._seq), job))

    def cancel(self, ticket: int) -> bool:
        """Drop a queued read; False when it is running or finished (then it completes)."""
        with self._cv:
            job = self._jobs.get(ticket)
            if job is None or job.status != _QUEUED:
                return False
            job.status = _DROPPED
            self.dropped += 1
            self._done.append((job.req.slot, ticket))
            if self._waiting:
                self._cv.notify()
            return True

    def wait(self, tickets) -> float:
        """Block until these reads are done or dropped; return the seconds spent blocked."""
        start = time.perf_counter()
        deadline = start + self.timeout
        with self._cv:
            jobs = [self._jobs[t] for t in tickets if t in self._jobs]
            while True:
                pending = [j for j in jobs if j.status in (_QUEUED, _RUNNING)]
                if not pending:
                    break
                left = deadline - time.perf_counter()
                if left <= 0:
                    r = pending[0].req
                    raise ExpertReadError(
                        f"{self.experts.path}: read of layer {r.layer} expert {r.expert} at offset {r.offset} "
                        f"did not complete within {self.timeout:g} s ({len(pending)} reads pending)")
                self._waiting = True
                try:
                    self._cv.wait(left)
                finally:
                    self._waiting = False
        return time.perf_counter() - start

    def check(self, slot: int, ticket: int, layer: int, expert: int) -> None:
        """At the moment of use: the slot's latest read is `ticket`, of (layer, expert), done
        without error. Raises ExpertReadError otherwise."""
        with self._cv:
            job = self._slot_job.get(slot)
        if job is None or job.req.ticket != ticket or (job.req.layer, job.req.expert) != (layer, expert):
            have = "nothing" if job is None else f"layer {job.req.layer} expert {job.req.expert} (read {job.req.ticket})"
            raise ExpertReadError(f"slot {slot} should hold layer {layer} expert {expert} (read {ticket}), holds {have}")
        if job.error is not None:
            raise job.error
        if job.status != _DONE:
            state = {_QUEUED: "still queued", _RUNNING: "still reading", _DROPPED: "was cancelled"}[job.status]
            raise ExpertReadError(f"slot {slot}: the read of layer {layer} expert {expert} at offset "
                                  f"{job.req.offset} {state} when compute needed it")

    def check_many(self, slots, tickets, layer: int, experts) -> None:
        """`check` for each (slot, ticket, expert) of one layer's Use, in order
        (the decode turn checks top-k slots). No lock: only this (the owner's) thread replaces a
        slot's job, and a worker sets a job's error before its status, both under the GIL, so a
        job seen done is done with its error in place; anything else goes to `check`."""
        get = self._slot_job.get
        for s, t, e in zip(slots, tickets, experts):
            job = get(s)
            if job is None or job.status != _DONE or job.error is not None or job.req.ticket != t \
                    or job.req.layer != layer or job.req.expert != e:
                self.check(s, t, layer, e)  # raises the error `check` names

    def completed(self) -> list[tuple[int, int]]:
        """(slot, ticket) of every read completed or dropped since the last call."""
        if not self._done:  # unlocked peek: a notice appended meanwhile is drained next call
            return []
        with self._cv:
            out, self._done = self._done, []
        return out

    def close(self) -> None:
        with self._cv:
            if self._closed:
                return
            self._closed = True
            self._cv.notify_all()
        for _ in self._workers:  # every worker wakes, sees the pool closed, and ends
            self._wake.put(False)
        for t in self._workers:
            t.join(timeout=self.timeout)
        if self._switch:
            _SwitchInterval.leave()
        for fd in [self._fd, *self._retired_fds]:
            if fd >= 0:
                os.close(fd)
        self._fd, self._retired_fds = -1, []

    # -------------------------------------------------------- workers

    def _work(self) -> None:
        lock, heap, heappop, wake = self._lock, self._heap, heapq.heappop, self._wake.get
        while True:
            wake()  # a token: a job was queued (or the pool closed)
            with lock:
                if self._closed:
                    return
                if not heap:
                    continue  # the job went with the token of another (cannot happen: one token per job)
                job = heappop(heap)[2]
                if job.status != _QUEUED:
                    continue  # cancelled while queued: its token is spent
                job.status = _RUNNING
            try:
                got = self._read(job.req)  # bytes read; None: the record's `nbytes` (one read)
                error = None
            except ExpertReadError as e:
                error = e
            except BaseException as e:  # noqa: BLE001 - any failure must reach the waiter, never hang it
                r = job.req
                error = ExpertReadError(f"{self.experts.path}: reading layer {r.layer} expert {r.expert} at "
                                        f"offset {r.offset} failed: {e!r}")
            with lock:
                job.error = error
                job.status = _DONE
                if error is None:
                    self.bytes_read += self.nbytes if got is None else got
                    self.reads_done += 1
                else:
                    self.errors += 1
                self._done.append((job.req.slot, job.req.ticket))
                if self._waiting:
                    self._cv.notify()

    def _read(self, r: ReadRequest) -> None:
        buf = self._views[r.slot]
        if buf is None:  # each slot's view is made once: the arena's memory never moves
            buf = self._views[r.slot] = self.arena.slot_buffer(r.slot)[: self.nbytes]
        hook = self.hook
        try:
            if hook is not None:
                hook.before(r)
            got = self._pread(buf, r.offset)
            if hook is not None:
                got = hook.after(r, buf, got)
        except OSError as e:
            raise ExpertReadError(f"{self._where(r)}: read error: {e.strerror or e}") from None
        if got != self.nbytes:
            raise ExpertReadError(f"{self._where(r)}: short read: {got} of {self.nbytes} bytes")
        if self.verify:
            rec = self.experts.header.record_bytes
            actual, stored = checksum(buf[:rec]), self.experts.checksum(r.layer, r.expert)
            if actual != stored:
                raise ExpertReadError(f"{self._where(r)}: checksum mismatch: crc32 {actual:#010x}, "
                                      f"the file says {stored:#010x}")
        self.arena.publish(r.slot)

    def _where(self, r: ReadRequest) -> str:
        return f"{self.experts.path}: layer {r.layer} expert {r.expert} at offset {r.offset}"

    def _pread(self, buf: np.ndarray, offset: int) -> int:
        try:
            return os.preadv(self._fd, [buf], offset)
        except OSError as e:
            if e.errno != errno.EINVAL or not self.direct:
                raise
        with self._cv:  # O_DIRECT refused this buffer or offset: buffered from now on, said once
            if self.direct:
                self.direct = False
                self.note = "buffered reads (O_DIRECT refused a read: EINVAL)"
                self._retired_fds.append(self._fd)  # another worker may still be reading with it
                self._fd = os.dup(self.experts.fileno())
        return os.preadv(self._fd, [buf], offset)


def mmapped_probe(nbytes: int) -> np.ndarray:
    """A page-aligned scratch buffer (O_DIRECT wants aligned memory)."""
    import mmap

    return np.frombuffer(mmap.mmap(-1, nbytes), dtype=np.uint8)
