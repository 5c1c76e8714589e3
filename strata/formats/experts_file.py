"""The `.experts` file: every routed expert of a model, one 4096-aligned record per (layer, expert).

Layout (little-endian; docs/formats.md is normative):

    [0, 176)                fixed header (HEADER_FIELDS)
    [176, 176 + 4*N)        checksum table: CRC-32 of each record's unpadded bytes, N = L * E,
                            in record order (layer-major)
    [176 + 4*N, +4)         header CRC-32 over bytes [0, 176 + 4*N)
    zeros up to data_offset (the next multiple of 4096)
    record (l, e) at data_offset + (l * E + e) * padded_bytes, `padded_bytes` long

The record layout (strata.formats.expert_record) is recomputed by the reader and checked
against the plane offsets stored in the header, so a writer and reader that disagree about
the layout fail at open, not with garbage weights.

Experts with biases (gpt-oss) are version 2: the same fixed header, followed by the offsets and
sizes of the three bias planes (BIAS_FIELDS, 48 bytes), so the checksum table starts at 224.
A file without biases is written as version 1, byte for byte what it always was.

A file whose projections do not all have one type (a llama.cpp GGUF's experts kept as stored:
Q4_K gate/up with a Q5_1 down, another type in a few layers) is version 3: the fixed header
with `qtype` = MIXED_QTYPE and the six plane fields 0 (each layer has its own record layout),
then `flags` (u64; bit 0: the records carry biases) and a type table of n_layers x 3 u32
(gate, up, down) padded to 8 bytes, then the checksum table. The record stride `padded_bytes`
is the largest layer's padded record, so every record sits where versions 1 and 2 put it and
one arena slot holds any of them; `record_bytes` (what each CRC covers) is the largest layer's
too (a smaller layer's record is followed by zeros up to it).
"""

from __future__ import annotations

import hashlib
import os
import stat
import struct
import sys
from dataclasses import dataclass
from typing import Callable, Sequence

import numpy as np

from strata.errors import FormatError
from strata.formats.expert_record import (
    BIAS_PLANE_NAMES,
    PLANE_ALIGN,
    PLANE_NAMES,
    RECORD_ALIGN,
    ExpertWeights,
    RecordLayout,
    align_up,
    pack_record,
    unpack_record,
)
from strata.formats.atomic import atomic_output
from strata.formats.checksum import CRC32_IMPL, checksum, checksum_update  # noqa: F401 - re-exported
from strata.formats.open_file import OpenFile
from strata.formats.quant_types import QuantType

MAGIC = b"STRXPRT1"
VERSION = 1
VERSION_BIASES = 2  # records carry expert biases; the header grows by BIAS_FIELDS
VERSION_MIXED = 3  # a record layout per layer (types per layer and projection): flags + a type table
VERSIONS = (VERSION, VERSION_BIASES, VERSION_MIXED)
MIXED_QTYPE = 0xFFFFFFFF  # the fixed header's qtype in a version 3 file (no one type)
FLAG_BIASES = 1

# (name, struct code), in file order. The offsets are pinned by tests/formats/test_experts_file.py.
HEADER_FIELDS: tuple[tuple[str, str], ...] = (
    ("magic", "8s"),  # 0
    ("version", "I"),  # 8
    ("qtype", "I"),  # 12: QuantType value
    ("n_layers", "I"),  # 16
    ("n_experts", "I"),  # 20
    ("hidden", "I"),  # 24: D
    ("expert_ffn", "I"),  # 28: F
    ("plane_align", "I"),  # 32: 16
    ("record_align", "I"),  # 36: 4096
    ("record_bytes", "Q"),  # 40: unpadded record size (the checksummed bytes)
    ("padded_bytes", "Q"),  # 48: record stride
    *((f"plane_offset.{n}", "Q") for n in PLANE_NAMES),  # 56..104: within a record
    *((f"plane_bytes.{n}", "Q") for n in PLANE_NAMES),  # 104..152
    ("table_offset", "Q"),  # 152: the checksum table (= HEADER_SIZE)
    ("data_offset", "Q"),  # 160: first record, a multiple of 4096
    ("file_bytes", "Q"),  # 168: total file size
)
HEADER_STRUCT = struct.Struct("<" + "".join(code for _, code in HEADER_FIELDS))
HEADER_SIZE = HEADER_STRUCT.size  # 176
CHECKSUM = struct.Struct("<I")

