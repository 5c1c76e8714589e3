"""The twin table: strata's reference dequantization of every ggml type (strata/reference/
ggml_quants.py, on the layouts of strata/formats/ggml_blocks.py) equals the `gguf` package's
`gguf.quants.dequantize` bit for bit, on random blocks with edge values in every scale field."""

from __future__ import annotations

import gguf
import numpy as np
import pytest

from strata.formats import ggml_blocks
from strata.formats.quant_matrix import QuantMatrix
from strata.formats.quant_types import QuantType, ggml_block_name, is_whole_blocks, layout
from strata.reference import ggml_quants
from strata.reference.quants import dequantize, from_blocks, to_blocks
from tests.ggml_random import random_blocks

# every type the gguf package dequantizes, ours beside it (F32 / F16 / BF16 are plain floats)
TWIN_TYPES = [q for q in QuantType if is_whole_blocks(q)] + [QuantType.Q4_0, QuantType.Q8_0]
FLOAT_TWINS = [QuantType.F32, QuantType.F16, QuantType.BF16]
N_BLOCKS = 64  # random blocks per type per seed
# float16 scales with edges: zero, minus zero, the smallest subnormal, the largest finite, ones


def _gguf_type(qtype: QuantType) -> gguf.GGMLQuantizationType:
    return gguf.GGMLQuantizationType[ggml_block_name(qtype)]


def assert_bitwise_equal(ours: np.ndarray, theirs: np.ndarray) -> None:
    assert ours.dtype == theirs.dtype == np.float32 and ours.shape == theirs.shape
    a, b = ours.view(np.uint32), theirs.view(np.uint32)
    bad = np.flatnonzero(a.reshape(-1) != b.reshape(-1))
    assert bad.size == 0, (f"{bad.size} values differ, the first at {bad[0]}: "
                           f"{ours.reshape(-1)[bad[0]]!r} vs gguf's {theirs.reshape(-1)[bad[0]]!r}")


