"""Reference quantization (design §2): Q2_0's invariants, byte layout and MLX equivalence;
Q8_0/Q4_0 against the `gguf` package; float round trips; block form; GEMV; bad shapes."""

from __future__ import annotations

import gguf
import mlx.core as mx
import numpy as np
import pytest
from hypothesis import example, given
from hypothesis import strategies as st
from hypothesis.extra import numpy as hnp

from strata.formats.quant_matrix import QuantMatrix
from strata.formats.quant_types import QuantType, layout, row_bytes
from strata.reference.quants import QUANTIZABLE, codes_of, dequantize, from_blocks, gemv, quantize, to_blocks
from tests.strategies import finite_f32, float_matrices

F32_UNIT_ROUNDOFF = 2.0**-24
# Q2_0 picks q = trunc(fl(fl(x·fl(1/d)) + 2.5)) in float32. With |x/d| <= 2 the product errs by
# at most ~4u in absolute terms and the add (result in [0.5, 4.5), half an ulp = 2^-22) by 2^-22
# more: the rounding decision is taken on x/d + 2.5 with an error under 2^-21, so the chosen
# level is within |d|·(1/2 + 2^-21) of x (exactly half is the ideal round-to-nearest).
Q2_0_DECISION_SLACK = 2.0**-21
# A float32 dot product of length n: |error| <= n·u·sum|w_i x_i| (the classical gamma_n bound),
# plus, per term, one underflow (flush-to-zero BLAS may drop a product below float32's tiny).
F32_UNDERFLOW = float(np.finfo(np.float32).tiny)
# Dequantizations that must agree exactly (every value is a float16 scale times a small integer,
# which float32 holds exactly): gguf's and MLX's twins, and the float round trips.
EXACT = dict(rtol=0, atol=0)

GGUF_TYPE = {
    QuantType.F32: gguf.GGMLQuantizationType.F32,
    QuantType.F16: gguf.GGMLQuantizationType.F16,
    QuantType.Q8_0: gguf.GGMLQuantizationType.Q8_0,
    QuantType.Q4_0: gguf.GGMLQuantizationType.Q4_0,
}
GGML_QUANTS = [QuantType.Q8_0, QuantType.Q4_0]
# the properties below draw matrices in blocks of 32; MLX's group-64 types get the same ones in
# tests/mlx_backend/test_mlx_quants.py
ALL_TYPES = [q for q in QUANTIZABLE if layout(q).block_size <= 32]

# ggml's rule is undefined when 1/d overflows float32 (|d| < ~2^-128: a block of tiny
# subnormals): x·inf is ±inf or NaN and C casts it to an int. numpy warns and gguf's port casts
# before it clips, so those bytes are platform-defined; the tests compare such blocks by value
# (the float16 scale is 0, so every value is 0) and silence numpy's warnings about them.
ignore_degenerate_scale_warnings = pytest.mark.filterwarnings(
    "ignore:overflow encountered in divide:RuntimeWarning",
    "ignore:invalid value encountered:RuntimeWarning",
)
# one row: a degenerate block for every type (|m| = 4e-39: 1/d overflows), then an ordinary one
DEGENERATE_ROW = np.zeros((1, 64), np.float32)
DEGENERATE_ROW[0, :4] = [4e-39, -1e-39, 2e-39, 1e-45]
DEGENERATE_ROW[0, 32:] = np.linspace(-3.0, 2.0, 32)


def _blocks32(a: np.ndarray) -> np.ndarray:
    return a.reshape(a.shape[0], -1, 32)  # [R, B, 32]


def _float32_scale(w: np.ndarray, qtype: QuantType) -> np.ndarray:
    """The block scale d as the quantizer computes it, in float32, written out per block. [R, B]"""
    b = _blocks32(w)
    if qtype is QuantType.Q8_0:
        return (np.abs(b).max(axis=-1) / np.float32(127)).astype(np.float32)
    first = np.abs(b).argmax(axis=-1)[..., None]  # the value of largest magnitude, first on ties
    m = np.take_along_axis(b, first, axis=-1)[..., 0]
    return (m / np.float32(-8 if qtype is QuantType.Q4_0 else -2)).astype(np.float32)


def _degenerate(w: np.ndarray, qtype: QuantType) -> np.ndarray:
    """Blocks whose 1/d overflows float32. [R, B] bool"""
    d = _float32_scale(w, qtype)
    with np.errstate(divide="ignore", over="ignore"):
        return (d != 0) & ~np.isfinite(np.float32(1) / d)


# ---------------------------------------------------------------- Q2_0 invariants


