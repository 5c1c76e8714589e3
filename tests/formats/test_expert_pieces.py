"""`PieceStore` (strata/formats/expert_pieces.py) on a file of stacked expert blocks laid out as a
llama.cpp GGUF lays them out: a record put together from its pieces is `pack_record` of the same
blocks (Q8_0 / Q4_0 split into planes, whole-block types and floats copied), whatever the slot
held before; the reads are whole pages around each slice, touching ones merged; the first read of
a record keeps its CRC-32 and a later read that differs is refused."""

from __future__ import annotations

import os

import numpy as np
import pytest

from ggml_random import random_blocks
from strata.errors import FormatError
from strata.formats.expert_pieces import READ_ALIGN, PieceStore, files_identity, record_pieces
from strata.formats.expert_record import ExpertWeights, RecordLayout, pack_record
from strata.formats.quant_types import QuantType, layout, row_bytes
from strata.reference.quants import from_blocks

D, F, E = 256, 512, 5
TYPES = [(QuantType.Q8_0, QuantType.Q4_0, QuantType.Q4_K), (QuantType.IQ4_NL, QuantType.F16, QuantType.GGML_MXFP4)]


def _blocks(qtype: QuantType, rows: int, cols: int, seed: int) -> np.ndarray:
    """E experts' [rows, cols] matrices of `qtype`, stacked, as raw bytes. uint8 [E * rows * row_bytes]"""
    if qtype is QuantType.F16:
        return np.random.default_rng(seed).standard_normal(E * rows * cols).astype(np.float16).view(np.uint8)
    n = E * rows * cols // layout(qtype).block_size
    return random_blocks(qtype, n, seed, edges=False)


@pytest.fixture(params=range(len(TYPES)), ids=lambda i: "/".join(q.name for q in TYPES[i]))
def stacked(request, tmp_path):
    """A file: 100 bytes of header, then the gate, up and down stacks of one layer at unaligned
    offsets (as tensors sit after a GGUF header); -> (store, the stacks, the layout)."""
    types = TYPES[request.param]
    rec = RecordLayout(types[0], D, F, up_qtype=types[1], down_qtype=types[2])
    stacks = [_blocks(q, *rec.shape(p), seed=i) for i, (q, p) in enumerate(zip(types, ("gate", "up", "down")))]
    path = tmp_path / "stacked.bin"
    offsets, at = [], 100
    with open(path, "wb") as f:
        f.write(bytes(100))
        for s in stacks:
            offsets.append(at)
            f.write(s.tobytes() + bytes(32))  # a gap, as a GGUF pads each tensor to its alignment
            at += s.nbytes + 32
    sources = [(0, off, s.nbytes // E, s.nbytes // E) for off, s in zip(offsets, stacks)]
    store = PieceStore([str(path)], [rec], E, [record_pieces(rec, sources)], files_identity([(str(path), 100)]))
    yield store, stacks, rec
    store.close()


def _packed(stacks, rec: RecordLayout, e: int) -> bytes:
    mats = []
    for s, proj in zip(stacks, ("gate", "up", "down")):
        rows, cols = rec.shape(proj)
        per = s.nbytes // E
        mats.append(from_blocks(rec.qtype_of(proj), cols, s[e * per:(e + 1) * per].reshape(rows, row_bytes(
            rec.qtype_of(proj), cols))))
    return pack_record(ExpertWeights(*mats), rec)


def test_a_record_put_together_is_pack_record_of_its_blocks(stacked):
    store, stacks, rec = stacked
    slot = np.full(store.header.padded_bytes, 0x5A, np.uint8)  # stale bytes in the gaps
    for e in range(E):
        got = store.read_record(0, e, out=slot)
        assert got[:rec.record_bytes].tobytes() == _packed(stacks, rec, e)[:rec.record_bytes], e
    assert store.header.padded_bytes == rec.padded_bytes and store.header.layer_qtypes == (rec.qtypes,)


def test_reads_are_whole_pages_around_each_slice_and_touching_ones_merge(stacked):
    store, stacks, rec = stacked
    for e in range(E):
        reads = store.reads(0, e)
        for r in reads:
            assert r.start % READ_ALIGN == 0 and r.length % READ_ALIGN == 0
            for p, at in r.pieces:
                assert r.start + at == p.offset + e * p.stride and at + p.nbytes <= r.need <= r.length
        # three slices: one read each unless their pages touch (then one read for both)
        assert sum(len(r.pieces) for r in reads) == 3 and 1 <= len(reads) <= 3
    assert store.read_bytes_per_record >= sum(s.nbytes for s in stacks) / E


def test_a_record_read_again_must_give_its_first_crc(stacked, tmp_path):
    store, _, _ = stacked
    store.read_record(0, 1)
    r = store.reads(0, 1)[-1]
    p, at = r.pieces[-1]
    with open(store.path, "r+b") as f:
        f.seek(r.start + at + p.nbytes - 1)  # the last byte of the down slice: a code byte in every type here
        b = f.read(1)
        f.seek(r.start + at + p.nbytes - 1)
        f.write(bytes([b[0] ^ 1]))
    st = os.stat(store.path)  # a filesystem with a coarse clock may not have moved it: moved by a second
    os.utime(store.path, ns=(st.st_atime_ns, st.st_mtime_ns + 10**9))
    with pytest.raises(FormatError, match=r"MoE layer 0 expert 1: checksum mismatch: .*\(stacked\.bin was written "
                                          r"to since it was opened \(its mtime moved\)\)"):
        store.read_record(0, 1)
    store.read_record(0, 2)  # its first read: kept as it is now
