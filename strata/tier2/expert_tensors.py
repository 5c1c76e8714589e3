"""Where each routed expert's bytes are in a checkpoint's safetensors shards.

mlx-lm's convert stores a MoE layer's experts stacked: `<layer>.switch_mlp.gate_proj.weight` of
shape [E, out, in/pack], and likewise its `scales`, `biases` (affine), `bias` (a projection with
one). Expert e of a stacked tensor is the e-th of E equal row-major slices, so its bytes are
one contiguous range of the shard: `begin + e * piece_bytes` (from the safetensors header).

One slot of the arena holds one expert of any MoE layer: a fixed list of *pieces* (projection
part, dtype), the same names and dtypes in every layer. mlx-lm's mixed recipes (convert's
`--quant-predicate mixed_4_6` and the like) give some layers' projections more bits, so a piece's
per-expert shape and byte count may differ per layer (`layer_pieces`): the slot holds the largest
of each piece, and a layer's expert fills the first bytes of each. A checkpoint whose layers
store different pieces (one layer's experts unquantized, another's quantized) is refused in one
line, as is one whose stacked tensors are not stored as mlx-lm holds them (per-expert tensors, a
transposed layout).
"""

from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path
from types import SimpleNamespace

import numpy as np

from strata.convert.safetensors_reader import Checkpoint
from strata.errors import FormatError
from strata.formats.expert_record import RECORD_ALIGN

__all__ = ["Piece", "ExpertTensors", "locate_experts", "SAFETENSORS_DTYPES"]

# safetensors dtype -> (MLX dtype name, bytes per element): what mlx-lm's quantized experts use
SAFETENSORS_DTYPES = {"U32": ("uint32", 4), "U8": ("uint8", 1), "BF16": ("bfloat16", 2), "F16": ("float16", 2),
                      "F32": ("float32", 4), "I32": ("int32", 4)}


@dataclass(frozen=True)
class Piece:
    """One part of an expert as a slot holds it: `name` within the SwitchGLU (e.g.
    `gate_proj.scales`), one expert's shape and MLX dtype name, its byte count."""

    name: str
    shape: tuple[int, ...]
    dtype: str
    nbytes: int


