"""I/O fault hooks for the reader pool (`strata.runtime.io.IOHook`): random delays (completion
orders), EIO, short reads, corrupted bytes. Test aids: the pool runs them around each read."""

from __future__ import annotations

import errno
import os
import time

import numpy as np

from strata.runtime.io import IOHook, ReadRequest

__all__ = ["RandomDelays", "FixedDelay", "Faults"]


class RandomDelays:
    """Seeded random delays per read (the reference engine and the ticket pick the delay), so reads
    complete in random orders; the same seed gives the same delays, not the same order."""

    def __init__(self, seed: int, max_ms: float = 2.0) -> None:
        self.seed, self.max_s = seed, max_ms / 1e3

    def before(self, req: ReadRequest) -> None:
        rng = np.random.default_rng([self.seed, req.ticket])
        if rng.random() < 0.5:  # half the reads are instant: orders mix fast and slow
            time.sleep(rng.random() * self.max_s)

    def after(self, req: ReadRequest, buf: np.ndarray, got: int) -> int:
        return got


class FixedDelay:
    """Every read takes at least `ms` milliseconds (a slow disk of known latency: the PLE
    read-ahead tests compare it with the compute time of the layers before a PLE layer)."""

    def __init__(self, ms: float) -> None:
        self.s = ms / 1e3

    def before(self, req: ReadRequest) -> None:
        time.sleep(self.s)

    def after(self, req: ReadRequest, buf: np.ndarray, got: int) -> int:
        return got

    def latency_s(self, req: ReadRequest) -> float:
        """The same delay as a latency from the request (a reader whose reads the kernel runs:
        strata.runtime.advised_reader)."""
        return self.s


class Faults:
    """Fail the reads of some (layer, expert) keys: `eio` raises EIO, `short` returns fewer
    bytes, `corrupt` flips a byte (caught only with verify_reads). Optionally after `delays`."""

    def __init__(self, *, eio=(), short=(), corrupt=(), delays: IOHook | None = None) -> None:
        self.eio, self.short, self.corrupt = set(eio), set(short), set(corrupt)
        self.delays = delays

    def before(self, req: ReadRequest) -> None:
        if self.delays is not None:
            self.delays.before(req)
        if (req.layer, req.expert) in self.eio:
            raise OSError(errno.EIO, os.strerror(errno.EIO))

    def after(self, req: ReadRequest, buf: np.ndarray, got: int) -> int:
        if (req.layer, req.expert) in self.corrupt:
            buf[7] ^= 0xFF
        return got // 2 if (req.layer, req.expert) in self.short else got
