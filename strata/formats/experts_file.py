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
"""

from __future__ import annotations

import hashlib
import os
import stat
import struct
import sys
from dataclasses import dataclass
from typing import Callable

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

# (name, struct code), in file order. The offsets are pinned by tests/test_experts_file.py.
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


def header_size(biases: bool) -> int:
    """Bytes before the checksum table: the fixed header, and the bias planes' fields in version 2."""
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

    @property
    def n_records(self) -> int:
        return self.n_layers * self.n_experts


def file_geometry(n_layers: int, n_experts: int, padded_bytes: int, biases: bool = False) -> tuple[int, int]:
    """(data_offset, file_bytes) of an `.experts` file: header + table + header CRC, padded to
    RECORD_ALIGN, then n_layers * n_experts records of padded_bytes."""
    n = n_layers * n_experts
    data_offset = align_up(header_size(biases) + CHECKSUM.size * n + CHECKSUM.size, RECORD_ALIGN)
    return data_offset, data_offset + n * padded_bytes


def _pack_header(rec: RecordLayout, n_layers: int, n_experts: int) -> bytes:
    """The header bytes before the checksum table (HEADER_SIZE, or HEADER_SIZE_BIASES)."""
    data_offset, file_bytes = file_geometry(n_layers, n_experts, rec.padded_bytes, rec.biases)
    six = rec.planes[: len(PLANE_NAMES)]
    values = [MAGIC, VERSION_BIASES if rec.biases else VERSION, int(rec.qtype), n_layers, n_experts, rec.hidden,
              rec.expert_ffn, PLANE_ALIGN, RECORD_ALIGN, rec.record_bytes, rec.padded_bytes,
              *(p.offset for p in six), *(p.nbytes for p in six),
              header_size(rec.biases), data_offset, file_bytes]
    head = HEADER_STRUCT.pack(*values)
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
) -> ExpertsHeader:
    """Write an `.experts` file, one record at a time (never more than one expert in memory).
    biases: every expert carries gate/up/down biases (a version 2 file).

    The file is written to `path + ".tmp"` and renamed over `path` only when complete, so an
    interrupted write (an exception from `get_expert`, Ctrl-C) leaves nothing under `path`.
    """
    rec = RecordLayout(QuantType(qtype), hidden, expert_ffn, biases)

    def packed(l: int, e: int) -> tuple[bytes, int]:
        try:
            buf = pack_record(get_expert(l, e), rec)
        except ValueError as err:
            raise ValueError(f"{os.fspath(path)}: layer {l} expert {e}: {err}") from None
        return buf, checksum(memoryview(buf)[: rec.record_bytes])

    return write_packed_experts(path, rec, n_layers=n_layers, n_experts=n_experts, get_record=packed,
                                progress=progress)


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
    path = os.fspath(path)
    if n_layers <= 0 or n_experts <= 0:
        raise ValueError(f"{path}: n_layers={n_layers} and n_experts={n_experts} must be positive")
    header = _pack_header(rec, n_layers, n_experts)
    data_offset, file_bytes = file_geometry(n_layers, n_experts, rec.padded_bytes, rec.biases)
    crcs = np.zeros(n_layers * n_experts, "<u4")
    with atomic_output(path) as tmp:
        with open(tmp, "wb") as f:
            f.write(bytes(data_offset))  # header placeholder; filled in once the checksums are known
            for l in range(n_layers):
                for e in range(n_experts):
                    buf, crc = get_record(l, e)
                    if memoryview(buf).nbytes != rec.padded_bytes:
                        raise ValueError(f"{path}: layer {l} expert {e}: a packed record of "
                                         f"{memoryview(buf).nbytes} bytes, the layout's is {rec.padded_bytes}")
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


def _parse_header(name: str, raw: bytes, actual_bytes: int) -> ExpertsHeader:
    """Check the header against the layout this reader computes. raw: header_size(biases) bytes."""
    v = _unpack_fields(raw)
    biases = v["version"] == VERSION_BIASES
    try:
        qtype = QuantType(v["qtype"])
    except ValueError:
        raise FormatError(f"{name}: unknown quant type id {v['qtype']}") from None
    try:
        rec = RecordLayout(qtype, v["hidden"], v["expert_ffn"], biases)
    except ValueError as e:
        raise FormatError(f"{name}: bad header: {e}") from None
    if v["n_layers"] <= 0 or v["n_experts"] <= 0:
        raise FormatError(f"{name}: bad header: n_layers={v['n_layers']}, n_experts={v['n_experts']}")
    want = _unpack_fields(_pack_header(rec, v["n_layers"], v["n_experts"]))
    for key, expected in want.items():
        if v[key] != expected:
            raise FormatError(f"{name}: header field {key} is {v[key]}, expected {expected} for "
                              f"{qtype.name} D={rec.hidden} F={rec.expert_ffn}")
    if actual_bytes != v["file_bytes"]:
        what = "truncated" if actual_bytes < v["file_bytes"] else "trailing bytes"
        raise FormatError(f"{name}: {what}: {actual_bytes} bytes, header says {v['file_bytes']}")
    return ExpertsHeader(version=v["version"], qtype=qtype, n_layers=v["n_layers"], n_experts=v["n_experts"],
                         hidden=v["hidden"], expert_ffn=v["expert_ffn"], record_bytes=v["record_bytes"],
                         padded_bytes=v["padded_bytes"], table_offset=v["table_offset"],
                         data_offset=v["data_offset"], file_bytes=v["file_bytes"], biases=biases)


class ExpertsFile(OpenFile):
    """An open `.experts` file. Reads use pread on one descriptor, so they are thread-safe;
    the runtime may also pread `fileno()` itself at `record_offset(l, e)`."""

    def __init__(self, path: str, fd: int, header: ExpertsHeader, checksums: np.ndarray, identity: str) -> None:
        self.path = path
        self.header = header
        self.identity = identity  # identity_of(header bytes + checksum table): names this expert set
        self.layout = RecordLayout(header.qtype, header.hidden, header.expert_ffn, header.biases)
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
        version = HEADER_STRUCT.unpack(raw)[1]
        if version not in (VERSION, VERSION_BIASES):
            raise FormatError(f"{path}: unsupported .experts version {version} "
                              f"(this reader knows {VERSION} and {VERSION_BIASES})")
        head_bytes = header_size(version == VERSION_BIASES)
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

    def record_offset(self, layer: int, expert: int) -> int:
        """Byte offset of record (layer, expert): a multiple of 4096."""
        self._check_index(layer, expert)
        return self.header.data_offset + (layer * self.header.n_experts + expert) * self.header.padded_bytes

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
        return unpack_record(self.read_record(layer, expert, verify=verify), self.layout)

    def verify_all(self) -> None:
        """Read every record and check its checksum (FormatError at the first mismatch)."""
        buf = np.empty(self.header.padded_bytes, np.uint8)
        for l in range(self.header.n_layers):
            for e in range(self.header.n_experts):
                self.read_record(l, e, out=buf)

    def __repr__(self) -> str:
        h = self.header
        return (f"ExpertsFile({self.path!r}, {h.qtype.name}, {h.n_layers} layers x {h.n_experts} experts, "
                f"D={h.hidden}, F={h.expert_ffn}, {h.padded_bytes} bytes/record)")
