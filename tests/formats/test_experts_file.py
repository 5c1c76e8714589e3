"""The `.experts` file and its records: round trips, the pinned byte layout, and every way a
file can be broken (each a one-line FormatError naming the file)."""

from __future__ import annotations

import os
import struct
import tempfile
import zlib

import numpy as np
import pytest
from hypothesis import given
from hypothesis import strategies as st

from strata.errors import FormatError
from strata.formats.expert_record import (
    PLANE_ALIGN,
    PLANE_NAMES,
    RECORD_ALIGN,
    ExpertWeights,
    RecordLayout,
    pack_record,
    unpack_record,
)
from strata.formats.experts_file import HEADER_SIZE, MAGIC, ExpertsFile, file_geometry, header_size, write_experts
from strata.formats.quant_types import QuantType, layout, row_bytes
from strata.reference.quants import QUANTIZABLE, dequantize, from_blocks, quantize
from tests.ggml_random import random_blocks

# Block-multiple dimensions small enough for fast tests (hypothesis strategies local to this
# module: they are about record shapes, which no other module needs).
dims = st.integers(1, 4).map(lambda b: 32 * b)
qtypes = st.sampled_from(list(QuantType))


def fit(n: int, qtype: QuantType) -> int:
    """n rounded up to the type's block (MLX's group-64 types need multiples of 64)."""
    return -(-n // layout(qtype).block_size) * layout(qtype).block_size

L, E, D, F = 2, 3, 32, 64  # the small file most tests use


def make_expert(qtype: QuantType, hidden: int, ffn: int, seed: int) -> ExpertWeights:
    rng = np.random.default_rng(seed)
    if qtype not in QUANTIZABLE:  # a GGUF's types are copied, never made: random blocks
        def blocks(rows: int, cols: int, salt: int):
            n = rows * row_bytes(qtype, cols) // layout(qtype).block_bytes
            if qtype is QuantType.BF16:
                raw = rng.standard_normal(rows * cols).astype(np.float32).view(np.uint32) >> 16
                return from_blocks(qtype, cols, raw.astype(np.uint16).view(np.uint8))
            return from_blocks(qtype, cols, random_blocks(qtype, n, seed * 3 + salt, edges=False))
        return ExpertWeights(gate=blocks(ffn, hidden, 0), up=blocks(ffn, hidden, 1), down=blocks(hidden, ffn, 2))
    return ExpertWeights(
        gate=quantize(qtype, rng.standard_normal((ffn, hidden))),
        up=quantize(qtype, rng.standard_normal((ffn, hidden))),
        down=quantize(qtype, rng.standard_normal((hidden, ffn))),
    )


def seeded(qtype: QuantType, hidden: int = D, ffn: int = F):
    return lambda l, e: make_expert(qtype, hidden, ffn, seed=1000 * l + e)


def assert_same_expert(a: ExpertWeights, b: ExpertWeights) -> None:
    for proj in ("gate", "up", "down"):
        x, y = a.projection(proj), b.projection(proj)
        assert x.qtype is y.qtype and x.shape == y.shape
        np.testing.assert_array_equal(x.codes, y.codes)
        np.testing.assert_array_equal(x.scales, y.scales)
        assert (x.biases is None) == (y.biases is None)
        if x.biases is not None:
            np.testing.assert_array_equal(x.biases, y.biases)
        np.testing.assert_array_equal(dequantize(x), dequantize(y))


def assert_one_line_error(err: pytest.ExceptionInfo, path, *fragments: str) -> None:
    msg = str(err.value)
    assert "\n" not in msg
    assert str(path) in msg
    for frag in fragments:
        assert frag in msg, msg


@pytest.fixture
def q2_file(tmp_path):
    path = tmp_path / "model.experts"
    write_experts(path, qtype=QuantType.Q2_0, n_layers=L, n_experts=E, hidden=D, expert_ffn=F,
                  get_expert=seeded(QuantType.Q2_0))
    return path


# ---------------------------------------------------------------- record layout


@given(qtype=qtypes, hidden=dims, ffn=dims)
def test_record_layout_planes_are_aligned_ordered_and_sized(qtype, hidden, ffn):
    hidden, ffn = fit(hidden, qtype), fit(ffn, qtype)
    rec = RecordLayout(qtype, hidden, ffn)
    lay = layout(qtype)
    end = 0
    for i, (name, span) in enumerate(zip(PLANE_NAMES, rec.planes)):
        assert span.offset % PLANE_ALIGN == 0, name
        assert span.offset >= end and span.offset - end < PLANE_ALIGN, name  # no gap beyond alignment
        rows, cols = rec.shape(name.split(".")[0])
        n_blocks = rows * cols // lay.block_size
        assert span.nbytes == n_blocks * (lay.code_bytes if i % 2 == 0 else lay.scale_bytes), name
        end = span.end
    assert rec.record_bytes == end
    assert rec.padded_bytes % RECORD_ALIGN == 0 and 0 <= rec.padded_bytes - rec.record_bytes < RECORD_ALIGN


@given(qtype=qtypes, hidden=dims, ffn=dims, seed=st.integers(0, 2**32 - 1))
def test_pack_unpack_round_trip_is_zero_copy(qtype, hidden, ffn, seed):
    hidden, ffn = fit(hidden, qtype), fit(ffn, qtype)
    rec = RecordLayout(qtype, hidden, ffn)
    w = make_expert(qtype, hidden, ffn, seed)
    raw = pack_record(w, rec)
    assert isinstance(raw, bytes) and len(raw) == rec.padded_bytes
    slot = np.frombuffer(bytearray(raw), np.uint8)
    for buf in (raw, memoryview(raw), slot):
        assert_same_expert(unpack_record(buf, rec), w)
    back = unpack_record(slot, rec)
    for proj in ("gate", "up", "down"):
        assert np.shares_memory(back.projection(proj).codes, slot)
    covered = np.zeros(rec.padded_bytes, bool)
    for span in rec.planes:
        covered[span.offset : span.end] = True
    assert not slot[~covered].any()  # alignment gaps and the tail are zero


def test_float_types_have_empty_scales_planes():
    for qtype in (QuantType.F32, QuantType.F16):
        rec = RecordLayout(qtype, D, F)
        assert all(rec.scales(p).nbytes == 0 for p in ("gate", "up", "down"))
        w = unpack_record(pack_record(make_expert(qtype, D, F, 0), rec), rec)
        assert w.gate.scales.shape == (F, 0)


def test_layout_rejects_partial_blocks_and_mismatched_experts():
    with pytest.raises(ValueError, match="multiple of 32"):
        RecordLayout(QuantType.Q2_0, 48, 64)
    rec = RecordLayout(QuantType.Q2_0, D, F)
    with pytest.raises(ValueError, match="record layout wants"):
        pack_record(make_expert(QuantType.Q8_0, D, F, 0), rec)
    a, b = make_expert(QuantType.Q2_0, D, F, 0), make_expert(QuantType.Q8_0, D, F, 0)
    mixed = ExpertWeights(a.gate, b.up, a.down)  # a GGUF's projections mix types: an expert may
    with pytest.raises(ValueError, match="mix quant types"):  # but asking it for one type is an error
        mixed.qtype
    with pytest.raises(ValueError, match="record layout wants"):  # and a single-type record refuses it
        pack_record(mixed, rec)


# ---------------------------------------------------------------- file round trip


@pytest.mark.parametrize("qtype", list(QuantType), ids=lambda q: q.name)
def test_file_round_trip_every_qtype(tmp_path, qtype):
    path = tmp_path / f"{qtype.name}.experts"
    d, f_ = fit(D, qtype), fit(F, qtype)
    header = write_experts(path, qtype=qtype, n_layers=L, n_experts=E, hidden=d, expert_ffn=f_,
                           get_expert=seeded(qtype, d, f_))
    with ExpertsFile.open(path) as f:
        assert f.header == header
        h = f.header
        assert (h.qtype, h.n_layers, h.n_experts, h.hidden, h.expert_ffn) == (qtype, L, E, d, f_)
        assert f.layout == RecordLayout(qtype, d, f_)
        for l in range(L):
            for e in range(E):
                assert_same_expert(f.expert(l, e), seeded(qtype, d, f_)(l, e))


def test_record_offsets_and_file_size(q2_file):
    with ExpertsFile.open(q2_file) as f:
        h = f.header
        data_offset, file_bytes = file_geometry(L, E, h.padded_bytes)
        assert h.data_offset == data_offset == RECORD_ALIGN  # header + 6 checksums fit one page
        assert os.path.getsize(q2_file) == file_bytes == h.data_offset + L * E * h.padded_bytes
        for l in range(L):
            for e in range(E):
                off = f.record_offset(l, e)
                assert off % RECORD_ALIGN == 0
                assert off == h.data_offset + (l * E + e) * h.padded_bytes


def test_large_tables_push_the_data_offset_to_the_next_page():
    n = 2100  # 176 + 4*2100 + 4 = 8580 bytes of header: three pages
    assert file_geometry(1, n, RECORD_ALIGN) == (3 * RECORD_ALIGN, 3 * RECORD_ALIGN + n * RECORD_ALIGN)


def test_read_into_a_slot_and_raw_pread_agree(q2_file):
    with ExpertsFile.open(q2_file) as f:
        n = f.header.padded_bytes
        slot = np.zeros(2 * n, np.uint8)[n:]  # a slot in a larger arena
        got = f.read_record(1, 2, out=slot)
        assert np.shares_memory(got, slot)
        raw = os.pread(f.fileno(), n, f.record_offset(1, 2))
        assert got.tobytes() == raw
        assert zlib.crc32(raw[: f.header.record_bytes]) == f.checksum(1, 2)
        assert_same_expert(unpack_record(slot, f.layout), seeded(QuantType.Q2_0)(1, 2))


def test_out_of_range_record_is_a_clear_error(q2_file):
    with ExpertsFile.open(q2_file) as f:
        for l, e in ((L, 0), (0, E), (-1, 0)):
            with pytest.raises(ValueError, match=f"layer {l} expert {e}"):
                f.read_record(l, e)


def test_closed_file_refuses_reads(q2_file):
    f = ExpertsFile.open(q2_file)
    f.close()
    f.close()  # idempotent
    with pytest.raises(ValueError, match="closed"):
        f.read_record(0, 0)


# ---------------------------------------------------------------- the pinned header


def test_golden_header_bytes(q2_file):
    raw = q2_file.read_bytes()
    assert HEADER_SIZE == 176
    assert raw[:8] == MAGIC == b"STRXPRT1"
    u32 = lambda off: struct.unpack_from("<I", raw, off)[0]  # noqa: E731
    u64 = lambda off: struct.unpack_from("<Q", raw, off)[0]  # noqa: E731
    assert [u32(o) for o in range(8, 40, 4)] == [1, 200, L, E, D, F, 16, 4096]
    assert (u64(40), u64(48)) == (1920, 4096)  # record_bytes, padded_bytes
    # Q2_0, D=32, F=64: gate/up codes [64 rows x 8 bytes], scales [64 x 1] f16; down codes [32 x 16], scales [32 x 2]
    assert [u64(56 + 8 * i) for i in range(6)] == [0, 512, 640, 1152, 1280, 1792]
    assert [u64(104 + 8 * i) for i in range(6)] == [512, 128, 512, 128, 512, 128]
    assert (u64(152), u64(160), u64(168)) == (176, 4096, 4096 + L * E * 4096)
    table_end = 176 + 4 * L * E
    records = [raw[4096 + i * 4096 : 4096 + i * 4096 + 1920] for i in range(L * E)]
    assert [u32(176 + 4 * i) for i in range(L * E)] == [zlib.crc32(r) for r in records]
    assert u32(table_end) == zlib.crc32(raw[:table_end])
    assert not any(raw[table_end + 4 : 4096])


# ---------------------------------------------------------------- broken files


def rewrite(path, offset: int, data: bytes, fix_header_crc: bool = False) -> None:
    raw = bytearray(path.read_bytes())
    raw[offset : offset + len(data)] = data
    if fix_header_crc:
        table_end = HEADER_SIZE + 4 * L * E
        raw[table_end : table_end + 4] = struct.pack("<I", zlib.crc32(bytes(raw[:table_end])))
    path.write_bytes(bytes(raw))


def test_truncated_file(q2_file):
    size = os.path.getsize(q2_file)
    os.truncate(q2_file, size - 100)
    with pytest.raises(FormatError) as err:
        ExpertsFile.open(q2_file)
    assert_one_line_error(err, q2_file, "truncated", f"{size - 100} bytes", f"header says {size}")


def test_truncated_inside_the_header(q2_file):
    os.truncate(q2_file, 100)
    with pytest.raises(FormatError) as err:
        ExpertsFile.open(q2_file)
    assert_one_line_error(err, q2_file, "truncated")


def test_wrong_magic(q2_file):
    rewrite(q2_file, 0, b"GGUF\0\0\0\0")
    with pytest.raises(FormatError) as err:
        ExpertsFile.open(q2_file)
    assert_one_line_error(err, q2_file, "not a strata .experts file")


def test_corrupted_header_fails_its_checksum(q2_file):
    rewrite(q2_file, 24, struct.pack("<I", 64))  # hidden
    with pytest.raises(FormatError) as err:
        ExpertsFile.open(q2_file)
    assert_one_line_error(err, q2_file, "header checksum mismatch")


def test_header_disagreeing_with_the_layout(q2_file):
    rewrite(q2_file, 56 + 8, struct.pack("<Q", 520), fix_header_crc=True)  # gate scales offset
    with pytest.raises(FormatError) as err:
        ExpertsFile.open(q2_file)
    assert_one_line_error(err, q2_file, "plane_offset.gate.scales", "520", "512")


def test_unknown_version_and_qtype(q2_file):
    rewrite(q2_file, 8, struct.pack("<I", 4))
    with pytest.raises(FormatError) as err:
        ExpertsFile.open(q2_file)
    assert_one_line_error(err, q2_file, "version 4")
    rewrite(q2_file, 8, struct.pack("<II", 1, 77), fix_header_crc=True)
    with pytest.raises(FormatError) as err:
        ExpertsFile.open(q2_file)
    assert_one_line_error(err, q2_file, "quant type id 77")


def test_corrupted_record_names_layer_expert_and_offset(q2_file):
    with ExpertsFile.open(q2_file) as f:
        offset = f.record_offset(1, 2)
    rewrite(q2_file, offset + 700, b"\xff")
    with ExpertsFile.open(q2_file) as f:  # opening does not read records
        f.read_record(0, 0)
        with pytest.raises(FormatError) as err:
            f.read_record(1, 2)
        assert_one_line_error(err, q2_file, "checksum mismatch", "layer 1 expert 2", f"offset {offset}")
        assert f.read_record(1, 2, verify=False)[700] == 0xFF
        with pytest.raises(FormatError):
            f.verify_all()


def test_padding_is_outside_the_checksum(q2_file):
    with ExpertsFile.open(q2_file) as f:
        tail = f.record_offset(0, 1) + f.header.record_bytes
    rewrite(q2_file, tail, b"\x01")
    with ExpertsFile.open(q2_file) as f:
        f.verify_all()


def test_missing_file_and_not_a_file(tmp_path):
    with pytest.raises(FormatError) as err:
        ExpertsFile.open(tmp_path / "nope.experts")
    assert_one_line_error(err, tmp_path / "nope.experts", "cannot open")
    empty = tmp_path / "empty.experts"
    empty.write_bytes(b"")
    with pytest.raises(FormatError) as err:
        ExpertsFile.open(empty)
    assert_one_line_error(err, empty, "not a strata .experts file")


# ---------------------------------------------------------------- the writer


def test_interrupted_write_leaves_nothing_at_the_final_path(tmp_path):
    path = tmp_path / "model.experts"

    def failing(l, e):
        if (l, e) == (1, 1):
            raise RuntimeError("conversion died")
        return seeded(QuantType.Q2_0)(l, e)

    with pytest.raises(RuntimeError, match="conversion died"):
        write_experts(path, qtype=QuantType.Q2_0, n_layers=L, n_experts=E, hidden=D, expert_ffn=F, get_expert=failing)
    assert os.listdir(tmp_path) == []


def test_interrupted_rewrite_keeps_the_old_file(q2_file):
    before = q2_file.read_bytes()

    def failing(l, e):
        raise KeyboardInterrupt

    with pytest.raises(KeyboardInterrupt):
        write_experts(q2_file, qtype=QuantType.Q8_0, n_layers=L, n_experts=E, hidden=D, expert_ffn=F, get_expert=failing)
    assert q2_file.read_bytes() == before
    assert os.listdir(q2_file.parent) == [q2_file.name]


def test_writer_rejects_an_expert_of_the_wrong_shape(tmp_path):
    path = tmp_path / "model.experts"
    wrong = lambda l, e: make_expert(QuantType.Q2_0, D, 2 * F, 0)  # noqa: E731
    with pytest.raises(ValueError, match="layer 0 expert 0"):
        write_experts(path, qtype=QuantType.Q2_0, n_layers=L, n_experts=E, hidden=D, expert_ffn=F, get_expert=wrong)
    assert os.listdir(tmp_path) == []


def test_writer_streams_one_expert_at_a_time():
    alive = []

    class Tracked(ExpertWeights):
        def __del__(self):
            alive.remove(id(self))

    def get(l, e):
        w = make_expert(QuantType.Q2_0, D, F, l * E + e)
        t = Tracked(w.gate, w.up, w.down)
        alive.append(id(t))
        assert len(alive) <= 2  # the one being written and the new one
        return t

    with tempfile.TemporaryDirectory() as d:
        write_experts(os.path.join(d, "x.experts"), qtype=QuantType.Q2_0, n_layers=L, n_experts=E,
                      hidden=D, expert_ffn=F, get_expert=get)


def test_q2_0_codes_plane_is_mlx_packed_uint32():
    """docs/formats.md: a Q2_0 codes plane viewed as little-endian uint32 is MLX's `w` for
    bits=2, group_size=32; scales are MLX's scales and the biases are -2 * scales."""
    mx = pytest.importorskip("mlx.core")
    rec = RecordLayout(QuantType.Q2_0, D, F)
    w = unpack_record(pack_record(make_expert(QuantType.Q2_0, D, F, 3), rec), rec)
    for proj in ("gate", "up", "down"):
        m = w.projection(proj)
        scales = m.scales.astype(np.float32)
        got = mx.dequantize(mx.array(m.codes.view("<u4")), mx.array(scales), mx.array(-2 * scales),
                            group_size=32, bits=2)
        np.testing.assert_array_equal(np.array(got), dequantize(m))


# ---------------------------------------------------------------- types per layer and projection (version 3)

# a llama.cpp UD-like mix: Q4_K gate/up with a Q5_1 down, an IQ4_NL layer, an all-Q8_0 layer
MIXED_TYPES = ((QuantType.Q4_K, QuantType.Q4_K, QuantType.Q5_1),
               (QuantType.IQ4_NL, QuantType.IQ4_NL, QuantType.IQ4_NL),
               (QuantType.Q8_0, QuantType.Q8_0, QuantType.Q8_0))
MD, MF = 256, 512  # whole K-quant super-blocks


def mixed_expert(types, l: int, e: int, biases: bool = False) -> ExpertWeights:
    rng = np.random.default_rng(100 * l + e)
    mats = []
    for q, (rows, cols) in zip(types, ((MF, MD), (MF, MD), (MD, MF))):
        if q in QUANTIZABLE:
            mats.append(quantize(q, rng.standard_normal((rows, cols))))
        else:
            n = rows * row_bytes(q, cols) // layout(q).block_bytes
            mats.append(from_blocks(q, cols, random_blocks(q, n, 100 * l + e, edges=False)))
    b = None
    if biases:
        from strata.formats.expert_record import ExpertBiases
        b = ExpertBiases(*(rng.standard_normal(n).astype(np.float32) for n in (MF, MF, MD)))
    return ExpertWeights(*mats, biases=b)


@pytest.mark.parametrize("biases", [False, True])
def test_mixed_types_round_trip_as_version_3(tmp_path, biases):
    path = tmp_path / "mixed.experts"
    header = write_experts(path, qtype=QuantType.Q4_K, n_layers=3, n_experts=2, hidden=MD, expert_ffn=MF,
                           get_expert=lambda l, e: mixed_expert(MIXED_TYPES[l], l, e, biases), biases=biases,
                           layer_qtypes=MIXED_TYPES)
    layouts = [RecordLayout(g, MD, MF, biases, up_qtype=u, down_qtype=d) for g, u, d in MIXED_TYPES]
    with ExpertsFile.open(path) as f:
        h = f.header
        assert h == header and h.version == 3 and h.mixed and h.qtype is None and h.biases == biases
        assert h.layer_qtypes == MIXED_TYPES
        assert f.layout is None  # no one layout: a single-layout reader cannot take it silently
        assert h.padded_bytes == max(r.padded_bytes for r in layouts)  # the arena slot fits the largest record
        assert h.record_bytes == max(r.record_bytes for r in layouts)
        assert h.data_offset % RECORD_ALIGN == 0 and os.path.getsize(path) == h.data_offset + 6 * h.padded_bytes
        for l in range(3):
            assert f.layer_layout(l) == layouts[l]
            for e in range(2):
                assert f.record_offset(l, e) == h.data_offset + (2 * l + e) * h.padded_bytes
                got = f.expert(l, e)
                assert got.qtypes == MIXED_TYPES[l]
                assert_same_expert(got, mixed_expert(MIXED_TYPES[l], l, e, biases))
        f.verify_all()
        assert "Q4_K" in repr(f) and "Q5_1" in repr(f)


def test_a_uniform_layer_list_is_written_as_version_1(tmp_path):
    one = ((QuantType.Q8_0,) * 3,) * 2
    h = write_experts(tmp_path / "u.experts", qtype=QuantType.Q8_0, n_layers=2, n_experts=2, hidden=D, expert_ffn=F,
                      get_expert=seeded(QuantType.Q8_0), layer_qtypes=one)
    assert (h.version, h.qtype, h.mixed) == (1, QuantType.Q8_0, False)


def test_mixed_header_damage_is_one_line(tmp_path):
    path = tmp_path / "mixed.experts"
    write_experts(path, qtype=QuantType.Q4_K, n_layers=3, n_experts=2, hidden=MD, expert_ffn=MF,
                  get_expert=lambda l, e: mixed_expert(MIXED_TYPES[l], l, e), layer_qtypes=MIXED_TYPES)
    good = path.read_bytes()
    table_start = HEADER_SIZE + 8

    def damaged(at: int, data: bytes) -> str:
        raw = bytearray(good)
        raw[at:at + len(data)] = data
        head = header_size(False, 3)
        end = head + 4 * 6
        raw[end:end + 4] = struct.pack("<I", zlib.crc32(bytes(raw[:end])))  # the header CRC made to match
        path.write_bytes(bytes(raw))
        with pytest.raises(FormatError) as err:
            ExpertsFile.open(path)
        assert_one_line_error(err, path)
        return str(err.value)

    assert "quant type id 77" in damaged(table_start + 4, struct.pack("<I", 77))
    assert "unknown flags" in damaged(HEADER_SIZE, struct.pack("<Q", 6))
    raw = bytearray(good)  # a layer's down relabelled Q5_1 -> Q4_K, the header CRC left as it was
    raw[table_start + 8:table_start + 12] = struct.pack("<I", int(QuantType.Q4_K))
    path.write_bytes(bytes(raw))
    with pytest.raises(FormatError) as err:
        ExpertsFile.open(path)
    assert_one_line_error(err, path, "header checksum mismatch")
    path.write_bytes(good[:HEADER_SIZE + 4])  # cut inside the type table
    with pytest.raises(FormatError) as err:
        ExpertsFile.open(path)
    assert_one_line_error(err, path, "truncated")