@dataclass(frozen=True)
class ExpertTensors:
    """Every MoE layer's stacked expert tensors in the shards.

    pieces: what one slot holds, in order (each the largest of that piece over the layers);
    `layer_pieces[m]`: MoE layer m's pieces as stored (the same names and dtypes; mixed recipes
    differ in shapes and bytes); `offsets[m][p]` = (shard index, byte offset of expert 0 of piece p
    of MoE layer m); `shards`: the shard paths. Quacks, for the reader pool, like the parts of an
    ExpertsFile it reads (`header`, `path`, `record_offset`)."""

    pieces: tuple[Piece, ...]
    layer_pieces: tuple[tuple[Piece, ...], ...]
    offsets: tuple[tuple[tuple[int, int], ...], ...]
    shards: tuple[Path, ...]
    n_experts: int
    directory: Path
    records: Path | None = None  # the aligned records file read instead of the shards (strata.tier2.records)
    records_offset: int = 0  # its first record's offset

    @property
    def read_files(self) -> tuple[Path, ...]:
        """The files the reader pool opens: the records file, else the shards."""
        return (self.records,) if self.records is not None else self.shards

    @property
    def n_layers(self) -> int:
        return len(self.offsets)

    @property
    def formats(self) -> tuple[tuple[Piece, ...], ...]:
        """The distinct ways the layers store an expert, in order of first appearance (one
        unless a mixed recipe made the checkpoint)."""
        return tuple(dict.fromkeys(self.layer_pieces))

    def layer_format(self, layer: int) -> int:
        """MoE layer `layer`'s index in `formats`."""
        return self.formats.index(self.layer_pieces[layer])

    def layer_record_bytes(self, layer: int) -> int:
        """One expert of MoE layer `layer`, all pieces as stored."""
        return sum(p.nbytes for p in self.layer_pieces[layer])

    @property
    def record_bytes(self) -> int:
        """The largest expert's bytes, all pieces (every layer's where all store alike)."""
        return max(sum(p.nbytes for p in f) for f in self.formats)

    @property
    def slot_bytes(self) -> int:
        """One slot (every piece at its largest) rounded up to the arena's slot alignment (the
        budget rule's unit)."""
        return -(-sum(p.nbytes for p in self.pieces) // RECORD_ALIGN) * RECORD_ALIGN

    @property
    def n_records(self) -> int:
        return self.n_layers * self.n_experts

    @property
    def path(self) -> Path:
        return self.directory

    @property
    def header(self) -> SimpleNamespace:
        """What the reader pool reads of an `.experts` header: geometry for its messages and checks."""
        return SimpleNamespace(padded_bytes=self.slot_bytes, record_bytes=self.record_bytes, data_offset=0,
                               n_layers=self.n_layers, n_experts=self.n_experts)

    def record_offset(self, layer: int, expert: int) -> int:
        """The file offset of the expert's first piece (named in read errors)."""
        if not (0 <= layer < self.n_layers and 0 <= expert < self.n_experts):
            raise FormatError(f"{self.directory}: no MoE layer {layer} expert {expert} "
                              f"({self.n_layers} MoE layers of {self.n_experts} experts)")
        if self.records is not None:
            return self.records_offset + (layer * self.n_experts + expert) * self.slot_bytes
        shard, begin = self.offsets[layer][0]
        return begin + expert * self.layer_pieces[layer][0].nbytes

    def piece_ranges(self, layer: int, expert: int) -> list[tuple[int, int, int]]:
        """(index in `read_files`, file offset, byte count) of each piece of one expert, in slot
        order (in a records file: back to back from the record's offset)."""
        if self.records is not None:
            out, at = [], self.record_offset(layer, expert)
            for p in self.layer_pieces[layer]:
                out.append((0, at, p.nbytes))
                at += p.nbytes
            return out
        return [(s, begin + expert * p.nbytes, p.nbytes)
                for p, (s, begin) in zip(self.layer_pieces[layer], self.offsets[layer])]


def locate_experts(directory: Path, layers: list[tuple[str, dict]]) -> ExpertTensors:
    """The stacked tensors of each MoE layer, found in the shards' headers.

    layers: per MoE layer in order, (module path as the checkpoint names it, {piece name: the
    module's array}); each array must be stored under `path.name` with its shape and dtype."""
    ckpt = Checkpoint(directory)
    try:
        shards = sorted({info.shard for info in ckpt.tensors.values()})
        index = {p: i for i, p in enumerate(shards)}
        layer_pieces: list[tuple[Piece, ...]] = []
        offsets = []
        n_experts = None
        for path, arrays in layers:
            mine, where = [], []
            for name in sorted(arrays):
                arr = arrays[name]
                key = f"{path}.{name}"
                if key not in ckpt:
                    raise FormatError(f"{directory}: the experts of {path} are not stored stacked ({key} is missing; a "
                                      "checkpoint with one tensor per expert): convert it with mlx-lm's convert "
                                      "(or `strata convert` for a native family) first")
                info = ckpt.tensors[key]
                dtype = SAFETENSORS_DTYPES.get(info.dtype)
                want = str(arr.dtype).removeprefix("mlx.core.")
                if dtype is None or dtype[0] != want or tuple(info.shape) != tuple(arr.shape):
                    raise FormatError(f"{directory}: {key} is stored as {info.dtype} {list(info.shape)}, but mlx-lm "
                                      f"holds it as {want} {list(arr.shape)}: convert it with mlx-lm's convert first")
                e = info.shape[0]
                if n_experts is None:
                    n_experts = e
                elif e != n_experts:
                    raise FormatError(f"{directory}: {key} stacks {e} experts, earlier layers {n_experts}")
                per = int(np.prod(info.shape[1:], dtype=np.int64)) * dtype[1]
                if info.end - info.begin != e * per:
                    raise FormatError(f"{directory}: {key}: {info.end - info.begin} bytes, expected {e * per}")
                mine.append(Piece(name, tuple(info.shape[1:]), dtype[0], per))
                where.append((index[info.shard], info.begin))
            first = layer_pieces[0] if layer_pieces else mine
            if [(p.name, p.dtype, len(p.shape)) for p in mine] != [(p.name, p.dtype, len(p.shape)) for p in first]:
                raise FormatError(f"{directory}: the experts of {path} are stored unlike the first MoE layer's "
                                  f"({_describe(mine)} vs {_describe(first)}): mixed per-layer expert formats "
                                  "run on tier 2 only where every layer stores the same pieces (mlx-lm's mixed "
                                  "recipes: more bits, the same parts)")
            layer_pieces.append(tuple(mine))
            offsets.append(tuple(where))
        if not layer_pieces:
            raise FormatError(f"{directory}: no routed experts (no switch layer) in this model")
        return ExpertTensors(pieces=_largest(layer_pieces), layer_pieces=tuple(layer_pieces), offsets=tuple(offsets),
                             shards=tuple(shards), n_experts=int(n_experts), directory=Path(directory))
    finally:
        ckpt.close()


def _largest(layer_pieces: list[tuple[Piece, ...]]) -> tuple[Piece, ...]:
    """The slot's pieces: each piece as the layer storing it in the most bytes does."""
    return tuple(max(column, key=lambda p: p.nbytes) for column in zip(*layer_pieces))


def _describe(pieces) -> str:
    return ", ".join(f"{p.name} {p.dtype}{list(p.shape)}" for p in pieces)
