"""The n-gram row store (docs/formats.md, "The n-gram row store"): layout, row types, the
streaming writer, the reader's checks at open and on every read."""

from __future__ import annotations

import os
import struct

import numpy as np
import pytest

from strata.errors import FormatError
from strata.formats.ngram_row_types import ROW_TYPES, decode_rows, encode_rows
from strata.formats.ngram_rows_file import HEADER_SIZE, PAGE_ALIGN, NgramRowsFile, store_layout
from strata.formats.ngram_rows_writer import NgramRowsWriter, write_ngram_rows
from strata.formats.quant_types import QuantType
from strata.reference import quants

SHAPES = {2: (1000, 64), 5: (333, 32), 7: (40, 96)}


def _tables(seed: int = 0) -> dict[int, np.ndarray]:
    rng = np.random.default_rng(seed)
    return {l: rng.standard_normal(s).astype(np.float32) for l, s in SHAPES.items()}


def _shards(tables, size: int):
    """Each table in shards of `size` rows, the tables interleaved (as a sharded checkpoint)."""
    starts = {l: 0 for l in tables}
    while starts:
        for l in list(starts):
            a = starts[l]
            yield l, tables[l][a: a + size]
            starts[l] = a + size
            if starts[l] >= len(tables[l]):
                del starts[l]


def _stored(qtype: QuantType, x: np.ndarray) -> np.ndarray:
    """What strata's reference says a row type stores for x, as float32."""
    return quants.dequantize(quants.quantize(qtype, x))


@pytest.mark.parametrize("qtype", [QuantType.Q8_0, QuantType.Q4_0])
def test_quantized_rows_are_the_reference_quantizers_bytes(qtype):
    x = np.random.default_rng(1).standard_normal((50, 96)).astype(np.float32)
    raw = encode_rows(qtype, x)
    assert np.array_equal(raw.reshape(-1), quants.to_blocks(quants.quantize(qtype, x)).reshape(-1))
    assert np.array_equal(decode_rows(qtype, raw, 96), _stored(qtype, x))


@pytest.mark.parametrize("qtype", ROW_TYPES)
@pytest.mark.parametrize("shard", [1, 7, 5000])
def test_round_trip_in_shards(tmp_path, qtype, shard):
    tables = _tables()
    path = tmp_path / "m.ngrams"
    with write_ngram_rows(path, qtype=qtype, shapes=SHAPES, pieces=_shards(tables, shard)) as f:
        for l, t in tables.items():
            ids = np.random.default_rng(l).integers(0, len(t), (3, 11))
            assert np.array_equal(f.rows(l, ids), _stored(qtype, t)[ids])
            assert np.array_equal(f.rows(l, np.arange(len(t))), _stored(qtype, t))  # every row, the last page's too


def test_layout_and_file_size(tmp_path):
    tables = _tables()
    with write_ngram_rows(tmp_path / "m", qtype=QuantType.F16, shapes=SHAPES, pieces=_shards(tables, 100),
                          page_bytes=8192) as f:
        t2, t5, t7 = (f.tables[l] for l in (2, 5, 7))
        assert (t2.row_bytes, t2.rows_per_page, t2.n_pages, t2.first_page) == (128, 64, 16, 0)
        assert (t5.row_bytes, t5.rows_per_page, t5.n_pages, t5.first_page) == (64, 128, 3, 16)
        assert (t7.rows_per_page, t7.n_pages, t7.first_page) == (42, 1, 19)  # 8192 // 192: a tail of 128 bytes
        assert f.data_offset % PAGE_ALIGN == 0 and f.data_offset >= HEADER_SIZE + 3 * 40 + 4 * 20 + 4
        assert os.path.getsize(f.path) == f.data_offset + 20 * 8192
        # row 70 of layer 2: page 1, at byte (70 - 64) * 128
        raw = f.read_page(1)
        assert np.array_equal(raw[6 * 128: 7 * 128].view(np.float16), tables[2][70].astype(np.float16))
        assert not raw[64 * 128:].any()


def test_writer_refuses_what_it_cannot_store(tmp_path):
    path = tmp_path / "m"
    with pytest.raises(ValueError, match="Q8_0 rows must be a multiple of 32"):
        NgramRowsWriter(path, qtype=QuantType.Q8_0, shapes={0: (10, 48)})
    with pytest.raises(ValueError, match="cannot be stored as Q2_0"):
        NgramRowsWriter(path, qtype=QuantType.Q2_0, shapes={0: (10, 64)})
    with pytest.raises(ValueError, match=r"larger than a 4096-byte page \(give page_bytes >= 8192\)"):
        NgramRowsWriter(path, qtype=QuantType.F32, shapes={0: (10, 1025)})
    for bad, match in [((3, np.zeros((5, 64))), "no table declared for layer 3"),
                       ((0, np.zeros((5, 63))), r"rows must be \[n, 64\]"),
                       ((0, np.zeros((11, 64))), "11 rows given, the table has 10")]:
        with pytest.raises(ValueError, match=match), NgramRowsWriter(path, qtype=QuantType.F16, shapes={0: (10, 64)}) as w:
            w.write(*bad)
        assert not path.exists() and not os.path.exists(str(path) + ".tmp")


