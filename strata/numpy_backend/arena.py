"""`NumpyArena`: the arena in host memory, one anonymous mapping (page-aligned, so every slot is
4096-aligned and O_DIRECT reads land in it directly); `publish` is a no-op because host memory is
what compute reads."""

from __future__ import annotations

import ctypes
import ctypes.util
import mmap

import numpy as np

from strata.runtime.arena import SlotArena

__all__ = ["NumpyArena", "mlock_buffer"]


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
