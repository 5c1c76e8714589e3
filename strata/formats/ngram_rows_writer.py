"""The n-gram row store's writer: tables in, streamed, a row store out (the format:
strata.formats.ngram_rows_file, docs/formats.md).

Tables arrive as (layer, rows) pieces, each table's pieces in row order (the shards of a
checkpoint), tables interleaved in any order; no more than one piece and one partial page per
table is in memory. Written to `<path>.tmp` and renamed into place when complete
(strata.formats.atomic): an interrupted write leaves nothing under `path`.
"""

from __future__ import annotations

import contextlib
import os
import sys

import numpy as np

from strata.formats.atomic import atomic_output
from strata.formats.checksum import checksum
from strata.formats.ngram_row_types import encode_rows
from strata.formats.ngram_rows_file import CRC, PAGE_BYTES, NgramRowsFile, TableInfo, geometry, pack_head, store_layout
from strata.formats.quant_types import QuantType

__all__ = ["NgramRowsWriter", "write_ngram_rows"]


class NgramRowsWriter:
    """Streams tables into a row store: `write(layer, rows)` appends the next rows of a table.

    shapes: layer -> (rows, width), declared up front (the layout depends on them). Use as a
    context manager: a clean exit checks every table is complete, writes the header and renames
    the file into place; an exception leaves nothing under `path`.
    """

    def __init__(self, path: str | os.PathLike, *, qtype: QuantType, shapes: dict[int, tuple[int, int]],
                 page_bytes: int = PAGE_BYTES) -> None:
        self.path, self.qtype, self.page_bytes = os.fspath(path), QuantType(qtype), page_bytes
        self.tables = {t.layer: t for t in store_layout(self.qtype, page_bytes, shapes)}
        self._head = pack_head(self.qtype, page_bytes, tuple(self.tables.values()))
        n_pages = sum(t.n_pages for t in self.tables.values())
        _, self._data_offset, self.file_bytes = geometry(len(self.tables), n_pages, page_bytes)
        self._crcs = np.zeros(n_pages, "<u4")
        self._written = dict.fromkeys(self.tables, 0)  # rows of each table received so far
        self._partial: dict[int, np.ndarray] = {}  # layer -> uint8 [k, row_bytes], k < rows_per_page
        self._stack = contextlib.ExitStack()
        self._fd = -1

    def __enter__(self) -> "NgramRowsWriter":
        tmp = self._stack.enter_context(atomic_output(self.path))
        self._fd = os.open(tmp, os.O_WRONLY | os.O_CREAT | os.O_TRUNC, 0o644)
        self._stack.callback(os.close, self._fd)
        os.ftruncate(self._fd, self.file_bytes)  # sparse until written; zero tails need no writes
        return self

    def write(self, layer: int, rows: np.ndarray) -> None:
        """The next rows of `layer`'s table. Shapes: rows [n, width] (any float dtype)"""
        t = self.tables.get(layer)
        if t is None:
            raise ValueError(f"{self.path}: no table declared for layer {layer} (declared: {sorted(self.tables)})")
        rows = np.asarray(rows)
        if rows.ndim != 2 or rows.shape[1] != t.width:
            raise ValueError(f"{self.path}: layer {layer}: rows must be [n, {t.width}], got {rows.shape}")
        if self._written[layer] + len(rows) > t.rows:
            raise ValueError(f"{self.path}: layer {layer}: {self._written[layer] + len(rows)} rows given, "
                             f"the table has {t.rows}")
        raw = encode_rows(self.qtype, rows)
        start = self._written[layer]
        self._written[layer] = start + len(rows)
        held = self._partial.pop(layer, None)
        if held is not None:
            raw = np.concatenate([held, raw])
            start -= len(held)
        whole = len(raw) // t.rows_per_page * t.rows_per_page
        if self._written[layer] == t.rows:
            whole = len(raw)  # the table's last page: its tail stays zero
        elif whole < len(raw):
            self._partial[layer] = raw[whole:].copy()
        if whole:
            self._put_pages(t, start // t.rows_per_page, raw[:whole])

    def _put_pages(self, t: TableInfo, page: int, raw: np.ndarray) -> None:
        """Whole pages (the last one maybe short) from `page` of table t. raw: uint8 [n, row_bytes]"""
        n_pages = -(-len(raw) // t.rows_per_page)
        used = np.zeros((n_pages * t.rows_per_page, t.row_bytes), np.uint8)  # [P * rows_per_page, row_bytes]
        used[: len(raw)] = raw
        pages = np.zeros((n_pages, self.page_bytes), np.uint8)  # [P, page_bytes]: the tail after the rows zero
        pages[:, : t.rows_per_page * t.row_bytes] = used.reshape(n_pages, -1)
        g = t.first_page + page
        for i in range(n_pages):
            self._crcs[g + i] = checksum(pages[i])
        _pwrite_all(self._fd, pages, self._data_offset + g * self.page_bytes)

    def __exit__(self, exc_type, exc, tb) -> None:
        if exc_type is None:
            try:
                short = {l: f"{self._written[l]} of {t.rows}" for l, t in self.tables.items() if self._written[l] != t.rows}
                if short:
                    raise ValueError(f"{self.path}: tables not complete (rows written): {short}")
                head = self._head + self._crcs.tobytes()
                _pwrite_all(self._fd, head + CRC.pack(checksum(head)), 0)
                os.fsync(self._fd)
            except BaseException:
                self._stack.__exit__(*sys.exc_info())
                raise
        self._stack.__exit__(exc_type, exc, tb)


def _pwrite_all(fd: int, data, offset: int) -> None:
    """pwrite until every byte is down (Linux writes at most ~2 GiB a call)."""
    view = memoryview(data).cast("B")
    while view:
        n = os.pwrite(fd, view, offset)
        view, offset = view[n:], offset + n


def write_ngram_rows(path: str | os.PathLike, *, qtype: QuantType, shapes: dict[int, tuple[int, int]],
                     pieces, page_bytes: int = PAGE_BYTES) -> "NgramRowsFile":
    """Write a row store from (layer, rows) pieces (each table's in row order) and open it."""
    with NgramRowsWriter(path, qtype=qtype, shapes=shapes, page_bytes=page_bytes) as w:
        for layer, rows in pieces:
            w.write(layer, rows)
    return NgramRowsFile.open(path)
