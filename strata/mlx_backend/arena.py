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

The view starts on a 4096-byte boundary (the array is over-allocated by one slot and viewed at an
offset), so O_DIRECT reads can land in it. Safety is the cache machine's: a slot is written only
while no kernel of the current window may read it (pinned slots are never victims; design §5).

Size: MLX shapes are int32 per dimension, so the allocation is 2-D ([capacity + 1, slot_bytes],
never one flat dimension: 3072 seed-size slots are 4.25 GB, which a 1-D shape cannot hold; seen
on the H200 as `OverflowError: Integer value 4253028352 ...`). The page-aligned view of it is a row
slice when the allocation starts on a page (MLX CUDA's large allocations do), else an `as_strided`
view at a byte offset - but `as_strided` flattens its input, so that only works below 2**31 bytes
(seen on the H200: `[flatten] Shape dimension 4254408704 ...`); a larger arena on a misaligned
allocation is used as it is, unaligned (the reader pool then falls back from O_DIRECT to buffered
reads at its first EINVAL). `arena_geometry` is that arithmetic, testable without allocating; the
kernels index the arena with 64-bit byte offsets (slot * SLOT in uint64).

`load_resident_arena` fills an arena with every record of an `.experts` file (the all-resident
engines' experts, whatever the model's residual).
"""

from __future__ import annotations

import enum
import sys
from dataclasses import dataclass

import mlx.core as mx
import numpy as np

from strata.formats.expert_record import RECORD_ALIGN, RecordLayout
from strata.mlx_backend.kernels.launch import gpu_dialect
from strata.mlx_backend.kernels.preludes import Dialect
from strata.runtime.arena import SlotArena, check_slot_geometry

__all__ = ["MlxArena", "ArenaGeometry", "ArenaView", "arena_geometry", "MLX_MAX_DIM", "load_resident_arena"]

MLX_MAX_DIM = 2**31 - 1  # MLX array dimensions are int32
FLAT_LIMIT = MLX_MAX_DIM  # mx.as_strided flattens its input: larger allocations cannot be offset-viewed


class ArenaView(enum.Enum):
    ROWS = "rows"  # the allocation starts on a page: slot 0 is row 0 (a row slice)
    OFFSET = "offset"  # an as_strided view `offset` bytes in (allocations under FLAT_LIMIT bytes)
    UNALIGNED = "unaligned"  # a row slice of a misaligned allocation (buffered reads, not O_DIRECT)


@dataclass(frozen=True)
class ArenaGeometry:
    """Where an arena lives in its allocation: `alloc_shape` (each dimension an MLX int32), how
    slot 0 is viewed, and its element (= byte) offset (slot 0 on a RECORD_ALIGN boundary unless
    the view is UNALIGNED)."""

    alloc_shape: tuple[int, int]
    view: ArenaView
    offset: int  # bytes from the allocation's start to slot 0
    nbytes: int  # capacity * slot_bytes (Python int: may exceed 2**31)


def arena_geometry(capacity: int, slot_bytes: int, base_address: int) -> ArenaGeometry:
    """The allocation for `capacity` slots of `slot_bytes` and the aligned offset of slot 0, for
    an allocation that starts at `base_address` (its alignment is the allocator's; any works)."""
    check_slot_geometry(capacity, slot_bytes)
    rows = capacity + 1  # one spare slot (>= RECORD_ALIGN bytes) absorbs the alignment offset
    if rows > MLX_MAX_DIM or slot_bytes > MLX_MAX_DIM:
        raise ValueError(f"arena: {capacity} slots of {slot_bytes} bytes exceed MLX's int32 dimensions")
    offset = (-base_address) % RECORD_ALIGN
    if offset == 0:
        view = ArenaView.ROWS
    elif rows * slot_bytes <= FLAT_LIMIT:
        view = ArenaView.OFFSET
    else:
        view, offset = ArenaView.UNALIGNED, 0
    return ArenaGeometry((rows, slot_bytes), view, offset, capacity * slot_bytes)


class MlxArena(SlotArena):
    """Arena protocol over MLX memory. `array` is what kernels take (uint8 [capacity, slot_bytes])."""

    def __init__(self, capacity: int, slot_bytes: int) -> None:
        super().__init__(capacity, slot_bytes)
        # MLX's CUDA build: the arena is managed memory. On the H200, with the GPU running kernels
        # over other slots while reads landed, 1 of 40 streaming runs with O_DIRECT left the GPU a
        # stale slot (its logits 0.87 off the reference; 0 of 480 with buffered reads), and a
        # direct read cost ~15x a buffered one (tests/fuzz/stress_streaming.py, docs/perf.md).
        # Apple GPUs share the CPU's memory: direct reads stay on there, as on the CPU.
        if gpu_dialect() is Dialect.CUDA:
            self.direct_reads_refused = "O_DIRECT into CUDA managed memory came back stale"
        shape = arena_geometry(capacity, slot_bytes, 0).alloc_shape  # validates before allocating
        alloc = mx.zeros(shape, mx.uint8)
        mx.eval(alloc)
        base = np.array(alloc, copy=False).ctypes.data  # first host touch: CUDA moves it to managed memory
        geo = arena_geometry(capacity, slot_bytes, base)
        self.view = geo.view
        if geo.view is ArenaView.OFFSET:  # [capacity, slot_bytes] `offset` bytes in: a view, row-contiguous
            self.array = mx.as_strided(alloc, (capacity, slot_bytes), (slot_bytes, 1), geo.offset)
        else:
            self.array = alloc[:capacity]  # a row slice: a view, row-contiguous
        mx.eval(self.array)
        self._alloc = alloc  # keeps the allocation; `array` is a view of it (no copy)
        self._host = np.array(self.array, copy=False)  # [capacity, slot_bytes], zero-copy
        aligned = geo.view is not ArenaView.UNALIGNED
        if (not self._host.flags.writeable or self._host.ctypes.data != base + geo.offset
                or (aligned and self._host.ctypes.data % RECORD_ALIGN)):
            raise RuntimeError("MLX arena: the host view is not a writable view of MLX memory where expected")

    def slot_buffer(self, slot: int) -> np.ndarray:
        self._check_slot(slot)
        return self._host[slot]

    def publish(self, slot: int) -> None:
        """Nothing to do: the bytes are already in the memory the kernels read (see module doc)."""

    def fill(self, slot: int, record: bytes | np.ndarray) -> None:
        """Copy one record into a slot (tests, all-resident loading)."""
        data = np.frombuffer(record, np.uint8) if not isinstance(record, np.ndarray) else record.reshape(-1)
        self._host[slot, : data.size] = data


def load_resident_arena(experts_file, *, verify: bool = False, progress: bool | None = None) -> MlxArena:
    """Every record of an `.experts` file, pread straight into an MLX arena (slot m*E + e).
    progress: a bar on stderr (None: where stderr is a terminal); a 30-400B model's experts are
    tens to hundreds of GB, minutes of reading."""
    from tqdm import tqdm

    h = experts_file.header
    arena = MlxArena(h.n_layers * h.n_experts, h.padded_bytes)
    with tqdm(total=h.n_layers * h.n_experts * h.padded_bytes, desc="loading experts", unit="B", unit_scale=True,
              file=sys.stderr, disable=None if progress is None else not progress, dynamic_ncols=True) as bar:
        for l in range(h.n_layers):
            for e in range(h.n_experts):
                experts_file.read_record(l, e, verify=verify, out=arena.slot_buffer(l * h.n_experts + e))
            bar.update(h.n_experts * h.padded_bytes)
    return arena


def record_layouts(experts_file) -> tuple[RecordLayout, tuple[RecordLayout, ...] | None]:
    """(rec, layer_recs): the record layout every MoE layer's experts share, and None; or, in a
    file whose layers differ (unsloth's mixes put Q8_0 in a few layers), the largest layout and
    each MoE layer's own. A file mixed per projection alike in every layer has one layout."""
    layouts = tuple(experts_file.layer_layout(l) for l in range(experts_file.header.n_layers))
    if len(set(layouts)) == 1:
        return layouts[0], None
    return max(layouts, key=lambda r: r.padded_bytes), layouts


def layer_record(rec: RecordLayout, layer_recs: tuple[RecordLayout, ...] | None, moe_index: int) -> RecordLayout:
    """The record layout of MoE layer `moe_index` (`record_layouts`' pair)."""
    return rec if layer_recs is None else layer_recs[moe_index]
