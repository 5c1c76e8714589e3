"""An expert set read in place: each record put together in its slot from pieces of other files.

An `.experts` file holds each (layer, expert) as one aligned record, so one read fills a slot. A
llama.cpp GGUF holds a MoE layer's experts stacked per projection (`blk.L.ffn_gate_exps` [E, F, D],
`ffn_up_exps`, `ffn_down_exps`): one expert is three slices of three tensors, anywhere in the file
(or in different parts of a split GGUF). `PieceStore` is the expert set an `.experts` file would
hold, read from those slices: each record's pieces (file, offset, bytes) are placed at the record
layout's plane offsets (strata.formats.expert_record), so a slot holds what the converted record
holds, byte for byte up to the layer's `record_bytes`, and every engine reads it unchanged. It
answers what the engines ask of an `ExpertsFile` (`header`, `layer_layout`, `read_record`,
`expert`, `identity`, `path`, `close`, and how many reads and bytes a record costs:
strata.formats.expert_store names that interface) and adds `reads(layer, expert)`: the aligned
reads that fill one record.

Reads are aligned around each slice: [offset rounded down to READ_ALIGN, end rounded up), so a read
is whole pages (what O_DIRECT asks, and what the page cache reads anyway); the windows of one
record that touch in one file are one read (a fused gate/up tensor gives one read for both).
Placement (`place`): whole-block types and floats are copied as stored; ggml's Q8_0 / Q4_0 blocks
(float16 d, then the codes) are split into the record's codes and scales planes, as
`reference.quants.from_blocks` splits them when a conversion copies them. The bytes between
planes are zeroed (`zero_gaps`), so a record's bytes do not depend on what the slot held before.

Verification: a GGUF carries no checksums. The file's structure is checked at open by ggml's
loader's rules (strata/formats/gguf_file.py: offsets, types, sizes, truncation), and `identity`
names the files as they were then (each one's size, mtime and the SHA-256 of its header and
tensor index). The first read of each record records the CRC-32 of its bytes and checks its
blocks finite; every later read of it must give that CRC again (`check_record`), so a file
changed or torn under a run is caught where it is read. Nothing is written beside the file
(docs/convert.md says why not a sidecar).
"""

from __future__ import annotations

import hashlib
import json
import os
import threading
from dataclasses import dataclass
from typing import Sequence

import numpy as np

from strata.errors import FormatError
from strata.formats.checksum import checksum
from strata.formats.expert_record import PROJECTIONS, RecordLayout, unpack_record
from strata.formats.experts_file import (
    IDENTITY_BYTES,
    VERSION,
    VERSION_BIASES,
    VERSION_MIXED,
    ExpertsHeader,
    is_mixed,
    check_layer_layouts,
)
from strata.formats.quant_types import layout

__all__ = ["READ_ALIGN", "Piece", "Read", "PieceStore", "files_identity"]

READ_ALIGN = 4096  # page size and O_DIRECT granularity: a read starts and ends on a page


@dataclass(frozen=True)
class Piece:
    """One plane's bytes of every expert of a layer, in a file: expert e's are
    [offset + e * stride, + nbytes) of `files[file]`, placed at `at` in the record. `split`
    (block_bytes, scale_bytes, scales_at): the bytes are ggml blocks whose leading scale_bytes go
    to the scales plane at `scales_at`, the rest to the codes plane at `at`; None: copied as they are."""

    file: int
    offset: int
    stride: int
    nbytes: int
    at: int
    split: tuple[int, int, int] | None = None

    def place(self, src: np.ndarray, slot: np.ndarray) -> None:
        """Put this piece's bytes `src` (uint8 [nbytes]) into a record buffer `slot` (uint8)."""
        if self.split is None:
            slot[self.at:self.at + self.nbytes] = src
            return
        block, scale, scales_at = self.split
        blocks = src.reshape(-1, block)  # [n_blocks, block_bytes]: d first, then the codes
        n = blocks.shape[0]
        slot[self.at:self.at + n * (block - scale)].reshape(n, block - scale)[...] = blocks[:, scale:]
        slot[scales_at:scales_at + n * scale].reshape(n, scale)[...] = blocks[:, :scale]


