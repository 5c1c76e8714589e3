"""The tier-2 arena: one MLX array per expert piece, [capacity, *piece shape], filled in place.

mlx-lm's switch layers take stacked tensors ([E, out, in/pack] codes, [E, out, groups] scales,
...) and an index per token; the arena is the same stacked form with `capacity` slots in place
of E experts, so the family's own `gather_qmm` call runs on it unchanged, with slot indices in
place of expert indices (every row reads only its own slot: the same arithmetic, bit for bit).

Each piece's array is allocated as bytes (uint8 [capacity, piece bytes]) and viewed once as its
dtype and shape: MLX views share the buffer, and on MLX's CPU build (and Apple's unified memory)
a numpy view of the bytes IS the arena, as in strata.mlx_backend.arena: a read lands where the
kernels read, with no MLX op. Safety is the cache machine's: a slot is written only while no
computation of the current window may read it.
"""

from __future__ import annotations

import mlx.core as mx
import numpy as np

from strata.runtime.arena import SlotArena
from strata.tier2.expert_tensors import ExpertTensors

__all__ = ["PieceArena"]


class PieceArena(SlotArena):
    """`capacity` slots of one expert each (the runtime's Arena geometry: `slot_bytes` is the
    aligned record size the budget rule counts). `arrays[name]` is what the switch layer reads."""

    def __init__(self, capacity: int, tensors: ExpertTensors) -> None:
        super().__init__(capacity, tensors.slot_bytes)
        self.arrays: dict[str, mx.array] = {}
        self._host: list[np.ndarray] = []  # per piece: uint8 [capacity, piece bytes], zero-copy
        self._keep = []
        for p in tensors.pieces:
            raw = mx.zeros((capacity, p.nbytes), mx.uint8)
            mx.eval(raw)
            host = np.array(raw, copy=False)
            if not host.flags.writeable:
                raise RuntimeError("tier-2 arena: the host view of MLX memory is not writable")
            typed = raw.view(getattr(mx, p.dtype)).reshape(capacity, *p.shape)
            mx.eval(typed)
            self.arrays[p.name] = typed
            self._host.append(host)
            self._keep.append(raw)

    def piece_buffers(self, slot: int) -> list[np.ndarray]:
        """The writable uint8 views one expert's pieces are read into, in piece order."""
        self._check_slot(slot)
        return [h[slot] for h in self._host]

    def slot_buffer(self, slot: int) -> np.ndarray:
        raise TypeError("a tier-2 slot is several pieces: read it with piece_buffers(slot)")

    def publish(self, slot: int) -> None:
        """Nothing to do: the bytes are already in the memory the kernels read (module doc)."""