@ignore_degenerate_scale_warnings
@given(w=float_matrices())
@example(w=DEGENERATE_ROW)
def test_q2_0_error_is_at_most_half_a_step_in_range(w):
    """|x - deq| <= |d|·(1/2 + slack) + 2·|d - fp16(d)| for every x in [min level, max level].

    d is the float32 scale the codes were chosen with; the codes are then applied with the
    stored fp16(d), which moves a level d·(q-2), |q-2| <= 2, by at most 2·|d - fp16(d)|
    (<= 2^-10·|d| where fp16(d) is normal; the measured term also covers subnormals).
    """
    m = quantize(QuantType.Q2_0, w)
    d32 = _float32_scale(w, QuantType.Q2_0).astype(np.float64)[..., None]  # [R, B, 1]
    d16 = m.scales.astype(np.float64)[..., None]
    assert m.scales.tobytes() == d32[..., 0].astype(np.float16).tobytes()  # stored = fp16(d)
    x = _blocks32(w).astype(np.float64)
    err = np.abs(x - _blocks32(dequantize(m)).astype(np.float64))
    in_range = (x >= np.minimum(-2 * d32, d32)) & (x <= np.maximum(-2 * d32, d32))
    bound = np.abs(d32) * (0.5 + Q2_0_DECISION_SLACK) + 2 * np.abs(d32 - d16)
    assert np.all(err <= bound, where=in_range)


@ignore_degenerate_scale_warnings
@given(w=float_matrices())
@example(w=DEGENERATE_ROW)
def test_q2_0_block_extreme_comes_back_as_minus_two_fp16_d(w):
    b = _blocks32(w)
    first = np.abs(b).argmax(axis=-1)[..., None]  # [R, B, 1]
    m = np.take_along_axis(b, first, axis=-1)
    want = np.float32(-2) * (m / np.float32(-2)).astype(np.float16).astype(np.float32)
    got = np.take_along_axis(_blocks32(dequantize(quantize(QuantType.Q2_0, w))), first, axis=-1)
    np.testing.assert_allclose(got, want, **EXACT)


# One hand-computed block (d = 0.5: levels -1, -0.5, 0, 0.5), four weights per byte, LSB first.
GOLDEN_Q2_0_VALUES = [
    -1.0, -0.5, 0.0, 0.5,  # q 0 1 2 3                 -> 0b11_10_01_00 = 0xE4
    0.5, 0.0, -0.5, -1.0,  # q 3 2 1 0                 -> 0b00_01_10_11 = 0x1B
    0.3, 0.2, -0.75, 0.25,  # 3.1, 2.9, 1.0, 3.0 -> q 3 2 1 3 (halves round up) -> 0xDB
    0.9, -0.9, -0.6, 0.1,  # 4.3 (clamped), 0.7, 1.3, 2.7 -> q 3 0 1 2    -> 0b10_01_00_11 = 0x93
    0.0, 0.0, 0.0, 0.0,  # q 2 2 2 2                   -> 0xAA
    -1.0, -1.0, -1.0, -1.0,  # q 0 0 0 0               -> 0x00
    0.5, 0.5, 0.5, 0.5,  # q 3 3 3 3                   -> 0xFF
    -0.25, -0.5, 0.0, -1.0,  # 2.0, 1.5, 2.5, 0.5 -> q 2 1 2 0 -> 0b00_10_01_10 = 0x26
]
GOLDEN_Q2_0_CODES = [0xE4, 0x1B, 0xDB, 0x93, 0xAA, 0x00, 0xFF, 0x26]
GOLDEN_Q2_0_DEQUANT = [
    -1.0, -0.5, 0.0, 0.5, 0.5, 0.0, -0.5, -1.0, 0.5, 0.0, -0.5, 0.5, 0.5, -1.0, -0.5, 0.0,
    0.0, 0.0, 0.0, 0.0, -1.0, -1.0, -1.0, -1.0, 0.5, 0.5, 0.5, 0.5, 0.0, -0.5, 0.0, -1.0,
]


@pytest.mark.parametrize("sign, d_bytes", [
    (1.0, [0x00, 0x38]),  # m = -1.0: d = 0.5, float16 0x3800
    (-1.0, [0x00, 0xB8]),  # m = +1.0: d = -0.5, float16 0xB800; x·(1/d) is unchanged: same codes
])
def test_q2_0_golden_block(sign, d_bytes):
    w = sign * np.array([GOLDEN_Q2_0_VALUES], np.float32)
    m = quantize(QuantType.Q2_0, w)
    assert to_blocks(m).tolist() == [d_bytes + GOLDEN_Q2_0_CODES]
    np.testing.assert_allclose(dequantize(m)[0], sign * np.array(GOLDEN_Q2_0_DEQUANT), **EXACT)