@dataclass(frozen=True)
class Read:
    """One aligned read of a record: `length` bytes of `files[file]` from `start`; `pieces` are
    (piece, its bytes' offset in the read); `need`: the bytes the pieces need (a read at the
    end of a file may return less than `length`, never less than `need`)."""

    file: int
    start: int
    length: int
    need: int
    pieces: tuple[tuple[Piece, int], ...]


def record_pieces(rec: RecordLayout, sources: Sequence[tuple[int, int, int, int]],
                  bias_sources: Sequence[tuple[int, int, int, int]] = ()) -> tuple[Piece, ...]:
    """The pieces of a layer's records: `sources` per projection (gate, up, down) as (file,
    offset of expert 0, stride, nbytes) of its stored blocks, `bias_sources` the same for its
    float32 biases (records with biases)."""
    pieces = []
    for proj, (file, offset, stride, nbytes) in zip(PROJECTIONS, sources):
        lay, codes, scales = layout(rec.qtype_of(proj)), rec.codes(proj), rec.scales(proj)
        if nbytes != codes.nbytes + scales.nbytes:
            raise FormatError(f"a {rec.qtype_of(proj).name} {proj} projection of {nbytes} bytes; its record "
                              f"planes hold {codes.nbytes + scales.nbytes}")
        split = (lay.block_bytes, lay.scale_bytes, scales.offset) if lay.scale_bytes else None
        pieces.append(Piece(file, offset, stride, nbytes, codes.offset, split))
    for proj, (file, offset, stride, nbytes) in zip(PROJECTIONS, bias_sources):
        if nbytes != rec.bias(proj).nbytes:
            raise FormatError(f"a {proj} bias of {nbytes} bytes; its record plane holds {rec.bias(proj).nbytes}")
        pieces.append(Piece(file, offset, stride, nbytes, rec.bias(proj).offset))
    return tuple(pieces)


def files_identity(files: Sequence[tuple[str, int]]) -> str:
    """The identity of files read in place: SHA-256 over each one's name, size, mtime and the
    SHA-256 of its first `header_bytes` (a GGUF's header and tensor index), first 16 bytes in hex.
    files: (path, header_bytes) each."""
    parts = []
    for path, header_bytes in files:
        st = os.stat(path)
        with open(path, "rb") as f:
            head = hashlib.sha256(f.read(header_bytes)).hexdigest()
        parts.append([os.path.basename(path), st.st_size, st.st_mtime_ns, head])
    return hashlib.sha256(json.dumps(parts).encode()).hexdigest()[: 2 * IDENTITY_BYTES]


def _size_mtime(path: str) -> tuple[int, int]:
    st = os.stat(path)
    return st.st_size, st.st_mtime_ns


def _gaps(rec: RecordLayout) -> tuple[tuple[int, int], ...]:
    """The spans of [0, record_bytes) that no plane covers (alignment padding between planes)."""
    out, end = [], 0
    for p in rec.planes:
        if p.offset > end:
            out.append((end, p.offset))
        end = max(end, p.end)
    return tuple(out)


