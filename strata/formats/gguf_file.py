"""The GGUF container, read and checked before a byte of tensor data is trusted.

The `gguf` package's reader (which strata used before) takes a file's offsets and types as
given: a tensor whose type was changed without its bytes, overlapping or unaligned offsets, a
changed `general.alignment` or an offset of 2^64 - 1 gave wrong weights or NaN, a named pipe
blocked forever and a 4M-element metadata array took over a minute (it parses each element in
Python). This reader holds a file to the rules of ggml's own loader (`gguf.cpp`):

- the file is a regular file (checked on a descriptor opened with O_NONBLOCK: a FIFO never blocks);
- magic `GGUF`, version 2 or 3, little-endian;
- counts, string lengths and array lengths fit in the bytes that are left (so a count of 2^64 - 1
  is refused before anything is allocated), keys and tensor names are unique and UTF-8;
- arrays hold scalars or strings (arrays of arrays are refused); a scalar array is one
  `numpy.frombuffer`, never a Python loop;
- `general.alignment`, if present, is a u32 power of two;
- each tensor has 1..4 dims, a known ggml type, a row length that is a whole number of blocks,
  and an element count with no overflow; its offset is exactly where the previous tensor's
  bytes, padded to the alignment, end (ggml's rule: no gaps, no overlaps, no reordering), and
  the data section ends at the end of the file (up to the last tensor's padding).

Every failure is a one-line `FormatError` naming the file and, where there is one, the key or
tensor.
"""

from __future__ import annotations

import mmap
import os
import stat
import struct
from dataclasses import dataclass
from typing import Any

import numpy as np

from strata.errors import FormatError

MAGIC = b"GGUF"
VERSIONS = (2, 3)
DEFAULT_ALIGNMENT = 32
KEY_ALIGNMENT = "general.alignment"
MAX_DIMS = 4  # GGML_MAX_DIMS
MAX_NAME_BYTES = 63  # GGML_MAX_NAME - 1

# GGUF value types (the spec's numbering; gguf.GGUFValueType has the same values)
UINT8, INT8, UINT16, INT16, UINT32, INT32, FLOAT32, BOOL, STRING, ARRAY, UINT64, INT64, FLOAT64 = range(13)
VALUE_TYPE_NAMES = ("UINT8", "INT8", "UINT16", "INT16", "UINT32", "INT32", "FLOAT32", "BOOL", "STRING",
                    "ARRAY", "UINT64", "INT64", "FLOAT64")
_SCALARS: dict[int, np.dtype] = {
    UINT8: np.dtype("<u1"), INT8: np.dtype("<i1"), UINT16: np.dtype("<u2"), INT16: np.dtype("<i2"),
    UINT32: np.dtype("<u4"), INT32: np.dtype("<i4"), FLOAT32: np.dtype("<f4"), BOOL: np.dtype("<u1"),
    UINT64: np.dtype("<u8"), INT64: np.dtype("<i8"), FLOAT64: np.dtype("<f8"),
}
RELEASE_CHUNK = 16 << 20  # bytes checksummed between releases of the mapped pages
_MIN_KV_BYTES = 8 + 4 + 1  # an empty key, a type, a one-byte value
_MIN_TENSOR_INFO_BYTES = 8 + 4 + 8 + 4 + 8  # an empty name, n_dims, one dim, type, offset


@dataclass(frozen=True)
class Field:
    """One metadata value: `type` a GGUF value type; `item_type` the element type of an ARRAY."""

    type: int
    value: Any
    item_type: int | None = None
    offset: int = 0  # where the value's bytes start in the file (a scalar's are patched in place)

    @property
    def type_name(self) -> str:
        name = VALUE_TYPE_NAMES[self.type]
        return f"{name}[{VALUE_TYPE_NAMES[self.item_type]}]" if self.item_type is not None else name