# ---------------------------------------------------------------- Q2_0 is MLX's 2-bit affine format


def _mlx_planes(m: QuantMatrix) -> tuple[mx.array, mx.array, mx.array]:
    """Q2_0's planes read as MLX's (w, scales, biases). The scales are widened to float32
    (exactly) so MLX computes in float32: in float16, 3·d would round."""
    scales = mx.array(m.scales.astype(np.float32))
    return mx.array(m.codes.view(np.uint32)), scales, -2 * scales


@ignore_degenerate_scale_warnings
@given(w=float_matrices())
@example(w=DEGENERATE_ROW)
def test_q2_0_planes_dequantize_through_mlx(w):
    m = quantize(QuantType.Q2_0, w)
    out = mx.dequantize(*_mlx_planes(m), group_size=32, bits=2)
    np.testing.assert_allclose(np.array(out), dequantize(m), **EXACT)


fp16_scales = st.floats(min_value=2.0**-10, max_value=64.0, width=16).map(np.float16)


@st.composite
def q2_0_exact_matrices(draw):
    """[R, B*32] float32 of values d·(q-2) exactly, every block holding both -2d and d, so the
    block's extreme is -2d and its range 3·|d|. Returns (w, codes [R, B, 32], d [R, B] float16)."""
    rows, n_blocks = draw(st.integers(1, 4)), draw(st.integers(1, 4))
    codes = draw(hnp.arrays(np.uint8, (rows, n_blocks, 32), elements=st.integers(0, 3)))
    lo, hi = draw(st.lists(st.integers(0, 31), min_size=2, max_size=2, unique=True))
    codes[..., lo], codes[..., hi] = 0, 3
    d = draw(hnp.arrays(np.float16, (rows, n_blocks), elements=fp16_scales))
    d = d * draw(hnp.arrays(np.float16, (rows, n_blocks), elements=st.sampled_from([1.0, -1.0])))
    w = (d.astype(np.float32)[..., None] * (codes.astype(np.float32) - 2)).reshape(rows, -1)
    return w, codes, d


@given(case=q2_0_exact_matrices())
def test_mlx_quantize_packs_exact_values_into_the_same_codes(case):
    w, codes, d = case
    m = quantize(QuantType.Q2_0, w)
    assert codes_of(m).tolist() == codes.reshape(w.shape).tolist()
    assert m.scales.tobytes() == d.tobytes()
    wq, scales, biases = mx.quantize(mx.array(w), group_size=32, bits=2)
    assert np.array(wq).view(np.uint8).tobytes() == m.codes.tobytes()
    np.testing.assert_allclose(np.array(scales), d.astype(np.float32), **EXACT)
    np.testing.assert_allclose(np.array(biases), -2 * d.astype(np.float32), **EXACT)


# ---------------------------------------------------------------- ggml types against gguf


@ignore_degenerate_scale_warnings
@given(w=float_matrices(), qtype=st.sampled_from(GGML_QUANTS))
@example(w=DEGENERATE_ROW, qtype=QuantType.Q8_0)
@example(w=DEGENERATE_ROW, qtype=QuantType.Q4_0)
def test_ggml_quants_are_byte_identical_to_gguf(w, qtype):
    m = quantize(qtype, w)
    ours = to_blocks(m)
    theirs = gguf.quants.quantize(w, GGUF_TYPE[qtype])
    assert theirs.shape == ours.shape
    n_rows, n_blocks = m.scales.shape
    ok = ~_degenerate(w, qtype)  # [R, B]
    lay = layout(qtype)
    assert ours.reshape(n_rows, n_blocks, lay.block_bytes)[ok].tobytes() == \
        theirs.reshape(n_rows, n_blocks, lay.block_bytes)[ok].tobytes()
    assert np.all(m.scales[~ok] == 0)  # degenerate blocks: scale 0, every value 0
    # dequantization: ours and gguf's on the same bytes
    np.testing.assert_allclose(dequantize(m), gguf.quants.dequantize(ours, GGUF_TYPE[qtype]), **EXACT)


@given(w=float_matrices())
def test_float_round_trips(w):
    f32 = quantize(QuantType.F32, w)
    assert dequantize(f32).tobytes() == w.tobytes()
    f16 = quantize(QuantType.F16, w)
    assert dequantize(f16).tobytes() == w.astype(np.float16).astype(np.float32).tobytes()
    for qtype, m in ((QuantType.F32, f32), (QuantType.F16, f16)):
        assert to_blocks(m).tobytes() == gguf.quants.quantize(w, GGUF_TYPE[qtype]).tobytes()