@pytest.mark.filterwarnings("ignore:overflow encountered in multiply:RuntimeWarning")  # e8m0 255: 12 * 2^127
@pytest.mark.parametrize("seed", [0, 1])
@pytest.mark.parametrize("qtype", TWIN_TYPES, ids=lambda q: q.name)
def test_reference_equals_gguf_bit_for_bit(qtype, seed):
    name = ggml_block_name(qtype)
    block, dt = ggml_blocks.BLOCK_DTYPES[name]
    raw = random_blocks(qtype, N_BLOCKS, seed).reshape(4, -1)  # 4 rows of 16 blocks
    theirs = gguf.quants.dequantize(raw, _gguf_type(qtype))
    ours = ggml_quants.dequantize_blocks(name, raw, raw.shape[1] // dt.itemsize * block)
    assert_bitwise_equal(ours, np.asarray(theirs, np.float32))


@pytest.mark.parametrize("qtype", TWIN_TYPES, ids=lambda q: q.name)
def test_constant_blocks_equal_gguf_bit_for_bit(qtype):
    """Blocks of one byte repeated: all zero; 0xFF (NaN float16 scales, every code at its top);
    0x7C (float16 scales of +inf: inf and NaN products); 0x80 (-0.0 scales, sign bits set). NaN
    payloads included: the same bits as gguf's."""
    name = ggml_block_name(qtype)
    block, dt = ggml_blocks.BLOCK_DTYPES[name]
    for fill in (0x00, 0xFF, 0x7C, 0x80):
        raw = np.full((2, 3 * dt.itemsize), fill, np.uint8)
        with np.errstate(invalid="ignore", over="ignore"):
            ours = ggml_quants.dequantize_blocks(name, raw, 3 * block)
            theirs = np.asarray(gguf.quants.dequantize(raw, _gguf_type(qtype)), np.float32)
        assert_bitwise_equal(ours, theirs)


@pytest.mark.parametrize("qtype", FLOAT_TWINS, ids=lambda q: q.name)
def test_float_types_equal_gguf(qtype):
    rng = np.random.default_rng(3)
    raw = rng.integers(0, 256, (4, 64), dtype=np.uint8)
    gtype = gguf.GGMLQuantizationType[qtype.name]
    if qtype is QuantType.BF16:
        theirs = gguf.quants.dequantize(raw, gtype)
    else:
        theirs = raw.view({QuantType.F32: np.float32, QuantType.F16: np.float16}[qtype]).astype(np.float32)
    m = QuantMatrix(qtype, 4, 64 // layout(qtype).block_bytes, raw, np.zeros((4, 0), np.float16))
    ours = dequantize(m)
    np.testing.assert_array_equal(ours.view(np.uint32), np.asarray(theirs, np.float32).view(np.uint32))


def test_the_table_covers_every_type_gguf_dequantizes():
    """Every quantized type gguf has a dequantizer for (less Q1_0, not a GGUF weight type in
    llama.cpp's files) is a strata type with a reference twin."""
    theirs = {t.name for t in gguf.quants._type_traits} - {"Q1_0"}
    ours = {ggml_block_name(q) for q in TWIN_TYPES} | {"BF16"}
    assert theirs <= ours, theirs - ours


@pytest.mark.parametrize("qtype", [q for q in QuantType if is_whole_blocks(q)], ids=lambda q: q.name)
def test_whole_block_types_are_their_blocks_in_a_quant_matrix(qtype):
    """A whole-block type's QuantMatrix holds the blocks as stored (the codes plane) and no
    scales; `reference.quants.dequantize` is the ggml twin; the block form is the identity."""
    lay = layout(qtype)
    raw = random_blocks(qtype, 6, seed=9).reshape(2, -1)
    n_cols = raw.shape[1] // lay.block_bytes * lay.block_size
    m = from_blocks(qtype, n_cols, raw)
    assert m.scales.shape == (2, 0) and m.codes.shape == raw.shape
    np.testing.assert_array_equal(to_blocks(m), raw)
    want = np.asarray(gguf.quants.dequantize(raw, _gguf_type(qtype)), np.float32)
    assert_bitwise_equal(dequantize(m), want)


def test_grids_are_ggml_s_first_entries():
    """A few entries of ggml-common.h's grids, written out: the table gguf packs as hex is read
    in the order ggml indexes it (byte j of entry r is weight j)."""
    assert ggml_blocks.grid("iq2xxs")[1].tolist() == [0x2B, 8, 8, 8, 8, 8, 8, 8]  # 0x080808080808082b
    assert ggml_blocks.grid("iq1s")[1].tolist() == [1, -1, -1, -1, -1, -1, -1, -1]  # 0xffffffffffffff01
    assert ggml_blocks.grid("iq3xxs")[1].tolist() == [20, 4, 4, 4]  # 0x04040414
    assert ggml_blocks.grid("iq3s")[1].tolist() == [3, 1, 1, 1]  # 0x01010103
    assert [ggml_blocks.grid(n).shape for n in ggml_blocks.GRIDS] == [s for _, s in ggml_blocks.GRIDS.values()]


def test_bad_row_lengths_are_refused():
    with pytest.raises(ValueError, match="multiple of 256"):
        ggml_quants.dequantize_blocks("Q4_K", np.zeros(144, np.uint8), 100)
    with pytest.raises(ValueError, match="whole number of 144-byte blocks"):
        ggml_quants.dequantize_blocks("Q4_K", np.zeros(143, np.uint8), 256)


@pytest.mark.parametrize("qtype", [q for q in QuantType if is_whole_blocks(q)], ids=lambda q: q.name)
def test_non_finite_blocks_are_the_blocks_gguf_dequantizes_to_nan_or_inf(qtype):
    """QuantMatrix.non_finite on a type kept as stored (convert's pass-through check) counts exactly
    the blocks gguf's dequantizer turns into a NaN or an infinity: random blocks with random bytes
    in every field, so scales of every exponent (inf, NaN, MXFP4's largest) come up."""
    name = ggml_block_name(qtype)
    block_size, dt = ggml_blocks.BLOCK_DTYPES[name]
    rng = np.random.default_rng(int(qtype))
    raw = rng.integers(0, 256, size=(64, 8 * dt.itemsize), dtype=np.uint8)  # 64 rows of 8 blocks
    with np.errstate(all="ignore"):
        values = gguf.quants.dequantize(raw, gguf.GGMLQuantizationType[name]).reshape(64 * 8, block_size)
    want = int(np.count_nonzero(~np.isfinite(values).all(axis=1))) * block_size
    m = QuantMatrix(qtype, 64, 8 * block_size, raw, np.zeros((64, 0), np.float16))
    assert m.non_finite() == want


@pytest.mark.filterwarnings("ignore:overflow encountered in multiply:RuntimeWarning")  # e8m0 255: 12 * 2^127
@pytest.mark.parametrize("qtype", TWIN_TYPES + FLOAT_TWINS, ids=lambda q: q.name)
def test_rows_of_any_stored_type_equal_gguf_bit_for_bit(qtype):
    """`dequantize_rows` (a GGUF tensor's rows as stored, by ggml type id: what an n-gram table read
    in place decodes with) is gguf's dequantization, floats included."""
    gtype = gguf.GGMLQuantizationType[qtype.name if qtype in FLOAT_TWINS else ggml_block_name(qtype)]
    if qtype in FLOAT_TWINS:
        raw = np.random.default_rng(5).integers(0, 256, (4, 64), dtype=np.uint8)
        n_cols = 64 // layout(qtype).block_bytes
        theirs = raw.view(np.float32) if qtype is QuantType.F32 else \
            raw.view(np.float16).astype(np.float32) if qtype is QuantType.F16 else gguf.quants.dequantize(raw, gtype)
    else:
        block, dt = ggml_blocks.BLOCK_DTYPES[ggml_block_name(qtype)]
        raw = random_blocks(qtype, N_BLOCKS, 4).reshape(4, -1)
        n_cols = raw.shape[1] // dt.itemsize * block
        theirs = gguf.quants.dequantize(raw, gtype)
    with np.errstate(invalid="ignore", over="ignore"):
        ours = ggml_quants.dequantize_rows(int(gtype), raw, n_cols)
    assert_bitwise_equal(ours, np.asarray(theirs, np.float32))