assert HEADER_SIZE == 176 and HEADER_SIZE % 8 == 0
# version 2 only, right after the fixed header: where the bias planes sit inside a record
BIAS_FIELDS: tuple[tuple[str, str], ...] = (
    *((f"plane_offset.{n}", "Q") for n in BIAS_PLANE_NAMES),  # 176..200
    *((f"plane_bytes.{n}", "Q") for n in BIAS_PLANE_NAMES),  # 200..224
)
BIAS_STRUCT = struct.Struct("<" + "".join(code for _, code in BIAS_FIELDS))
HEADER_SIZE_BIASES = HEADER_SIZE + BIAS_STRUCT.size  # 224
assert HEADER_SIZE_BIASES == 224


FLAGS = struct.Struct("<Q")  # version 3, right after the fixed header
TYPE_ENTRY = struct.Struct("<3I")  # version 3: (gate, up, down) type ids of one layer


def header_size(biases: bool, mixed_layers: int = 0) -> int:
    """Bytes before the checksum table: the fixed header, and the bias planes' fields in version
    2, or the flags and the type table of `mixed_layers` layers in version 3."""
    if mixed_layers:
        return align_up(HEADER_SIZE + FLAGS.size + TYPE_ENTRY.size * mixed_layers, 8)
    return HEADER_SIZE_BIASES if biases else HEADER_SIZE


IDENTITY_BYTES = 16  # of SHA-256: 128 bits, so two different expert sets never share one by chance


def identity_of(header_and_table: bytes) -> str:
    """The identity of an expert set: SHA-256 of the fixed header and the checksum table (every
    record's CRC-32, so a change to any record changes it), first 16 bytes in hex. Stored in the
    model `.gguf` written with it (`strata.experts_identity`); ~50 µs for 12k records."""
    return hashlib.sha256(header_and_table).hexdigest()[: 2 * IDENTITY_BYTES]


@dataclass(frozen=True)
class ExpertsHeader:
    """The header fields of an `.experts` file (the plane offsets/sizes live in `layout`)."""

    version: int
    qtype: QuantType
    n_layers: int
    n_experts: int
    hidden: int
    expert_ffn: int
    record_bytes: int
    padded_bytes: int
    table_offset: int
    data_offset: int
    file_bytes: int
    biases: bool = False  # version 2: every record carries its expert's gate/up/down biases
    # version 3: (gate, up, down) types of each layer; `qtype` is then None (no one type)
    layer_qtypes: tuple[tuple[QuantType, QuantType, QuantType], ...] | None = None

    @property
    def n_records(self) -> int:
        return self.n_layers * self.n_experts

    @property
    def mixed(self) -> bool:
        """Types differ between layers or projections (a version 3 file)."""
        return self.layer_qtypes is not None

    @property
    def type_names(self) -> str:
        """'Q2_0', or the distinct types of a mixed file ('Q4_K, Q5_1, Q8_0'), for messages."""
        if self.layer_qtypes is None:
            return self.qtype.name
        return ", ".join(q.name for q in sorted({q for t in self.layer_qtypes for q in t}, key=int))


def file_geometry(n_layers: int, n_experts: int, padded_bytes: int, biases: bool = False,
                  mixed: bool = False) -> tuple[int, int]:
    """(data_offset, file_bytes) of an `.experts` file: header + table + header CRC, padded to
    RECORD_ALIGN, then n_layers * n_experts records of padded_bytes."""
    n = n_layers * n_experts
    head = header_size(biases, n_layers if mixed else 0)
    data_offset = align_up(head + CHECKSUM.size * n + CHECKSUM.size, RECORD_ALIGN)
    return data_offset, data_offset + n * padded_bytes