class PieceStore:
    """An expert set whose records are put together from pieces of other files (module doc).

    files: the paths the pieces name (their index is `Piece.file`); layouts: one RecordLayout per
    MoE layer (the same shape, types per layer and projection); pieces: per layer, its records'
    pieces; identity: files_identity of the files. `path` (named in messages) is the first file."""

    def __init__(self, files: Sequence[str], layouts: Sequence[RecordLayout], n_experts: int,
                 pieces: Sequence[tuple[Piece, ...]], identity: str) -> None:
        check_layer_layouts(layouts)
        if len(pieces) != len(layouts):
            raise ValueError(f"PieceStore: pieces for {len(pieces)} layers, layouts for {len(layouts)}")
        self.files = tuple(os.fspath(f) for f in files)
        self.path = self.files[0]
        self.identity = identity
        self._layouts = tuple(layouts)
        self._pieces = tuple(pieces)
        self._gaps = tuple(_gaps(r) for r in layouts)
        rec, mixed = layouts[0], is_mixed(layouts)
        self.header = ExpertsHeader(
            version=VERSION_MIXED if mixed else VERSION_BIASES if rec.biases else VERSION,
            qtype=None if mixed else rec.qtype, n_layers=len(layouts), n_experts=n_experts, hidden=rec.hidden,
            expert_ffn=rec.expert_ffn, record_bytes=max(r.record_bytes for r in layouts),
            padded_bytes=max(r.padded_bytes for r in layouts), table_offset=0, data_offset=0,
            file_bytes=sum(os.path.getsize(f) for f in self.files), biases=rec.biases,
            layer_qtypes=tuple(r.qtypes for r in layouts) if mixed else None)
        self.layout = None if mixed else rec
        self._crc: dict[tuple[int, int], int] = {}  # (layer, expert) -> CRC-32 of its first read
        self._lock = threading.Lock()
        self._fds: list[int] | None = None  # for read_record, opened on first use
        self._counts: tuple[float, float] | None = None  # (reads per record, share needing more than one)
        self._stats = [_size_mtime(f) for f in self.files]  # as opened, for messages

    # -------------------------------------------------------- geometry

    def layer_layout(self, layer: int) -> RecordLayout:
        if not 0 <= layer < self.header.n_layers:
            raise ValueError(f"{self.path}: no MoE layer {layer} ({self.header.n_layers} MoE layers)")
        return self._layouts[layer]

    def _check_index(self, layer: int, expert: int) -> None:
        h = self.header
        if not (0 <= layer < h.n_layers and 0 <= expert < h.n_experts):
            raise ValueError(f"{self.path}: no record for layer {layer} expert {expert} "
                             f"(the model has {h.n_layers} MoE layers x {h.n_experts} experts)")

    def record_offset(self, layer: int, expert: int) -> int:
        """The file offset of the record's first piece (named in messages)."""
        self._check_index(layer, expert)
        p = self._pieces[layer][0]
        return p.offset + expert * p.stride

    def reads(self, layer: int, expert: int) -> tuple[Read, ...]:
        """The aligned reads that fill record (layer, expert) (module doc), in file order."""
        self._check_index(layer, expert)
        spans = sorted(((p.file, p.offset + expert * p.stride, p) for p in self._pieces[layer]), key=lambda t: t[:2])
        out: list[list] = []  # [file, start, end, need_end, [(piece, at)]]
        for file, at, p in spans:
            lo = at - at % READ_ALIGN
            hi = -(-(at + p.nbytes) // READ_ALIGN) * READ_ALIGN
            if out and out[-1][0] == file and lo <= out[-1][2]:
                w = out[-1]
                w[2], w[3] = max(w[2], hi), max(w[3], at + p.nbytes)
                w[4].append((p, at))
            else:
                out.append([file, lo, hi, at + p.nbytes, [(p, at)]])
        return tuple(Read(f, lo, hi - lo, need - lo, tuple((p, at - lo) for p, at in placed))
                     for f, lo, hi, need, placed in out)

    @property
    def reads_per_record(self) -> float:
        """Reads per record, the mean over every record."""
        return self._read_counts()[0]

    @property
    def multi_read_share(self) -> float:
        """The share of records that need more than one read (an `.experts` record: none)."""
        return self._read_counts()[1]

    def _read_counts(self) -> tuple[float, float]:
        if self._counts is None:
            n = [len(self.reads(l, e)) for l in range(self.header.n_layers) for e in range(self.header.n_experts)]
            self._counts = (float(np.mean(n)), float(np.mean(np.asarray(n) > 1)))
        return self._counts

    @property
    def read_bytes_per_record(self) -> float:
        """Bytes one record's reads ask for (its slices widened to whole pages), the mean over
        every record."""
        total = 0
        for l in range(self.header.n_layers):
            e = np.arange(self.header.n_experts, dtype=np.int64)
            for p in self._pieces[l]:
                at = p.offset + e * p.stride
                total += int(((-(-(at + p.nbytes) // READ_ALIGN)) * READ_ALIGN - at // READ_ALIGN * READ_ALIGN).sum())
        return total / self.header.n_records

    @property
    def bounce_bytes(self) -> int:
        """The size of a buffer that holds any one read (its pieces plus a page each side of each)."""
        most = max(sum(p.nbytes for p in ps) + 2 * READ_ALIGN * len(ps) for ps in self._pieces)
        return -(-most // READ_ALIGN) * READ_ALIGN

    # -------------------------------------------------------- filling a record

    @staticmethod
    def fill(read: Read, window: np.ndarray, out: np.ndarray) -> None:
        """Place the pieces of one `read` (its bytes in `window`) into the record buffer `out`."""
        for p, at in read.pieces:
            p.place(window[at:at + p.nbytes], out)

    def zero_gaps(self, layer: int, out: np.ndarray) -> None:
        """Zero the bytes between a layer's planes in `out` (they may hold another record's)."""
        for lo, hi in self._gaps[layer]:
            out[lo:hi] = 0

    def check_record(self, layer: int, expert: int, out: np.ndarray) -> None:
        """The read's verification (module doc): on the record's first read its CRC-32 is kept and
        its blocks are checked finite; a later read must give the same CRC. FormatError otherwise."""
        rec = self._layouts[layer]
        crc = checksum(out[:rec.record_bytes])
        with self._lock:
            first = self._crc.get((layer, expert))
        if first is None:
            w = unpack_record(out, rec)
            for proj in PROJECTIONS:
                bad = w.projection(proj).non_finite()
                if w.biases is not None:
                    bad += int(np.count_nonzero(~np.isfinite(w.biases.projection(proj))))
                if bad:
                    raise FormatError(f"{self.path}: MoE layer {layer} expert {expert} {proj} projection: {bad} "
                                      "non-finite values (NaN or inf); the file is damaged")
            with self._lock:
                first = self._crc.setdefault((layer, expert), crc)
        if crc != first:
            raise FormatError(f"{self.path}: MoE layer {layer} expert {expert}: checksum mismatch: crc32 {crc:#010x}, "
                              f"its first read gave {first:#010x} ({self.changed_since_open()})")

    def changed_since_open(self) -> str:
        """Why a read may differ, for messages: whether a file's size or mtime moved since open."""
        for f, then in zip(self.files, self._stats):
            try:
                st = os.stat(f)
            except OSError as e:
                return f"{f}: {e.strerror} since it was opened"
            if st.st_size != then[0]:
                return f"{os.path.basename(f)} changed since it was opened: size {then[0]} -> {st.st_size}"
            if st.st_mtime_ns != then[1]:
                return f"{os.path.basename(f)} was written to since it was opened (its mtime moved)"
        return "the bytes changed with the file's size and mtime unchanged: a failing disk?"

    def read_record(self, layer: int, expert: int, *, verify: bool = True, out: np.ndarray | None = None) -> np.ndarray:
        """The record (layer, expert) as the converted `.experts` record holds it, read with
        buffered preads (into `out` if given: uint8, at least `padded_bytes`).

        Shapes:
            -> uint8 [padded_bytes]
        """
        n = self.header.padded_bytes
        if out is None:
            out = np.zeros(n, np.uint8)
        elif out.dtype != np.uint8 or out.ndim != 1 or out.size < n or not out.flags.c_contiguous:
            raise ValueError(f"read_record: out must be a contiguous 1-D uint8 array of >= {n} bytes")
        else:
            out = out[:n]
        if self._fds is None:
            with self._lock:
                if self._fds is None:
                    self._fds = [os.open(f, os.O_RDONLY) for f in self.files]
        for r in self.reads(layer, expert):
            window = np.empty(r.length, np.uint8)
            got = os.preadv(self._fds[r.file], [window], r.start)
            if got < r.need:
                raise FormatError(f"{self.files[r.file]}: short read of MoE layer {layer} expert {expert} at "
                                  f"{r.start}: {got} of {r.need} bytes (the file is truncated?)")
            self.fill(r, window, out)
        self.zero_gaps(layer, out)
        if verify:
            self.check_record(layer, expert, out)
        return out

    def expert(self, layer: int, expert: int, *, verify: bool = True):
        """The ExpertWeights of (layer, expert), as views of a freshly read record."""
        return unpack_record(self.read_record(layer, expert, verify=verify), self._layouts[layer])

    def verify_all(self) -> None:
        """Read every record once (each checked finite; its CRC kept for later reads)."""
        buf = np.zeros(self.header.padded_bytes, np.uint8)
        for l in range(self.header.n_layers):
            for e in range(self.header.n_experts):
                self.read_record(l, e, out=buf)

    def close(self) -> None:
        fds, self._fds = self._fds, None
        for fd in fds or ():
            os.close(fd)

    def __enter__(self) -> "PieceStore":
        return self

    def __exit__(self, *exc) -> None:
        self.close()

    def __repr__(self) -> str:
        h = self.header
        return (f"PieceStore({self.path!r}, {h.type_names}, {h.n_layers} layers x {h.n_experts} experts, "
                f"D={h.hidden}, F={h.expert_ffn}, in place)")