# ---------------------------------------------------------------- block form, GEMV, shapes


@ignore_degenerate_scale_warnings
@given(w=float_matrices(), qtype=st.sampled_from(ALL_TYPES))
def test_blocks_round_trip(w, qtype):
    m = quantize(qtype, w)
    blocks = to_blocks(m)
    assert blocks.dtype == np.uint8 and blocks.shape == (w.shape[0], row_bytes(qtype, w.shape[1]))
    for back in (from_blocks(qtype, w.shape[1], blocks), from_blocks(qtype, w.shape[1], blocks.ravel())):
        assert back.shape == m.shape
        assert back.codes.tobytes() == m.codes.tobytes() and back.scales.tobytes() == m.scales.tobytes()


@ignore_degenerate_scale_warnings
@given(w=float_matrices(), qtype=st.sampled_from(ALL_TYPES), n_tokens=st.integers(0, 3), data=st.data())
def test_gemv_is_the_dequantized_product(w, qtype, n_tokens, data):
    m = quantize(qtype, w)
    shape = (w.shape[1],) if n_tokens == 0 else (n_tokens, w.shape[1])
    x = data.draw(hnp.arrays(np.float32, shape, elements=finite_f32))
    y = gemv(m, x)
    wd = dequantize(m).astype(np.float64)
    assert y.dtype == np.float32 and y.shape == shape[:-1] + (w.shape[0],)
    err = np.abs(y - x.astype(np.float64) @ wd.T)
    n = w.shape[1]
    assert np.all(err <= n * (F32_UNIT_ROUNDOFF * (np.abs(x).astype(np.float64) @ np.abs(wd).T) + F32_UNDERFLOW))


@pytest.mark.parametrize("qtype", ALL_TYPES)
def test_bad_shapes_raise_value_error(qtype):
    ragged = 33 if layout(qtype).block_size > 1 else None
    m = quantize(qtype, np.zeros((2, 64), np.float32))
    bad_calls = [
        lambda: quantize(qtype, np.zeros(64, np.float32)),
        lambda: quantize(qtype, np.zeros((2, 2, 64), np.float32)),
        lambda: gemv(m, np.zeros(32, np.float32)),
        lambda: gemv(m, np.zeros((3, 65), np.float32)),
        lambda: from_blocks(qtype, 64, np.zeros(row_bytes(qtype, 64) + 1, np.uint8)),
        lambda: QuantMatrix(qtype, 2, 64, m.codes[:, :-1], m.scales),
        lambda: QuantMatrix(qtype, 2, 64, m.codes.astype(np.int16), m.scales),
        lambda: QuantMatrix(qtype, 2, 64, m.codes, np.zeros((2, 5), np.float32)),
    ]
    if ragged is not None:
        bad_calls += [
            lambda: quantize(qtype, np.zeros((2, ragged), np.float32)),
            lambda: from_blocks(qtype, ragged, np.zeros(20, np.uint8)),
            lambda: row_bytes(qtype, ragged),
        ]
    else:
        bad_calls.append(lambda: codes_of(m))  # float types have no codes
    for call in bad_calls:
        with pytest.raises(ValueError):
            call()


# what each stored type's plane holds for "not a number": f16 NaN, bfloat16 NaN bits, e8m0's NaN
_NAN_WORD = {np.dtype("<f2"): np.float16(np.nan), np.dtype("<u2"): np.uint16(0x7FC0), np.dtype(np.uint8): np.uint8(255)}


@pytest.mark.parametrize("qtype", QUANTIZABLE, ids=lambda q: q.name)
def test_non_finite_reads_each_stored_type_from_its_planes(qtype):
    """QuantMatrix.non_finite (convert's pass-through check) agrees with dequantizing: a block
    whose scale (or bias) is NaN is block_size non-finite weights; a clean matrix has none. (The
    ggml block types strata keeps but does not make: tests/reference/test_ggml_quants.py.)"""
    w = np.random.default_rng(1).standard_normal((3, 64)).astype(np.float32)
    m = quantize(qtype, w)
    assert m.non_finite() == 0
    lay = layout(qtype)
    if lay.scale_bytes:
        plane = m.biases if m.biases is not None else m.scales
        plane[1, 0] = _NAN_WORD[plane.dtype]
        want = lay.block_size
    else:
        m.codes.view("<f4" if qtype is QuantType.F32 else "<f2")[2, 5] = np.inf
        want = 1
    assert m.non_finite() == want
    with np.errstate(all="ignore"):  # e8m0's 255 widens through an overflow
        assert int(np.count_nonzero(~np.isfinite(dequantize(m)))) == want
