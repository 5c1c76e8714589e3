"""The row cache's batched paths (strata.runtime.ngram_rows, strata.runtime.advised_reader): what
the per-page loops they replaced did, kept. A prefetch refuses what `locate` refuses; `rows` reuses
the prefetch's located ids only when asked for the same ids (a copy, not the caller's array); the
advised reader's plain path (no hook) finds a bad page by its CRC-32 and names it in one line, drops
every failed page of a batch, and reads them again once the disk is healed."""

from __future__ import annotations

import os

import numpy as np
import pytest

from strata.errors import RowReadError
from strata.formats.ngram_row_types import ROW_TYPES
from strata.formats.ngram_rows_writer import write_ngram_rows
from strata.formats.quant_types import QuantType
from strata.runtime.advised_reader import advice_available
from strata.runtime.ngram_rows import StreamedNgramRows

SHAPES = {1: (5000, 64), 3: (4001, 64), 4: (3000, 32)}  # F16: 32, 32 and 64 rows a page
READERS = ["threads", "advise"] if advice_available() else ["threads"]


def _store(tmp_path, qtype=QuantType.F16):
    rng = np.random.default_rng(0)
    tables = {l: rng.standard_normal(s).astype(np.float32) for l, s in SHAPES.items()}
    return write_ngram_rows(tmp_path / f"m.{qtype.name}", qtype=qtype, shapes=SHAPES,
                            pieces=((l, t) for l, t in tables.items()))


@pytest.mark.parametrize("reader", READERS)
def test_a_prefetch_refuses_what_locate_refuses(tmp_path, reader):
    with _store(tmp_path) as store, StreamedNgramRows(store, capacity=64, reader=reader) as rows:
        for bad in (np.array([[0, 5000]]), np.array([[-1, 3]])):
            with pytest.raises(ValueError, match="layer 1: row id .* out of range"):
                rows.prefetch({1: bad, 3: np.array([[0]])})
        with pytest.raises(ValueError, match="no table for layer 2"):
            rows.prefetch({1: np.array([[0]]), 2: np.array([[0]])})
        rows.prefetch({1: np.array([[7]])})  # the cache still works after a refused prefetch
        assert np.array_equal(rows.rows(1, np.array([[7]])), store.rows(1, np.array([[7]])))


@pytest.mark.parametrize("reader", READERS)
@pytest.mark.parametrize("qtype", ROW_TYPES)
def test_rows_reuse_the_prefetch_only_for_the_same_ids(tmp_path, reader, qtype):
    with _store(tmp_path, qtype) as store, StreamedNgramRows(store, capacity=200, reader=reader) as rows:
        ids = {1: np.array([[4, 900, 4999]]), 3: np.array([[0, 0, 4000]]), 4: np.array([[2999, 64, 65]])}
        rows.prefetch(ids)
        ids[1][0, 1] = 1234  # the caller's array changed after the prefetch: its new ids are read
        for l in sorted(ids):
            assert np.array_equal(rows.rows(l, ids[l]), store.rows(l, ids[l])), l
        rows.prefetch({3: np.array([[10, 20]])})
        other = np.array([[10, 2000], [3000, 20]])  # another shape and other ids than the prefetch's
        assert np.array_equal(rows.rows(3, other), store.rows(3, other))


def _corrupt(store, layer: int, local_page: int) -> bytes:
    """Overwrite a page's first bytes on disk; returns what was there."""
    offset = store.page_offset(store.tables[layer].first_page + local_page)
    fd = os.open(store.path, os.O_RDWR)
    try:
        was = os.pread(fd, 8, offset)
        os.pwrite(fd, bytes(b ^ 0xFF for b in was), offset)
        os.fsync(fd)
    finally:
        os.close(fd)
    return was


def _heal(store, layer: int, local_page: int, was: bytes) -> None:
    fd = os.open(store.path, os.O_RDWR)
    try:
        os.pwrite(fd, was, store.page_offset(store.tables[layer].first_page + local_page))
    finally:
        os.close(fd)


@pytest.mark.skipif(not advice_available(), reason="the advised reader needs posix_fadvise")
def test_the_plain_advised_path_names_a_bad_page_and_drops_every_failed_one(tmp_path):
    with _store(tmp_path) as store:
        rpp = store.tables[3].rows_per_page
        was = {p: _corrupt(store, 3, p) for p in (2, 5)}
        with StreamedNgramRows(store, capacity=100, reader="advise") as rows:
            assert rows.reader.hook is None and rows.reader.latency is None  # the batched path
            ids = np.array([[2 * rpp + 1, 3 * rpp, 5 * rpp + 7]])  # pages 2, 3 and 5 of layer 3
            rows.prefetch({3: ids, 1: np.array([[0]])})
            assert np.array_equal(rows.rows(1, np.array([[0]])), store.rows(1, np.array([[0]])))
            with pytest.raises(RowReadError) as e:
                rows.rows(3, ids)
            msg = str(e.value)
            assert "\n" not in msg and "checksum mismatch in layer 3 page 2" in msg
            assert f"offset {store.page_offset(store.tables[3].first_page + 2)}" in msg
            first = store.tables[3].first_page
            assert first + 3 in rows._slot_of and first + 2 not in rows._slot_of and first + 5 not in rows._slot_of
            for p, b in was.items():
                _heal(store, 3, p, b)
            since = rows.stats()
            assert np.array_equal(rows.rows(3, ids), store.rows(3, ids))  # both failed pages read again
            assert rows.stats().minus(since).layers[3].pages_read == 2