def is_mixed(layouts: Sequence[RecordLayout]) -> bool:
    """The layers' record layouts do not share one type (written as version 3)."""
    return any(r.mixed for r in layouts) or len({r.qtype for r in layouts}) > 1


def check_layer_layouts(layouts: Sequence[RecordLayout]) -> None:
    """Every layer's layout has the same shape and biases (only the types may differ)."""
    shapes = {(r.hidden, r.expert_ffn, r.biases) for r in layouts}
    if not layouts or len(shapes) != 1:
        raise ValueError(f"an .experts file's layers share one shape (hidden, expert_ffn, biases), got {sorted(shapes)}")


def _pack_header(layouts: Sequence[RecordLayout], n_experts: int) -> bytes:
    """The header bytes before the checksum table (HEADER_SIZE or HEADER_SIZE_BIASES; version 3:
    header_size(biases, n_layers)). layouts: one RecordLayout per layer."""
    n_layers, rec = len(layouts), layouts[0]
    mixed = is_mixed(layouts)
    record_bytes, padded_bytes = max(r.record_bytes for r in layouts), max(r.padded_bytes for r in layouts)
    data_offset, file_bytes = file_geometry(n_layers, n_experts, padded_bytes, rec.biases, mixed)
    six = rec.planes[: len(PLANE_NAMES)]
    version = VERSION_MIXED if mixed else VERSION_BIASES if rec.biases else VERSION
    planes = [0] * (2 * len(PLANE_NAMES)) if mixed else [*(p.offset for p in six), *(p.nbytes for p in six)]
    values = [MAGIC, version, MIXED_QTYPE if mixed else int(rec.qtype), n_layers, n_experts, rec.hidden,
              rec.expert_ffn, PLANE_ALIGN, RECORD_ALIGN, record_bytes, padded_bytes, *planes,
              header_size(rec.biases, n_layers if mixed else 0), data_offset, file_bytes]
    head = HEADER_STRUCT.pack(*values)
    if mixed:
        head += FLAGS.pack(FLAG_BIASES if rec.biases else 0)
        head += b"".join(TYPE_ENTRY.pack(*(int(q) for q in r.qtypes)) for r in layouts)
        return head + bytes(header_size(rec.biases, n_layers) - len(head))
    if rec.biases:
        bias = rec.planes[len(PLANE_NAMES):]
        head += BIAS_STRUCT.pack(*(p.offset for p in bias), *(p.nbytes for p in bias))
    return head


# ---------------------------------------------------------------- writer


def write_experts(
    path: str | os.PathLike,
    *,
    qtype: QuantType,
    n_layers: int,
    n_experts: int,
    hidden: int,
    expert_ffn: int,
    get_expert: Callable[[int, int], ExpertWeights],
    progress: bool = False,
    biases: bool = False,
    layer_qtypes: Sequence[tuple[QuantType, QuantType, QuantType]] | None = None,
) -> ExpertsHeader:
    """Write an `.experts` file, one record at a time (never more than one expert in memory).
    biases: every expert carries gate/up/down biases (a version 2 file). layer_qtypes: the
    (gate, up, down) types of each layer, where they differ (a version 3 file unless they are
    all `qtype` after all); None: every projection is `qtype`.

    The file is written to `path + ".tmp"` and renamed over `path` only when complete, so an
    interrupted write (an exception from `get_expert`, Ctrl-C) leaves nothing under `path`.
    """
    _check_counts(path, n_layers, n_experts)
    if layer_qtypes is None:
        layouts = [RecordLayout(QuantType(qtype), hidden, expert_ffn, biases)] * n_layers
    else:
        if len(layer_qtypes) != n_layers:
            raise ValueError(f"{os.fspath(path)}: layer_qtypes has {len(layer_qtypes)} layers, the file {n_layers}")
        layouts = [RecordLayout(g, hidden, expert_ffn, biases, up_qtype=u, down_qtype=d) for g, u, d in layer_qtypes]
    stride = max(r.padded_bytes for r in layouts)
    crc_bytes = max(r.record_bytes for r in layouts)

    def packed(l: int, e: int) -> tuple[bytes, int]:
        try:
            buf = pack_record(get_expert(l, e), layouts[l])
        except ValueError as err:
            raise ValueError(f"{os.fspath(path)}: layer {l} expert {e}: {err}") from None
        buf += bytes(stride - len(buf))  # a smaller layer's record, zero-padded to the stride
        return buf, checksum(memoryview(buf)[:crc_bytes])

    return _write(path, layouts, n_experts, packed, progress)