def test_an_incomplete_or_interrupted_write_leaves_nothing(tmp_path):
    path = tmp_path / "m"
    with pytest.raises(ValueError, match=r"tables not complete .rows written.: \{0: '4 of 10'\}"):
        with NgramRowsWriter(path, qtype=QuantType.F16, shapes={0: (10, 64), 1: (3, 64)}) as w:
            w.write(0, np.zeros((4, 64)))
            w.write(1, np.zeros((3, 64)))
    assert not path.exists() and not os.path.exists(str(path) + ".tmp")
    path.write_bytes(b"old")  # an older file under the name survives an interrupted write

    def pieces():
        yield 0, np.zeros((4, 64))
        raise KeyboardInterrupt

    with pytest.raises(KeyboardInterrupt):
        write_ngram_rows(path, qtype=QuantType.F16, shapes={0: (10, 64)}, pieces=pieces())
    assert path.read_bytes() == b"old" and not os.path.exists(str(path) + ".tmp")


@pytest.fixture
def store(tmp_path):
    path = tmp_path / "m.ngrams"
    write_ngram_rows(path, qtype=QuantType.Q8_0, shapes=SHAPES, pieces=_shards(_tables(), 64)).close()
    return path


def _flip(path, offset: int) -> None:
    with open(path, "r+b") as f:
        f.seek(offset)
        b = f.read(1)
        f.seek(offset)
        f.write(bytes([b[0] ^ 0x10]))


def test_a_corrupt_page_is_a_one_line_error_naming_layer_page_and_offset(store):
    with NgramRowsFile.open(store) as f:
        t = f.tables[5]
        where = f.page_offset(t.first_page + 1)
    _flip(store, where + 100)
    with NgramRowsFile.open(store) as f:  # open checks the header, not every page
        f.rows(5, np.arange(t.rows_per_page))  # page 0 is intact
        with pytest.raises(FormatError) as e:
            f.rows(5, np.array([t.rows_per_page + 3]))
        msg = str(e.value)
        assert "\n" not in msg and f"layer 5 page 1 (offset {where})" in msg and "checksum mismatch" in msg
        f.rows(5, np.array([t.rows_per_page + 3]), verify=False)  # the explicit knob lets it through


@pytest.mark.parametrize("what,match", [
    ("magic", "not a strata n-gram row store"),
    ("header", "header checksum mismatch"),
    ("directory", "header checksum mismatch"),
    ("truncated", "truncated: .* header says"),
    ("trailing", "trailing bytes"),
])
def test_open_refuses_a_damaged_file(store, what, match):
    size = os.path.getsize(store)
    if what == "magic":
        _flip(store, 0)
    elif what == "header":
        _flip(store, 24)  # page_bytes
    elif what == "directory":
        _flip(store, HEADER_SIZE + 8)  # the first table's rows
    elif what == "truncated":
        os.truncate(store, size - 1)
    else:
        with open(store, "ab") as f:
            f.write(b"\0")
    with pytest.raises(FormatError, match=match):
        NgramRowsFile.open(store)


def test_open_refuses_a_layout_it_did_not_compute(store):
    """A header whose checksum was recomputed over a wrong field is still refused: the reader
    recomputes the directory (here: a table's first page moved)."""
    from strata.formats.checksum import checksum

    with NgramRowsFile.open(store) as f:
        end = f.data_offset
    raw = bytearray(open(store, "rb").read(end))
    n_tables, n_pages = struct.unpack_from("<I", raw, 16)[0], struct.unpack_from("<Q", raw, 32)[0]
    struct.pack_into("<Q", raw, HEADER_SIZE + 40 + 24, 0)  # table 1's first_page
    crc_at = HEADER_SIZE + 40 * n_tables + 4 * n_pages
    struct.pack_into("<I", raw, crc_at, checksum(bytes(raw[:crc_at])))
    with open(store, "r+b") as f:
        f.write(bytes(raw))
    with pytest.raises(FormatError, match="disagrees with the layout this reader computes"):
        NgramRowsFile.open(store)


def test_identity_names_the_rows(tmp_path):
    tables = _tables()
    a = write_ngram_rows(tmp_path / "a", qtype=QuantType.F16, shapes=SHAPES, pieces=_shards(tables, 50))
    b = write_ngram_rows(tmp_path / "b", qtype=QuantType.F16, shapes=SHAPES, pieces=_shards(tables, 999))
    tables[7][3, 4] += 1.0
    c = write_ngram_rows(tmp_path / "c", qtype=QuantType.F16, shapes=SHAPES, pieces=_shards(tables, 50))
    assert a.identity == b.identity != c.identity and len(a.identity) == 32


def test_ids_out_of_range_and_unknown_layers_are_refused(store):
    with NgramRowsFile.open(store) as f:
        with pytest.raises(ValueError, match=r"layer 5: row id 333 out of range \[0, 333\)"):
            f.rows(5, np.array([0, 333]))
        with pytest.raises(ValueError, match="no table for layer 3"):
            f.rows(3, np.array([0]))


def test_store_layout_rejects_bad_pages():
    with pytest.raises(ValueError, match="multiple of 4096"):
        store_layout(QuantType.F16, 1000, {0: (10, 8)})
