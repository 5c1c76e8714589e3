"""The n-gram row store: every PLE layer's n-gram embedding table, one record per row, rows
grouped into pages so one read fetches a page (docs/formats.md, "The n-gram row store", is
normative).

Layout (little-endian):

    [0, 72)                   fixed header (HEADER_FIELDS)
    [72, 72 + 40*n_tables)    table directory (TABLE_FIELDS), by layer ascending
    then                      checksum table: CRC-32 of every page's page_bytes bytes, N = n_pages
    then                      header CRC-32 over every byte before it
    zeros up to data_offset   (the next multiple of 4096)
    page g at data_offset + g * page_bytes; a table's pages are contiguous, from its first_page

Row r of a table is in page first_page + r // rows_per_page, at byte (r % rows_per_page) *
row_bytes; a page's tail after its last row is zero (and covered by its CRC). The reader
recomputes the directory from (qtype, page_bytes, layers, rows, widths) and refuses any field
that disagrees, so a writer and a reader that disagree about the layout fail at open.

The writer is strata.formats.ngram_rows_writer (it streams: a table never needs to be in memory).
"""

from __future__ import annotations

import hashlib
import os
import stat
import struct
from dataclasses import dataclass

import numpy as np

from strata.errors import FormatError
from strata.formats.checksum import checksum
from strata.formats.expert_record import align_up
from strata.formats.ngram_row_types import ROW_TYPES, check_row_type, decode_rows
from strata.formats.open_file import OpenFile
from strata.formats.quant_types import QuantType

__all__ = ["MAGIC", "PAGE_ALIGN", "PAGE_BYTES", "TableInfo", "NgramRowsFile", "store_layout", "pack_head",
           "geometry", "CRC"]

MAGIC = b"STRNGRM1"
VERSION = 1
PAGE_ALIGN = 4096  # a page starts on a disk block: one read, O_DIRECT-able, never two blocks for one page
PAGE_BYTES = 4096  # default page: one 4 KiB block (an SSD's random-read unit); 16 rows of a 128-wide f16 table

HEADER_FIELDS: tuple[tuple[str, str], ...] = (
    ("magic", "8s"),  # 0
    ("version", "I"),  # 8
    ("qtype", "I"),  # 12: QuantType of every row (ROW_TYPES)
    ("n_tables", "I"),  # 16
    ("page_align", "I"),  # 20: 4096
    ("page_bytes", "Q"),  # 24: page stride, a multiple of 4096
    ("n_pages", "Q"),  # 32: pages of all tables
    ("directory_offset", "Q"),  # 40: 72
    ("table_offset", "Q"),  # 48: the checksum table
    ("data_offset", "Q"),  # 56: page 0, a multiple of 4096
    ("file_bytes", "Q"),  # 64
)
HEADER_STRUCT = struct.Struct("<" + "".join(c for _, c in HEADER_FIELDS))
HEADER_SIZE = HEADER_STRUCT.size
TABLE_FIELDS: tuple[tuple[str, str], ...] = (
    ("layer", "I"),  # +0: the key rows are asked by (Qwen4-Exp: the PLE index)
    ("width", "I"),  # +4: values a row
    ("rows", "Q"),  # +8
    ("row_bytes", "I"),  # +16
    ("rows_per_page", "I"),  # +20: page_bytes // row_bytes
    ("first_page", "Q"),  # +24: global page index of row 0
    ("n_pages", "Q"),  # +32: ceil(rows / rows_per_page)
)
TABLE_STRUCT = struct.Struct("<" + "".join(c for _, c in TABLE_FIELDS))
CRC = struct.Struct("<I")
assert HEADER_SIZE == 72 and TABLE_STRUCT.size == 40
IDENTITY_BYTES = 16


@dataclass(frozen=True)
class TableInfo:
    """Where one layer's table lives in the store."""

    layer: int
    width: int
    rows: int
    row_bytes: int
    rows_per_page: int
    first_page: int
    n_pages: int


