"""The arena: `capacity` fixed slots of `slot_bytes` each, filled by disk reads (SPEC §1, §5).

The `Arena` protocol is the seam between the I/O pool and a compute backend. The pool preads a
record straight into `slot_buffer(slot)` and calls `publish(slot)` once the bytes are complete;
compute may read a slot only after that. `NumpyArena` is one anonymous mapping (page-aligned,
so every slot is 4096-aligned and O_DIRECT reads land in it directly); `publish` is a no-op
because host memory is what compute reads. A GPU arena would upload in `publish` (unified
memory: also a no-op). A slot update costs O(slot): one read, one publish, nothing else.
"""

from __future__ import annotations

import ctypes
import ctypes.util
import mmap
from typing import Protocol

import numpy as np

from strata.formats.expert_record import RECORD_ALIGN

__all__ = ["Arena", "NumpyArena", "SlotArena", "check_slot_geometry", "mlock_buffer"]


class Arena(Protocol):
    @property
    def capacity(self) -> int:
        """Number of slots."""

    @property
    def slot_bytes(self) -> int:
        """Bytes per slot: the record stride of the `.experts` file (a multiple of 4096)."""

    def slot_buffer(self, slot: int) -> np.ndarray:
        """The writable uint8 [slot_bytes] view the I/O pool reads into (4096-aligned)."""

    def publish(self, slot: int) -> None:
        """The read into `slot` completed: make its bytes visible to compute. Called from an
        I/O thread, before the read is reported done."""


def check_slot_geometry(capacity: int, slot_bytes: int) -> None:
    if capacity < 1 or slot_bytes < 1 or slot_bytes % RECORD_ALIGN:
        raise ValueError(f"arena: capacity {capacity} and slot_bytes {slot_bytes} "
                         f"(a multiple of {RECORD_ALIGN}) must be positive")


class SlotArena:
    """What every arena shares: its slot geometry and a bounds-checked slot index.

    `direct_reads_refused`: why O_DIRECT reads must not land in this arena's memory (the reader
    pool then reads buffered and says so), or None where they may."""

    direct_reads_refused: str | None = None

    def __init__(self, capacity: int, slot_bytes: int) -> None:
        check_slot_geometry(capacity, slot_bytes)
        self._capacity, self._slot_bytes = capacity, slot_bytes

    @property
    def capacity(self) -> int:
        return self._capacity

    @property
    def slot_bytes(self) -> int:
        return self._slot_bytes

    @property
    def nbytes(self) -> int:
        return self._capacity * self._slot_bytes

    def _check_slot(self, slot: int) -> None:
        if not 0 <= slot < self._capacity:
            raise IndexError(f"arena has {self._capacity} slots, no slot {slot}")


class NumpyArena(SlotArena):
    """One 4096-aligned anonymous mapping of capacity × slot_bytes."""

    def __init__(self, capacity: int, slot_bytes: int, *, wire: bool = False) -> None:
        super().__init__(capacity, slot_bytes)
        self._map = mmap.mmap(-1, capacity * slot_bytes, flags=mmap.MAP_PRIVATE | mmap.MAP_ANONYMOUS)
        self._data = np.frombuffer(self._map, dtype=np.uint8)  # [capacity * slot_bytes]
        self.wired = mlock_buffer(self._data) if wire else False

    def slot_buffer(self, slot: int) -> np.ndarray:
        self._check_slot(slot)
        start = slot * self._slot_bytes
        return self._data[start:start + self._slot_bytes]

    def publish(self, slot: int) -> None:
        pass  # host memory: the pread's bytes are what compute reads


def mlock_buffer(a: np.ndarray) -> bool:
    """Wire an array's pages (mlock). False where the system refuses (RLIMIT_MEMLOCK, no libc)."""
    try:
        libc = ctypes.CDLL(ctypes.util.find_library("c"), use_errno=True)
        addr = a.__array_interface__["data"][0]
        return libc.mlock(ctypes.c_void_p(addr), ctypes.c_size_t(a.nbytes)) == 0
    except (OSError, AttributeError, TypeError):
        return False
