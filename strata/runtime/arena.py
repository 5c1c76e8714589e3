"""The arena: `capacity` fixed slots of `slot_bytes` each, filled by disk reads (design §1, §5).

The `Arena` protocol is the seam between the I/O pool and a compute backend. The pool preads a
record straight into `slot_buffer(slot)` and calls `publish(slot)` once the bytes are complete;
compute may read a slot only after that. The backends implement it (strata.numpy_backend.arena:
host memory; strata.mlx_backend.arena: memory the GPU reads). A slot update costs O(slot): one
read, one publish, nothing else.
"""

from __future__ import annotations

from typing import Protocol

import numpy as np

from strata.formats.expert_record import RECORD_ALIGN

__all__ = ["Arena", "SlotArena", "check_slot_geometry"]


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
