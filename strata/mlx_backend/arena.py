"""The arena in MLX memory: one uint8 array [capacity, slot_bytes] that kernels read by slot
index, filled by disk reads straight into its memory (the runtime's `Arena` protocol).

Why a host view and not `arena[slot] = bytes`: an MLX slice update copies the whole buffer
whenever anything else aliases it (a view, a second reference, a pending kernel that reads it):
measured on CPU, 0.5 ms per 1.4 MB slot normally but 0.6-3.3 s for a 1 GB arena when aliased.
MLX memory is unified on Apple GPUs and the CPU, and CUDA managed memory on NVIDIA (MLX moves a
buffer to managed memory the first time the host touches it, once, here at construction), so a
numpy view of the array IS the arena: `slot_buffer(slot)` is a zero-copy [slot_bytes] view, a
pread lands where the kernels read, and a slot update costs O(slot) - the read itself - with no
MLX op at all. `publish` has nothing to do.

The view starts on a 4096-byte boundary (the array is over-allocated by one page and offset), so
O_DIRECT reads can land in it. Safety is the cache machine's: a slot is written only while no
kernel of the current window may read it (pinned slots are never victims; SPEC §5).
"""

from __future__ import annotations

import mlx.core as mx
import numpy as np

from strata.formats.expert_record import RECORD_ALIGN

__all__ = ["MlxArena"]


class MlxArena:
    """Arena protocol over MLX memory. `array` is what kernels take (uint8 [capacity, slot_bytes])."""

    def __init__(self, capacity: int, slot_bytes: int) -> None:
        if capacity < 1 or slot_bytes < 1 or slot_bytes % RECORD_ALIGN:
            raise ValueError(f"arena: capacity {capacity} and slot_bytes {slot_bytes} "
                             f"(a multiple of {RECORD_ALIGN}) must be positive")
        self._capacity, self._slot_bytes = capacity, slot_bytes
        n = capacity * slot_bytes
        flat = mx.zeros((n + RECORD_ALIGN,), mx.uint8)
        mx.eval(flat)
        base = np.array(flat, copy=False).ctypes.data  # first host touch: CUDA moves it to managed memory
        off = (-base) % RECORD_ALIGN
        self.array = flat[off:off + n].reshape(capacity, slot_bytes)
        mx.eval(self.array)
        self._flat = flat  # keeps the allocation; `array` is a view of it (no copy)
        self._host = np.array(self.array, copy=False)  # [capacity, slot_bytes], zero-copy
        if not self._host.flags.writeable or self._host.ctypes.data % RECORD_ALIGN:
            raise RuntimeError("MLX arena: the host view is not a writable, page-aligned view of MLX memory")

    @property
    def capacity(self) -> int:
        return self._capacity

    @property
    def slot_bytes(self) -> int:
        return self._slot_bytes

    @property
    def nbytes(self) -> int:
        return self._capacity * self._slot_bytes

    def slot_buffer(self, slot: int) -> np.ndarray:
        if not 0 <= slot < self._capacity:
            raise IndexError(f"arena has {self._capacity} slots, no slot {slot}")
        return self._host[slot]

    def publish(self, slot: int) -> None:
        """Nothing to do: the bytes are already in the memory the kernels read (see module doc)."""

    def fill(self, slot: int, record: bytes | np.ndarray) -> None:
        """Copy one record into a slot (tests, all-resident loading)."""
        data = np.frombuffer(record, np.uint8) if not isinstance(record, np.ndarray) else record.reshape(-1)
        self._host[slot, : data.size] = data
