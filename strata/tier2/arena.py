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

Mixed recipes store a piece in more bytes in some layers (6-bit codes beside 4-bit ones): the
piece's bytes per slot are the largest, and each stored form gets its own view of the same
buffer, the first bytes of each slot (`[:, :n]`, a row-strided view: a slot is still one row
of the bytes). The view is checked at construction to share the buffer (a copy would never see
a read).
"""

from __future__ import annotations

import mlx.core as mx
import numpy as np

from strata.runtime.arena import SlotArena
from strata.tier2.expert_tensors import ExpertTensors

__all__ = ["PieceArena"]


class PieceArena(SlotArena):
    """`capacity` slots of one expert each (the runtime's Arena geometry: `slot_bytes` is the
    aligned record size the budget rule counts). `arrays_of(layer)[name]` is what MoE layer
    `layer`'s switch layer reads."""

    def __init__(self, capacity: int, tensors: ExpertTensors) -> None:
        super().__init__(capacity, tensors.slot_bytes)
        self.tensors = tensors
        self._formats = tensors.formats
        self._arrays: list[dict[str, mx.array]] = [{} for _ in self._formats]  # per stored form
        self._host: list[np.ndarray] = []  # per piece: uint8 [capacity, largest piece bytes], zero-copy
        self._keep = []
        for i, big in enumerate(tensors.pieces):
            raw = mx.zeros((capacity, big.nbytes), mx.uint8)
            mx.eval(raw)
            host = np.array(raw, copy=False)
            if not host.flags.writeable:
                raise RuntimeError("tier-2 arena: the host view of MLX memory is not writable")
            dtype = getattr(mx, big.dtype)
            typed = raw.view(dtype)  # [capacity, big bytes / itemsize]
            for f, form in enumerate(self._formats):
                p = form[i]
                if p.nbytes == big.nbytes:
                    view = typed.reshape(capacity, *p.shape)
                    mx.eval(view)
                else:  # the first p.nbytes of each slot's row
                    view = typed[:, : p.nbytes // dtype.size].reshape(capacity, *p.shape)
                    mx.eval(view)
                    _check_shares(host, view)
                self._arrays[f][p.name] = view
            self._host.append(host)
            self._keep.append(raw)

    @property
    def arrays(self) -> dict[str, mx.array]:
        """The first stored form's arrays (every layer's, unless a mixed recipe made the checkpoint)."""
        return self._arrays[0]

    def arrays_of(self, layer: int) -> dict[str, mx.array]:
        """The arrays MoE layer `layer`'s switch layer reads: [capacity, *its piece shape] each."""
        return self._arrays[self.tensors.layer_format(layer)]

    def piece_buffers(self, slot: int, layer: int = 0) -> list[np.ndarray]:
        """The writable uint8 views one expert of MoE layer `layer` is read into, in piece order
        (each its stored bytes: the first of the slot's piece where a layer stores fewer)."""
        self._check_slot(slot)
        return [h[slot, : p.nbytes] for h, p in zip(self._host, self.tensors.layer_pieces[layer])]

    def slot_buffer(self, slot: int) -> np.ndarray:
        raise TypeError("a tier-2 slot is several pieces: read it with piece_buffers(slot)")

    def publish(self, slot: int) -> None:
        """Nothing to do: the bytes are already in the memory the kernels read (module doc)."""


def _check_shares(host: np.ndarray, view: mx.array) -> None:
    """Raise unless MLX's strided view reads the host bytes (not a copy made when it was built)."""
    host[0, 0] ^= 0xFF
    try:
        first = np.array(view.reshape(-1)[:1].view(mx.uint8)[:1])
        seen = int(first[0]) == int(host[0, 0])
    finally:
        host[0, 0] ^= 0xFF
    if not seen:
        raise RuntimeError("tier-2 arena: MLX copied a strided view of the arena (a mixed-bits layer's pieces) "
                           "instead of sharing its memory")