def write_packed_experts(
    path: str | os.PathLike,
    rec: RecordLayout,
    *,
    n_layers: int,
    n_experts: int,
    get_record: Callable[[int, int], tuple[bytes | np.ndarray, int]],
    progress: bool = False,
) -> ExpertsHeader:
    """`write_experts` from records already packed: get_record(l, e) -> (its `rec.padded_bytes`
    bytes, the CRC-32 of its first `rec.record_bytes`). A synthetic benchmark's file repeats a pool
    of packed records (benchmarks/_random_experts.py): packing each of DeepSeek-V3's 13.8 MB
    records again took ~50 ms of the ~70 ms a record cost (measured on a 2-core CPU host)."""
    _check_counts(path, n_layers, n_experts)
    return _write(path, [rec] * n_layers, n_experts, get_record, progress)


def _check_counts(path: str | os.PathLike, n_layers: int, n_experts: int) -> None:
    if n_layers <= 0 or n_experts <= 0:
        raise ValueError(f"{os.fspath(path)}: n_layers={n_layers} and n_experts={n_experts} must be positive")


def _write(path: str | os.PathLike, layouts: Sequence[RecordLayout], n_experts: int,
           get_record: Callable[[int, int], tuple[bytes | np.ndarray, int]], progress: bool) -> ExpertsHeader:
    """The writer behind both: records of the stride max(padded_bytes) over the layers' layouts."""
    path = os.fspath(path)
    n_layers = len(layouts)
    check_layer_layouts(layouts)
    header = _pack_header(layouts, n_experts)
    stride = max(r.padded_bytes for r in layouts)
    data_offset, file_bytes = file_geometry(n_layers, n_experts, stride, layouts[0].biases, is_mixed(layouts))
    crcs = np.zeros(n_layers * n_experts, "<u4")
    with atomic_output(path) as tmp:
        with open(tmp, "wb") as f:
            f.write(bytes(data_offset))  # header placeholder; filled in once the checksums are known
            for l in range(n_layers):
                for e in range(n_experts):
                    buf, crc = get_record(l, e)
                    if memoryview(buf).nbytes != stride:
                        raise ValueError(f"{path}: layer {l} expert {e}: a packed record of "
                                         f"{memoryview(buf).nbytes} bytes, the layout's is {stride}")
                    crcs[l * n_experts + e] = crc
                    f.write(buf)
                if progress:
                    print(f"{os.path.basename(path)}: layer {l + 1}/{n_layers}", file=sys.stderr, flush=True)
            head = header + crcs.tobytes()
            f.seek(0)
            f.write(head + CHECKSUM.pack(checksum(head)))
            f.flush()
            os.fsync(f.fileno())
            written = f.seek(0, os.SEEK_END)
            if written != file_bytes:  # pragma: no cover - a bug in this writer, not in its input
                raise RuntimeError(f"{tmp}: wrote {written} bytes, the header says {file_bytes}")
    return _parse_header(path, header, file_bytes)


# ---------------------------------------------------------------- reader