@dataclass(frozen=True)
class TensorInfo:
    """Shapes: dims are GGUF order (innermost first); shape is numpy order (their reverse)."""

    name: str
    dims: tuple[int, ...]
    ggml_type: int
    offset: int  # from the data section's start
    nbytes: int

    @property
    def shape(self) -> tuple[int, ...]:
        return tuple(reversed(self.dims))


class GGUFFile:
    """An open, checked GGUF file: metadata `fields`, `tensors` (in file order), raw tensor views."""

    def __init__(self, path: str, mm: mmap.mmap, version: int, fields: dict[str, Field],
                 tensors: dict[str, TensorInfo], alignment: int, data_offset: int) -> None:
        self.path, self.version, self.fields, self.tensors = path, version, fields, tensors
        self.alignment, self.data_offset = alignment, data_offset
        self._mm = mm

    def raw(self, info: TensorInfo) -> np.ndarray:
        """A read-only view of a tensor's bytes, shaped as `gguf.quants.dequantize` wants them:
        the element dtype and numpy shape for float/int types, else uint8 rows of blocks."""
        import gguf

        gtype = gguf.GGMLQuantizationType(info.ggml_type)
        start = self.data_offset + info.offset
        buf = np.frombuffer(self._mm, np.uint8, info.nbytes, start)
        dtypes = {gguf.GGMLQuantizationType.F32: np.float32, gguf.GGMLQuantizationType.F16: np.float16,
                  gguf.GGMLQuantizationType.F64: np.float64, gguf.GGMLQuantizationType.I8: np.int8,
                  gguf.GGMLQuantizationType.I16: np.int16, gguf.GGMLQuantizationType.I32: np.int32,
                  gguf.GGMLQuantizationType.I64: np.int64}
        if gtype in dtypes:
            return buf.view(dtypes[gtype]).reshape(info.shape)
        return buf.reshape(gguf.quants.quant_shape_to_byte_shape(info.shape, gtype))

    def location(self, info: TensorInfo) -> tuple[str, int]:
        """(the file that holds a tensor, the file offset of its first byte): where a reader
        `pread`s it without the map (experts read in place, strata/convert/gguf_in_place.py)."""
        return self.path, self.data_offset + info.offset

    @property
    def files(self) -> tuple[tuple[str, int], ...]:
        """(path, bytes before the tensor data: the header and tensor index) of each file read."""
        return ((self.path, self.data_offset),)

    def crc32_without(self, start: int, n: int) -> int:
        """CRC-32 of the whole file with bytes [start, start + n) read as zeros (a checksum stored
        inside the file it covers)."""
        from strata.formats.checksum import checksum_update

        with memoryview(self._mm) as mv:
            crc = checksum_update(mv[:start], 0)
            crc = checksum_update(bytes(n), crc)
            for at in range(start + n, len(mv), RELEASE_CHUNK):  # in chunks, each let go once read
                crc = checksum_update(mv[at:at + RELEASE_CHUNK], crc)
                self.release(at, RELEASE_CHUNK)
            self.release(0, start + n)
            return crc

    def release(self, start: int, n: int) -> None:
        """Let go of the mapped pages of bytes [start, start + n) (they stay in the page cache):
        a model's dense tensors are copied out once, and counting the file's pages in the
        process's resident set as well held a Q8_0 model's load peak at twice its stored size."""
        page = mmap.PAGESIZE
        lo = start - start % page
        hi = min(len(self._mm), start + n)
        if hi > lo and hasattr(self._mm, "madvise") and hasattr(mmap, "MADV_DONTNEED"):
            self._mm.madvise(mmap.MADV_DONTNEED, lo, hi - lo)

    def close(self) -> None:
        try:
            self._mm.close()
        except BufferError:  # a caller still holds a view; the map goes with the last one
            pass


