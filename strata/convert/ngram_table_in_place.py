"""A llama.cpp `qwen4exp` GGUF's n-gram table read in place: the PLE row store over the user's file.

llama.cpp stores Qwen4-Exp's one n-gram table as a plain 2-D tensor, `per_layer_token_embd.weight`
[rows, width], in whatever type the file chose (Q8_0 and IQ4_NL in the released quants, F16, F32,
any other ggml type). Its row r is `row_bytes` bytes at `begin + r * row_bytes`: rows already sit
one after another as a row store's do, only without pages, padding or checksums. `GgufNgramTable`
is an `NgramRowsFile` (strata/formats/ngram_rows_file.py) over that tensor, so the row cache, its
readers and the resident path read it unchanged:

- a page is `rows_per_page` consecutive rows (as many whole rows as fit PAGE_BYTES), page g at
  `begin + g * page_bytes`. The last page may run past the table into the bytes after it (other
  tensors; never decoded); where that would run past the end of the file, the page is the
  largest divisor of the row count that fits instead, so every read is whole. A page starts
  wherever the tensor puts it (a GGUF aligns tensors to 32 bytes, not 4096): a page may touch one
  more disk block than a row store's, and O_DIRECT falls back to buffered reads (the reader says so);
- rows are dequantized by the reference's ggml dequantizers (strata.reference.ggml_quants, held
  bit for bit to the `gguf` package's), so they are what a conversion with F32 rows stores;
- verification is the experts' in place (strata/formats/expert_pieces.py): the file's structure
  is checked at open by ggml's loader's rules and `identity` names the file as it was then; the
  first read of each page keeps its CRC-32 and checks its rows finite, and every later read of
  that page must give the same CRC (a file changed under the run is caught where it is read).
  Nothing is written beside the file.
"""

from __future__ import annotations

import os
import threading

import numpy as np

from strata.errors import FormatError
from strata.formats.checksum import checksum
from strata.formats.ngram_rows_file import PAGE_BYTES, NgramRowsFile, TableInfo
from strata.formats.quant_types import QuantType, row_bytes
from strata.reference.ggml_quants import dequantize_rows

__all__ = ["GgufNgramTable", "table_pages"]

NOT_READ = -1  # a page's first-read CRC before its first read: equal to no CRC-32


def table_pages(rows: int, row_nbytes: int, begin: int, file_bytes: int) -> int:
    """Rows per page of a table of `rows` rows at `begin` in a file of `file_bytes` (module doc)."""
    fit = max(1, PAGE_BYTES // row_nbytes)
    n_pages = -(-rows // fit)
    if begin + n_pages * fit * row_nbytes <= file_bytes:
        return fit
    return max(d for d in range(1, min(fit, rows) + 1) if rows % d == 0)


class GgufNgramTable(NgramRowsFile):
    """One n-gram table of a GGUF as a row store (module doc): its rows keyed by `layer` (the PLE
    index), read from `path` where the tensor's bytes begin."""

    def __init__(self, path: str, fd: int, qtype: QuantType, page_bytes: int, begin: int, table: TableInfo,
                 identity: str, tensor: str) -> None:
        super().__init__(path, fd, qtype, page_bytes, begin, (table,), np.zeros(table.n_pages, np.uint32), identity)
        self.tensor = tensor
        self._first = np.full(table.n_pages, NOT_READ, np.int64)  # each page's first-read CRC-32
        self._lock = threading.Lock()
        self._stat = os.fstat(fd)

    @classmethod
    def open_table(cls, path: str | os.PathLike, tensor: str, ggml_type: int, begin: int, rows: int, width: int,
                   *, layer: int, identity: str) -> "GgufNgramTable":
        """The table `tensor` ([rows, width] of ggml type `ggml_type`, its bytes from file offset
        `begin`) of the GGUF at `path`, whose structure the caller has checked."""
        path = os.fspath(path)
        qtype = QuantType(ggml_type)
        try:
            rb = row_bytes(qtype, width)
        except ValueError as e:
            raise FormatError(f"{path}: tensor {tensor}: {e}") from None
        fd = os.open(path, os.O_RDONLY)
        try:
            rpp = table_pages(rows, rb, begin, os.fstat(fd).st_size)
            table = TableInfo(layer, width, rows, rb, rpp, 0, -(-rows // rpp))
            return cls(path, fd, qtype, rpp * rb, begin, table, identity, tensor)
        except BaseException:
            os.close(fd)
            raise

    # -------------------------------------------------------- verification

    def checksum(self, page: int) -> int:
        """The CRC-32 of the page's first read (NOT_READ before it)."""
        return int(self._first[page])

    def crcs_of(self, pages: np.ndarray) -> np.ndarray:
        """Each page's first-read CRC-32, NOT_READ for a page not read yet: never equal to a read's
        CRC, so a batch check sends a first read to `check_page`, which keeps it."""
        return self._first[pages]

    def check_page(self, page: int, buf: np.ndarray) -> None:
        """The read's verification (module doc): a first read is checked finite and its CRC-32
        kept; a later one must give that CRC. FormatError, one line naming the page, otherwise."""
        crc = checksum(buf[:self.page_bytes])
        first = int(self._first[page])
        if first == NOT_READ:
            self._check_finite(page, buf)
            with self._lock:
                if self._first[page] == NOT_READ:
                    self._first[page] = crc
                first = int(self._first[page])
        if crc != first:
            raise FormatError(f"{self.path}: {self.tensor} rows {self._rows_of(page)}: checksum mismatch: crc32 "
                              f"{crc:#010x}, their first read gave {first:#010x} ({self._changed()})")

    def _rows_of(self, page: int) -> str:
        t = self.tables[self._layer]
        lo = page * t.rows_per_page
        return f"[{lo}, {min(lo + t.rows_per_page, t.rows)})"

    @property
    def _layer(self) -> int:
        (layer,) = self.tables
        return layer

    def _check_finite(self, page: int, buf: np.ndarray) -> None:
        t = self.tables[self._layer]
        n = min(t.rows_per_page, t.rows - page * t.rows_per_page)  # the last page's bytes past the table: not rows
        values = self.decode_rows(np.asarray(buf[:n * t.row_bytes]).reshape(n, t.row_bytes), t.width)
        bad = int(np.count_nonzero(~np.isfinite(values)))
        if bad:
            raise FormatError(f"{self.path}: {self.tensor} rows {self._rows_of(page)}: {bad} non-finite values "
                              "(NaN or inf); the file is damaged")

    def _changed(self) -> str:
        """Why a read may differ, for messages: whether the file's size or mtime moved since open."""
        try:
            st = os.stat(self.path)
        except OSError as e:
            return f"{e.strerror} since it was opened"
        if st.st_size != self._stat.st_size:
            return f"the file changed since it was opened: size {self._stat.st_size} -> {st.st_size}"
        if st.st_mtime_ns != self._stat.st_mtime_ns:
            return "the file was written to since it was opened (its mtime moved)"
        return "the bytes changed with the file's size and mtime unchanged: a failing disk?"

    # -------------------------------------------------------- rows

    def decode_rows(self, raw: np.ndarray, width: int) -> np.ndarray:
        """The stored rows as float32, by the reference's ggml dequantizers (any ggml type).
        Shapes: uint8 [n, row_bytes] -> float32 [n, width]"""
        return dequantize_rows(self.qtype, raw, width)

    def __repr__(self) -> str:
        t = self.tables[self._layer]
        return (f"GgufNgramTable({self.path!r}, {self.tensor}, {self.qtype.name} [{t.rows}, {t.width}], pages of "
                f"{t.rows_per_page} rows, in place)")