def _unpack_fields(raw: bytes) -> dict[str, object]:
    """The header fields of raw (the fixed header, and the bias planes' fields when raw has them)."""
    out = dict(zip((name for name, _ in HEADER_FIELDS), HEADER_STRUCT.unpack(raw[:HEADER_SIZE])))
    if len(raw) >= HEADER_SIZE_BIASES:
        out.update(zip((name for name, _ in BIAS_FIELDS), BIAS_STRUCT.unpack(raw[HEADER_SIZE:HEADER_SIZE_BIASES])))
    return out


def _qtype(name: str, value: int) -> QuantType:
    try:
        return QuantType(value)
    except ValueError:
        raise FormatError(f"{name}: unknown quant type id {value}") from None


def _layer_layouts(name: str, raw: bytes, v: dict) -> list[RecordLayout]:
    """One RecordLayout per layer, from the header (version 3: its flags and type table)."""
    if v["version"] != VERSION_MIXED:
        return [RecordLayout(_qtype(name, v["qtype"]), v["hidden"], v["expert_ffn"], v["version"] == VERSION_BIASES)
                ] * v["n_layers"]
    (flags,) = FLAGS.unpack_from(raw, HEADER_SIZE)
    if flags & ~FLAG_BIASES:
        raise FormatError(f"{name}: bad header: unknown flags {flags:#x}")
    entries = [TYPE_ENTRY.unpack_from(raw, HEADER_SIZE + FLAGS.size + TYPE_ENTRY.size * l) for l in range(v["n_layers"])]
    return [RecordLayout(*(_qtype(name, t) for t in ids[:1]), v["hidden"], v["expert_ffn"], bool(flags & FLAG_BIASES),
                         up_qtype=_qtype(name, ids[1]), down_qtype=_qtype(name, ids[2])) for ids in entries]


def _parse_header(name: str, raw: bytes, actual_bytes: int) -> ExpertsHeader:
    """Check the header against the layout this reader computes. raw: header_size(...) bytes."""
    v = _unpack_fields(raw)
    if v["n_layers"] <= 0 or v["n_experts"] <= 0:
        raise FormatError(f"{name}: bad header: n_layers={v['n_layers']}, n_experts={v['n_experts']}")
    try:
        layouts = _layer_layouts(name, raw, v)
    except ValueError as e:
        raise FormatError(f"{name}: bad header: {e}") from None
    rec = layouts[0]
    packed = _pack_header(layouts, v["n_experts"])
    want = _unpack_fields(packed)
    what = "mixed types" if v["version"] == VERSION_MIXED else rec.qtype.name
    for key, expected in want.items():
        if v[key] != expected:
            raise FormatError(f"{name}: header field {key} is {v[key]}, expected {expected} for "
                              f"{what} D={rec.hidden} F={rec.expert_ffn}")
    if raw != packed:  # version 3's flags, type table and padding
        raise FormatError(f"{name}: bad header: the type table's padding is not zero")
    if actual_bytes != v["file_bytes"]:
        what = "truncated" if actual_bytes < v["file_bytes"] else "trailing bytes"
        raise FormatError(f"{name}: {what}: {actual_bytes} bytes, header says {v['file_bytes']}")
    mixed = v["version"] == VERSION_MIXED
    return ExpertsHeader(version=v["version"], qtype=None if mixed else rec.qtype, n_layers=v["n_layers"],
                         n_experts=v["n_experts"], hidden=v["hidden"], expert_ffn=v["expert_ffn"],
                         record_bytes=v["record_bytes"], padded_bytes=v["padded_bytes"],
                         table_offset=v["table_offset"], data_offset=v["data_offset"], file_bytes=v["file_bytes"],
                         biases=rec.biases, layer_qtypes=tuple(r.qtypes for r in layouts) if mixed else None)