def store_layout(qtype: QuantType, page_bytes: int, shapes: dict[int, tuple[int, int]]) -> tuple[TableInfo, ...]:
    """Every table's place, by layer ascending. shapes: layer -> (rows, width). ValueError when
    a row does not fit a page or the page is not whole 4096-byte blocks."""
    if page_bytes <= 0 or page_bytes % PAGE_ALIGN:
        raise ValueError(f"page_bytes must be a positive multiple of {PAGE_ALIGN}, got {page_bytes}")
    out, first = [], 0
    for layer in sorted(shapes):
        rows, width = shapes[layer]
        rb = check_row_type(qtype, int(width))
        if rb > page_bytes:
            raise ValueError(f"layer {layer}: a {QuantType(qtype).name} row of {width} values is {rb} bytes, "
                             f"larger than a {page_bytes}-byte page (give page_bytes >= {align_up(rb, PAGE_ALIGN)})")
        if rows <= 0 or layer < 0:
            raise ValueError(f"layer {layer}: a table needs a layer >= 0 and rows > 0, got {rows} rows")
        rpp = page_bytes // rb
        n = -(-int(rows) // rpp)
        out.append(TableInfo(int(layer), int(width), int(rows), rb, rpp, first, n))
        first += n
    return tuple(out)


def geometry(n_tables: int, n_pages: int, page_bytes: int) -> tuple[int, int, int]:
    """(table_offset, data_offset, file_bytes)."""
    table_offset = HEADER_SIZE + TABLE_STRUCT.size * n_tables
    data_offset = align_up(table_offset + CRC.size * n_pages + CRC.size, PAGE_ALIGN)
    return table_offset, data_offset, data_offset + n_pages * page_bytes


def pack_head(qtype: QuantType, page_bytes: int, tables: tuple[TableInfo, ...]) -> bytes:
    n_pages = sum(t.n_pages for t in tables)
    table_offset, data_offset, file_bytes = geometry(len(tables), n_pages, page_bytes)
    head = HEADER_STRUCT.pack(MAGIC, VERSION, int(qtype), len(tables), PAGE_ALIGN, page_bytes, n_pages,
                              HEADER_SIZE, table_offset, data_offset, file_bytes)
    return head + b"".join(TABLE_STRUCT.pack(t.layer, t.width, t.rows, t.row_bytes, t.rows_per_page,
                                             t.first_page, t.n_pages) for t in tables)


# ---------------------------------------------------------------- reader


class NgramRowsFile(OpenFile):
    """An open row store. Reads are preads on one descriptor (thread-safe); every read is
    checked against its page's CRC-32 unless `verify=False`. Also an `NgramRows` source itself
    (`rows`: a read per page, no cache)."""

    def __init__(self, path: str, fd: int, qtype: QuantType, page_bytes: int, data_offset: int,
                 tables: tuple[TableInfo, ...], crcs: np.ndarray, identity: str) -> None:
        self.path, self.qtype, self.page_bytes, self.data_offset = path, qtype, page_bytes, data_offset
        self.tables = {t.layer: t for t in tables}
        self.n_pages = len(crcs)
        self.identity = identity
        self._fd, self._crcs = fd, crcs
        self._page_table = np.empty(self.n_pages, np.int64)  # global page -> its table's layer
        for t in tables:
            self._page_table[t.first_page: t.first_page + t.n_pages] = t.layer

    @classmethod
    def open(cls, path: str | os.PathLike) -> "NgramRowsFile":
        path = os.fspath(path)
        try:
            fd = os.open(path, os.O_RDONLY | getattr(os, "O_NONBLOCK", 0))  # a FIFO must not block the open
        except OSError as e:
            raise FormatError(f"{path}: cannot open: {e.strerror}") from None
        try:
            return cls(path, fd, *cls._validate(path, fd))
        except BaseException:
            os.close(fd)
            raise

    @staticmethod
    def _validate(path: str, fd: int):
        st = os.fstat(fd)
        if not stat.S_ISREG(st.st_mode):
            raise FormatError(f"{path}: not a regular file (a row store must be a file on disk)")
        os.set_blocking(fd, True)
        raw = os.pread(fd, HEADER_SIZE, 0)
        if raw[: len(MAGIC)] != MAGIC:
            raise FormatError(f"{path}: not a strata n-gram row store (magic {raw[:len(MAGIC)]!r}, expected {MAGIC!r})")
        if len(raw) < HEADER_SIZE:
            raise FormatError(f"{path}: truncated: {st.st_size} bytes, shorter than the {HEADER_SIZE}-byte header")
        v = dict(zip((n for n, _ in HEADER_FIELDS), HEADER_STRUCT.unpack(raw)))
        if v["version"] != VERSION:
            raise FormatError(f"{path}: unsupported row store version {v['version']} (this reader knows {VERSION})")
        table_offset, _, _ = geometry(v["n_tables"], v["n_pages"], 0)
        end = table_offset + CRC.size * v["n_pages"] + CRC.size
        if end > st.st_size:
            raise FormatError(f"{path}: truncated or corrupt header: {st.st_size} bytes, the directory and "
                              f"checksums of {v['n_pages']} pages end at {end}")
        rest = os.pread(fd, end - HEADER_SIZE, HEADER_SIZE)
        head = raw + rest[: -CRC.size]
        if checksum(head) != CRC.unpack(rest[-CRC.size:])[0]:
            raise FormatError(f"{path}: header checksum mismatch (header, directory or checksum table corrupt)")
        try:
            qtype = QuantType(v["qtype"])
            if qtype not in ROW_TYPES:
                raise ValueError(f"row type {qtype.name} is not one of {[t.name for t in ROW_TYPES]}")
            entries = [dict(zip((n for n, _ in TABLE_FIELDS), TABLE_STRUCT.unpack_from(head, HEADER_SIZE + i * TABLE_STRUCT.size)))
                       for i in range(v["n_tables"])]
            shapes = {e["layer"]: (e["rows"], e["width"]) for e in entries}
            if len(shapes) != len(entries):
                raise ValueError("two tables for one layer")
            tables = store_layout(qtype, v["page_bytes"], shapes)
        except ValueError as e:
            raise FormatError(f"{path}: bad header: {e}") from None
        want = pack_head(qtype, v["page_bytes"], tables)
        if want != head[: len(want)]:
            at = next(i for i, (a, b) in enumerate(zip(want, head)) if a != b)
            raise FormatError(f"{path}: header byte {at} disagrees with the layout this reader computes for "
                              f"{qtype.name} rows in {v['page_bytes']}-byte pages")
        file_bytes = v["file_bytes"]
        if st.st_size != file_bytes:
            what = "truncated" if st.st_size < file_bytes else "trailing bytes"
            raise FormatError(f"{path}: {what}: {st.st_size} bytes, header says {file_bytes}")
        crcs = np.frombuffer(head[table_offset:], "<u4")
        identity = hashlib.sha256(head).hexdigest()[: 2 * IDENTITY_BYTES]
        return qtype, v["page_bytes"], v["data_offset"], tables, crcs, identity

    # -------------------------------------------------------- pages

    def page_offset(self, page: int) -> int:
        """Byte offset of global page `page` (a multiple of 4096)."""
        if not 0 <= page < self.n_pages:
            raise ValueError(f"{self.path}: no page {page} (the store has {self.n_pages})")
        return self.data_offset + page * self.page_bytes

    def checksum(self, page: int) -> int:
        return int(self._crcs[page])

    def crcs_of(self, pages: np.ndarray) -> np.ndarray:
        """The stored CRC-32 of each page. Shapes: int [n] -> uint32 [n]"""
        return self._crcs[pages]

    def where(self, page: int) -> tuple[int, int]:
        """(layer, page within its table) of a global page: how errors name it."""
        layer = int(self._page_table[page])
        return layer, page - self.tables[layer].first_page

    def check_page(self, page: int, buf: np.ndarray) -> None:
        """FormatError, one line naming layer, page and offset, when buf is not the page's bytes."""
        actual, stored = checksum(buf), self.checksum(page)
        if actual != stored:
            layer, local = self.where(page)
            raise FormatError(f"{self.path}: checksum mismatch in layer {layer} page {local} (offset "
                              f"{self.page_offset(page)}): crc32 {actual:#010x}, header says {stored:#010x}")

    def read_page(self, page: int, *, verify: bool = True, out: np.ndarray | None = None) -> np.ndarray:
        """One page with one pread (into `out` if given). Shapes: -> uint8 [page_bytes]"""
        offset = self.page_offset(page)
        out = np.empty(self.page_bytes, np.uint8) if out is None else out[: self.page_bytes]
        got = os.preadv(self.fileno(), [memoryview(out)], offset)
        if got != self.page_bytes:
            layer, local = self.where(page)
            raise FormatError(f"{self.path}: short read of layer {layer} page {local} at offset {offset}: "
                              f"{got} of {self.page_bytes} bytes")
        if verify:
            self.check_page(page, out)
        return out

    def locate(self, layer: int, row_ids: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
        """(global page, row within the page) of each id. Shapes: [n] int64 -> [n], [n]"""
        t = self.tables.get(layer)
        if t is None:
            raise ValueError(f"{self.path}: no table for layer {layer} (tables: {sorted(self.tables)})")
        ids = np.asarray(row_ids, dtype=np.int64).reshape(-1)
        if ids.size and (ids.min() < 0 or ids.max() >= t.rows):
            bad = ids[(ids < 0) | (ids >= t.rows)][0]
            raise ValueError(f"{self.path}: layer {layer}: row id {bad} out of range [0, {t.rows})")
        page, within = np.divmod(ids, t.rows_per_page)
        return page + t.first_page, within

    def decode(self, layer: int, pages: np.ndarray, which: np.ndarray, within: np.ndarray) -> np.ndarray:
        """Rows picked out of page buffers and decoded: row i is row within[i] of pages[which[i]].
        Shapes: pages uint8 [P, page_bytes], which [n], within [n] -> float32 [n, width]"""
        t = self.tables[layer]
        if len(which) == 0:
            return np.zeros((0, t.width), np.float32)
        assert pages.dtype == np.uint8 and pages.strides[1] == 1
        by_row = np.lib.stride_tricks.as_strided(  # [P, rows_per_page, row_bytes], a view: no copy
            pages, shape=(pages.shape[0], t.rows_per_page, t.row_bytes), strides=(pages.strides[0], t.row_bytes, 1),
            writeable=False)
        return self.decode_rows(by_row[which, within], t.width)

    def decode_rows(self, raw: np.ndarray, width: int) -> np.ndarray:
        """Stored rows of this store's row type as float32 (`decode_rows` of ngram_row_types).
        Shapes: uint8 [n, row_bytes] -> float32 [n, width]"""
        return decode_rows(self.qtype, raw, width)

    def rows(self, layer: int, row_ids: np.ndarray, *, verify: bool = True) -> np.ndarray:
        """The rows, read page by page (no cache). Shapes: row_ids int [*S] -> float32 [*S, width]"""
        ids = np.asarray(row_ids, dtype=np.int64)
        pages, within = self.locate(layer, ids)
        uniq, inverse = np.unique(pages, return_inverse=True)
        bufs = np.stack([self.read_page(int(p), verify=verify) for p in uniq]) if len(uniq) else \
            np.zeros((0, self.page_bytes), np.uint8)
        return self.decode(layer, bufs, inverse.reshape(-1), within).reshape(*ids.shape, self.tables[layer].width)

    def __repr__(self) -> str:
        return (f"NgramRowsFile({self.path!r}, {self.qtype.name}, {len(self.tables)} tables, {self.n_pages} pages "
                f"of {self.page_bytes} bytes)")