def open_gguf(path: str | os.PathLike) -> GGUFFile:
    """Open and check `path` (module doc); a FormatError names what is wrong."""
    path = os.fspath(path)
    try:
        fd = os.open(path, os.O_RDONLY | getattr(os, "O_NONBLOCK", 0))
    except OSError as e:
        raise FormatError(f"{path}: cannot open: {e.strerror}") from None
    try:
        st = os.fstat(fd)
        if not stat.S_ISREG(st.st_mode):
            raise FormatError(f"{path}: not a regular file (a model file must be a GGUF file on disk)")
        if st.st_size < 24:
            raise FormatError(f"{path}: not a GGUF file ({st.st_size} bytes)")
        try:
            mm = mmap.mmap(fd, 0, access=mmap.ACCESS_READ)
        except (OSError, ValueError) as e:
            raise FormatError(f"{path}: cannot map: {e}") from None
    finally:
        os.close(fd)
    try:
        return _Parser(path, mm).parse()
    except BaseException:
        mm.close()
        raise


class _Parser:
    def __init__(self, path: str, mm: mmap.mmap) -> None:
        self.path, self.mm, self.size, self.pos = path, mm, len(mm), 0

    def fail(self, what: str) -> FormatError:
        return FormatError(f"{self.path}: {what}")

    def take(self, n: int, what: str) -> int:
        """Advance over n bytes; return where they start."""
        if n < 0 or n > self.size - self.pos:
            raise self.fail(f"truncated or corrupt GGUF: {what} needs {n} bytes at offset {self.pos}, "
                            f"the file has {self.size}")
        start, self.pos = self.pos, self.pos + n
        return start

    def scalar(self, fmt: str, what: str):
        return struct.unpack_from("<" + fmt, self.mm, self.take(struct.calcsize(fmt), what))[0]

    def string(self, what: str) -> str:
        n = self.scalar("Q", what)
        start = self.take(n, what)
        try:
            return self.mm[start:start + n].decode("utf-8")
        except UnicodeDecodeError:
            raise self.fail(f"{what} is not UTF-8") from None

    def value(self, vtype: int, key: str) -> Field:
        if vtype in _SCALARS:
            dt = _SCALARS[vtype]
            at = self.take(dt.itemsize, f"metadata key {key}")
            v = np.frombuffer(self.mm, dt, 1, at)[0]
            return Field(vtype, bool(v) if vtype == BOOL else v.item(), offset=at)
        if vtype == STRING:
            return Field(vtype, self.string(f"metadata key {key}"))
        if vtype == ARRAY:
            itype = self.scalar("I", f"metadata key {key}")
            count = self.scalar("Q", f"metadata key {key}")
            if itype in _SCALARS:
                dt = _SCALARS[itype]
                if count > (self.size - self.pos) // dt.itemsize:
                    raise self.fail(f"metadata key {key}: array of {count} items runs past the end of the file")
                items = np.frombuffer(self.mm, dt, count, self.take(count * dt.itemsize, f"metadata key {key}"))
                values = items.astype(bool).tolist() if itype == BOOL else items.tolist()
                return Field(vtype, values, itype)
            if itype == STRING:
                if count > (self.size - self.pos) // 8:
                    raise self.fail(f"metadata key {key}: array of {count} strings runs past the end of the file")
                what = f"metadata key {key}"
                return Field(vtype, [self.string(what) for _ in range(count)], itype)
            if itype == ARRAY:
                raise self.fail(f"metadata key {key}: arrays of arrays are not supported")
            raise self.fail(f"metadata key {key}: unknown array item type {itype}")
        raise self.fail(f"metadata key {key}: unknown value type {vtype}")

    def parse(self) -> GGUFFile:
        import gguf

        if self.mm[:4] != MAGIC:
            raise self.fail(f"not a GGUF file (magic {self.mm[:4]!r})")
        self.pos = 4
        version = self.scalar("I", "the version")
        if version not in VERSIONS:
            endian = " (big-endian?)" if version and not version & 0xFFFF else ""
            raise self.fail(f"unsupported GGUF version {version}{endian}; this reader knows 2 and 3")
        n_tensors, n_kv = self.scalar("Q", "the tensor count"), self.scalar("Q", "the metadata count")
        left = self.size - self.pos
        if n_kv > left // _MIN_KV_BYTES or n_tensors > left // _MIN_TENSOR_INFO_BYTES:
            raise self.fail(f"corrupt GGUF header: {n_kv} metadata keys and {n_tensors} tensors "
                            f"cannot fit in {self.size} bytes")
        fields: dict[str, Field] = {}
        for _ in range(n_kv):
            key = self.string("a metadata key")
            vtype = self.scalar("I", f"metadata key {key}")
            if key in fields:
                raise self.fail(f"duplicate metadata key {key}")
            fields[key] = self.value(vtype, key)
        infos = [self.tensor_info(gguf) for _ in range(n_tensors)]
        alignment = DEFAULT_ALIGNMENT
        if KEY_ALIGNMENT in fields:
            f = fields[KEY_ALIGNMENT]
            if f.type != UINT32 or f.value <= 0 or f.value & (f.value - 1):
                raise self.fail(f"{KEY_ALIGNMENT} must be a u32 power of two, got {f.type_name} {f.value!r}")
            alignment = f.value
        data_offset = -(-self.pos // alignment) * alignment
        tensors: dict[str, TensorInfo] = {}
        end = 0  # where the next tensor must start, relative to data_offset
        for t in infos:
            if t.name in tensors:
                raise self.fail(f"duplicate tensor {t.name}")
            if t.offset % alignment:
                raise self.fail(f"tensor {t.name}: offset {t.offset} is not a multiple of the alignment {alignment}")
            if t.offset != end:
                prev = f"the previous tensor ends at {end}" if tensors else "the first tensor starts at 0"
                raise self.fail(f"tensor {t.name}: offset {t.offset}, expected {end} ({prev}, padded to "
                                f"{alignment}; overlapping, out-of-order or resized tensors)")
            tensors[t.name] = t
            last_end, end = end + t.nbytes, -(-(end + t.nbytes) // alignment) * alignment
        if infos:
            actual = self.size - data_offset
            if not last_end <= actual <= end:
                name = infos[-1].name
                what = "truncated or corrupt GGUF" if actual < last_end else "trailing bytes after the tensors"
                raise self.fail(f"{what}: the tensors (the last is {name}) end at {data_offset + last_end}, "
                                f"the file has {self.size} bytes")
        return GGUFFile(self.path, self.mm, version, fields, tensors, alignment, data_offset)

    def tensor_info(self, gguf) -> TensorInfo:
        name = self.string("a tensor name")
        if len(name.encode()) > MAX_NAME_BYTES:
            raise self.fail(f"tensor {name[:40]}...: name longer than {MAX_NAME_BYTES} bytes")
        n_dims = self.scalar("I", f"tensor {name}")
        if not 1 <= n_dims <= MAX_DIMS:
            raise self.fail(f"tensor {name}: {n_dims} dimensions (1 to {MAX_DIMS} allowed)")
        dims = struct.unpack_from(f"<{n_dims}Q", self.mm, self.take(8 * n_dims, f"tensor {name}"))
        gtype = self.scalar("I", f"tensor {name}")
        offset = self.scalar("Q", f"tensor {name}")
        try:
            block, type_bytes = gguf.GGML_QUANT_SIZES[gguf.GGMLQuantizationType(gtype)]
        except (ValueError, KeyError):
            raise self.fail(f"tensor {name}: unknown ggml type {gtype}") from None
        n = 1
        for d in dims:
            n *= d
        if n == 0 or n >= 2**63:
            raise self.fail(f"tensor {name}: dims {list(dims)} give {n} elements")
        if dims[0] % block:
            raise self.fail(f"tensor {name}: row of {dims[0]} is not a whole number of "
                            f"{gguf.GGMLQuantizationType(gtype).name} blocks of {block}")
        nbytes = n // block * type_bytes
        if nbytes > self.size:
            raise self.fail(f"truncated or corrupt GGUF: tensor {name}: {gguf.GGMLQuantizationType(gtype).name} "
                            f"{list(dims)} is {nbytes} bytes, more than the file's {self.size}")
        return TensorInfo(name, tuple(int(d) for d in dims), gtype, offset, nbytes)