class ExpertsFile(OpenFile):
    """An open `.experts` file. Reads use pread on one descriptor, so they are thread-safe;
    the runtime may also pread `fileno()` itself at `record_offset(l, e)`."""

    def __init__(self, path: str, fd: int, header: ExpertsHeader, checksums: np.ndarray, identity: str) -> None:
        self.path = path
        self.header = header
        self.identity = identity  # identity_of(header bytes + checksum table): names this expert set
        if header.layer_qtypes is None:
            self._layouts = [RecordLayout(header.qtype, header.hidden, header.expert_ffn, header.biases)]
        else:
            self._layouts = [RecordLayout(g, header.hidden, header.expert_ffn, header.biases, up_qtype=u, down_qtype=d)
                             for g, u, d in header.layer_qtypes]
        # the one layout of every record; None in a mixed file (layer_layout(l) gives each layer's)
        self.layout = None if header.mixed else self._layouts[0]
        self._fd = fd
        self._checksums = checksums  # [n_layers, n_experts] uint32

    @classmethod
    def open(cls, path: str | os.PathLike) -> "ExpertsFile":
        """Open and validate (magic, version, header checksum, layout, file length)."""
        path = os.fspath(path)
        try:
            fd = os.open(path, os.O_RDONLY | getattr(os, "O_NONBLOCK", 0))  # a FIFO must not block the open
        except OSError as e:
            raise FormatError(f"{path}: cannot open: {e.strerror}") from None
        try:
            header, sums, identity = cls._validate(path, fd)
        except BaseException:
            os.close(fd)
            raise
        return cls(path, fd, header, sums, identity)

    @staticmethod
    def _validate(path: str, fd: int) -> tuple[ExpertsHeader, np.ndarray, str]:
        st = os.fstat(fd)
        if not stat.S_ISREG(st.st_mode):
            raise FormatError(f"{path}: not a regular file (an .experts file must be a file on disk)")
        os.set_blocking(fd, True)
        size = st.st_size
        raw = os.pread(fd, HEADER_SIZE, 0)
        if raw[: len(MAGIC)] != MAGIC:
            raise FormatError(f"{path}: not a strata .experts file (magic {raw[:len(MAGIC)]!r}, expected {MAGIC!r})")
        if len(raw) < HEADER_SIZE:
            raise FormatError(f"{path}: truncated: {size} bytes, shorter than the {HEADER_SIZE}-byte header")
        version, n_layers = HEADER_STRUCT.unpack(raw)[1], HEADER_STRUCT.unpack(raw)[3]
        if version not in VERSIONS:
            raise FormatError(f"{path}: unsupported .experts version {version} "
                              f"(this reader knows {', '.join(map(str, VERSIONS))}; a newer strata wrote it?)")
        head_bytes = header_size(version == VERSION_BIASES, n_layers if version == VERSION_MIXED else 0)
        if head_bytes > size:
            raise FormatError(f"{path}: truncated or corrupt header: {size} bytes, the header of {n_layers} "
                              f"layers needs {head_bytes}")
        if head_bytes > HEADER_SIZE:
            raw += os.pread(fd, head_bytes - HEADER_SIZE, HEADER_SIZE)
            if len(raw) < head_bytes:
                raise FormatError(f"{path}: truncated: {size} bytes, shorter than the {head_bytes}-byte header")
        v = _unpack_fields(raw)
        n = v["n_layers"] * v["n_experts"]
        table_end = head_bytes + CHECKSUM.size * n
        if table_end + CHECKSUM.size > size:
            raise FormatError(f"{path}: truncated or corrupt header: {size} bytes, the checksum table of "
                              f"{v['n_layers']}x{v['n_experts']} records ends at {table_end + CHECKSUM.size}")
        table = os.pread(fd, table_end + CHECKSUM.size - head_bytes, head_bytes)
        (stored,) = CHECKSUM.unpack(table[-CHECKSUM.size:])
        if checksum(raw + table[: -CHECKSUM.size]) != stored:
            raise FormatError(f"{path}: header checksum mismatch (header or checksum table corrupt)")
        header = _parse_header(path, raw, size)
        sums = np.frombuffer(table[: -CHECKSUM.size], "<u4").reshape(header.n_layers, header.n_experts)
        return header, sums, identity_of(raw + table[: -CHECKSUM.size])

    # -------------------------------------------------------- records

    def _check_index(self, layer: int, expert: int) -> None:
        h = self.header
        if not (0 <= layer < h.n_layers and 0 <= expert < h.n_experts):
            raise ValueError(f"{self.path}: no record for layer {layer} expert {expert} "
                             f"(file has {h.n_layers} layers x {h.n_experts} experts)")

    def layer_layout(self, layer: int) -> RecordLayout:
        """The record layout of a layer's experts (every layer's is `layout` in a single-type file)."""
        if not 0 <= layer < self.header.n_layers:
            raise ValueError(f"{self.path}: no layer {layer} (file has {self.header.n_layers} layers)")
        return self._layouts[layer if self.header.mixed else 0]

    def record_offset(self, layer: int, expert: int) -> int:
        """Byte offset of record (layer, expert): a multiple of 4096."""
        self._check_index(layer, expert)
        return self.header.data_offset + (layer * self.header.n_experts + expert) * self.header.padded_bytes

    @property
    def files(self) -> tuple[str, ...]:
        """The files its records are read from (strata.formats.expert_store)."""
        return (self.path,)

    @property
    def reads_per_record(self) -> float:
        """One read fills a slot (strata.formats.expert_store)."""
        return 1.0

    @property
    def multi_read_share(self) -> float:
        """No record needs more than one read."""
        return 0.0

    @property
    def read_bytes_per_record(self) -> float:
        """The record stride: what one read asks for."""
        return float(self.header.padded_bytes)

    def checksum(self, layer: int, expert: int) -> int:
        """The stored CRC-32 of record (layer, expert)."""
        self._check_index(layer, expert)
        return int(self._checksums[layer, expert])

    def read_record(self, layer: int, expert: int, *, verify: bool = True, out: np.ndarray | None = None) -> np.ndarray:
        """The `padded_bytes` bytes of a record, read with one pread (into `out` if given, e.g. an
        arena slot: a writable uint8 array of at least padded_bytes).

        Shapes:
            -> uint8 [padded_bytes]
        """
        offset = self.record_offset(layer, expert)
        n = self.header.padded_bytes
        if out is None:
            out = np.empty(n, np.uint8)
        elif out.dtype != np.uint8 or out.ndim != 1 or out.size < n or not out.flags.c_contiguous:
            raise ValueError(f"read_record: out must be a contiguous 1-D uint8 array of >= {n} bytes")
        else:
            out = out[:n]
        got = os.preadv(self.fileno(), [memoryview(out)], offset)
        if got != n:
            raise FormatError(f"{self.path}: short read of layer {layer} expert {expert} at offset {offset}: "
                              f"{got} of {n} bytes")
        if verify:
            actual, stored = checksum(out[: self.header.record_bytes]), self.checksum(layer, expert)
            if actual != stored:
                raise FormatError(f"{self.path}: checksum mismatch in layer {layer} expert {expert} "
                                  f"(record at offset {offset}): crc32 {actual:#010x}, header says {stored:#010x}")
        return out

    def expert(self, layer: int, expert: int, *, verify: bool = True) -> ExpertWeights:
        """The weights of (layer, expert), as views of a freshly read record."""
        return unpack_record(self.read_record(layer, expert, verify=verify), self.layer_layout(layer))

    def verify_all(self) -> None:
        """Read every record and check its checksum (FormatError at the first mismatch)."""
        buf = np.empty(self.header.padded_bytes, np.uint8)
        for l in range(self.header.n_layers):
            for e in range(self.header.n_experts):
                self.read_record(l, e, out=buf)

    def __repr__(self) -> str:
        h = self.header
        return (f"ExpertsFile({self.path!r}, {h.type_names}, {h.n_layers} layers x {h.n_experts} experts, "
                f"D={h.hidden}, F={h.expert_ffn}, {h.padded_bytes} bytes/record)")
