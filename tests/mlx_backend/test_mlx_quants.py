"""MLX's own weight formats (the affine types of mlx-lm checkpoints, MXFP4): the reference
quantizer against `mx.quantize` byte for byte, the reference dequantization against
`mx.dequantize`, the block and record forms, and the MLX twins (dequantize, gemv, the
`gather_qmm` expert path) against the reference."""

from __future__ import annotations

import mlx.core as mx
import numpy as np
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st
from hypothesis.extra import numpy as hnp

from mlx_agree import assert_backends_agree, examples
from strata.formats import mxfp4
from strata.formats.expert_record import ExpertWeights, RecordLayout, pack_record, unpack_record
from strata.formats.mlx_affine import AFFINE_SPECS, affine_type, bf16_to_f32, f32_to_bf16
from strata.formats.quant_types import QuantType, layout, row_bytes
from strata.mlx_backend import experts as mlx_experts
from strata.mlx_backend import quants as mlx_quants
from strata.mlx_backend.kernels.launch import KernelPath, using_path
from strata.reference.experts import routed_experts
from strata.reference.quants import codes_of, dequantize, from_blocks, gemv, quantize, to_blocks
from strategies import finite_f32

MLX_TYPES = [*AFFINE_SPECS, QuantType.MXFP4]
# MLX 0.32's CPU MXFP4 quantizer gives blocks whose max|w| / 6 is below float32's normal range
# (max|w| < ~7e-38) an e8m0 of 253-255 (an infinite or NaN scale: seen 2.8e-39 -> 253, 1e-38 ->
# 255); the reference clamps the exponent instead. Such blocks are compared by the reference's
# own invariant only (test_mxfp4_values_on_the_grid_come_back_exactly covers e down to 100).
MXFP4_MLX_SMALLEST = 2.0**-123
ids = lambda q: q.name  # noqa: E731


def _mx_dtype(qtype: QuantType):
    """The float type mlx-lm quantizes from for this type (scales come out in it)."""
    if qtype is QuantType.MXFP4:
        return mx.float32
    return mx.bfloat16 if AFFINE_SPECS[qtype].bfloat16 else mx.float16


def _mx_args(qtype: QuantType) -> dict:
    bits, group, mode = mlx_quants.NATIVE[qtype]
    return dict(group_size=group, bits=bits, mode=mode)


def matrices(qtype: QuantType, max_rows: int = 6, max_blocks: int = 3):
    """[rows, blocks * group] float32 values exactly representable in the type's source dtype."""
    group = layout(qtype).block_size
    dt = _mx_dtype(qtype)
    # float16 sources: within float16's range (|x| <= 1e4 keeps every group's step finite)
    return st.tuples(st.integers(1, max_rows), st.integers(1, max_blocks)).flatmap(
        lambda rb: hnp.arrays(np.float32, (rb[0], rb[1] * group), elements=finite_f32)
    ).map(lambda w: np.array(mx.array(w).astype(dt).astype(mx.float32)))


def _mlx_quantize(qtype: QuantType, w: np.ndarray):
    return mx.quantize(mx.array(w).astype(_mx_dtype(qtype)), **_mx_args(qtype))


def _raw(a: mx.array) -> bytes:
    """An MLX array's bytes (bfloat16 viewed as uint16: numpy has no bfloat16)."""
    return np.array(a.view(mx.uint16) if a.dtype == mx.bfloat16 else a).tobytes()


# ---------------------------------------------------------------- the reference is mx.quantize


@pytest.mark.parametrize("qtype", MLX_TYPES, ids=ids)
def test_quantize_is_mx_quantize_byte_for_byte(qtype):
    @settings(max_examples=examples(40))
    @given(w=matrices(qtype))
    def check(w):
        m = quantize(qtype, w)
        theirs = _mlx_quantize(qtype, w)
        if qtype is QuantType.MXFP4:
            amax = np.abs(w.reshape(w.shape[0], -1, 32)).max(axis=-1)  # [R, B]
            ok = (amax == 0) | (amax >= MXFP4_MLX_SMALLEST)
            codes = np.array(theirs[0]).view(np.uint8).reshape(*ok.shape, 16)
            assert codes[ok].tobytes() == m.codes.reshape(*ok.shape, 16)[ok].tobytes()
            assert np.array(theirs[1])[ok].tobytes() == m.scales[ok].tobytes()
            return
        assert np.array(theirs[0]).view(np.uint8).tobytes() == m.codes.tobytes()
        assert _raw(theirs[1]) == m.scales.tobytes()
        assert _raw(theirs[2]) == m.biases.tobytes()

    check()


@pytest.mark.parametrize("qtype", MLX_TYPES, ids=ids)
def test_dequantize_is_mx_dequantize_in_float32(qtype):
    @settings(max_examples=examples(40))
    @given(w=matrices(qtype))
    def check(w):
        m = quantize(qtype, w)
        wq, *sb = _mlx_quantize(qtype, w)
        if qtype is QuantType.MXFP4:  # the reference's own bytes (see MXFP4_MLX_SMALLEST)
            wq, sb = mx.array(m.codes.view("<u4")), [mx.array(m.scales)]
        if qtype is not QuantType.MXFP4:  # mx.dequantize rounds its output to the scales' dtype
            sb = [a.astype(mx.float32) for a in sb]
        theirs = mx.dequantize(wq, *sb, **_mx_args(qtype)).astype(mx.float32)
        np.testing.assert_array_equal(dequantize(m), np.array(theirs))
        assert_backends_agree(dequantize(m), mlx_quants.dequantize(m), "EXACT", what=qtype.name)

    check()


@st.composite
def mxfp4_exact(draw):
    """[R, B*32] values 2**(e-127) * e2m1(q), each block holding a magnitude-6 value, so the block's
    scale is 2**(e-127) and every value is on the grid. -> (w, codes [R, B*32], e [R, B])"""
    rows, n_blocks = draw(st.integers(1, 4)), draw(st.integers(1, 3))
    codes = draw(hnp.arrays(np.uint8, (rows, n_blocks, 32), elements=st.integers(0, 15)))
    codes[codes == 8] = 0  # -0 is written +0
    codes[..., draw(st.integers(0, 31))] = draw(st.sampled_from([7, 15]))
    e = draw(hnp.arrays(np.uint8, (rows, n_blocks), elements=st.integers(100, 150)))
    w = mxfp4.E2M1_VALUES[codes] * mxfp4.e8m0_to_f32(e)[..., None]
    return w.reshape(rows, -1), codes.reshape(rows, -1), e


@given(case=mxfp4_exact())
def test_mxfp4_values_on_the_grid_come_back_exactly(case):
    w, codes, e = case
    m = quantize(QuantType.MXFP4, w)
    assert codes_of(m).tolist() == codes.tolist()
    assert m.scales.tolist() == e.tolist()
    np.testing.assert_array_equal(dequantize(m), w)


@given(x=hnp.arrays(np.float32, 64, elements=finite_f32))
def test_bfloat16_conversion_is_round_to_nearest_even(x):
    ours = f32_to_bf16(x)
    theirs = np.array(mx.array(x).astype(mx.bfloat16).view(mx.uint16))
    assert ours.tolist() == theirs.tolist()
    np.testing.assert_array_equal(bf16_to_f32(ours), np.array(mx.array(x).astype(mx.bfloat16).astype(mx.float32)))


def test_affine_type_names_mlx_parameters():
    assert affine_type(4, 64, True) is QuantType.A4G64_BF16
    assert affine_type(8, 32, False) is QuantType.A8G32_F16
    with pytest.raises(ValueError, match="bits=3 group_size=64"):
        affine_type(3, 64, True)


# ---------------------------------------------------------------- block and record forms


@pytest.mark.parametrize("qtype", MLX_TYPES, ids=ids)
def test_blocks_round_trip(qtype):
    @settings(max_examples=examples(20))
    @given(w=matrices(qtype))
    def check(w):
        m = quantize(qtype, w)
        blocks = to_blocks(m)
        assert blocks.shape == (w.shape[0], row_bytes(qtype, w.shape[1]))
        back = from_blocks(qtype, w.shape[1], blocks)
        np.testing.assert_array_equal(dequantize(back), dequantize(m))
        assert back.codes.tobytes() == m.codes.tobytes() and back.scale_plane().tobytes() == m.scale_plane().tobytes()

    check()


def _floats(qtype: QuantType, d: int, f: int, seed: int) -> list[np.ndarray]:
    """gate, up, down float32 weights exactly representable in the type's source dtype."""
    rng = np.random.default_rng(seed)
    mats = [rng.standard_normal(s).astype(np.float32) / np.sqrt(s[1]) for s in ((f, d), (f, d), (d, f))]
    return [np.array(mx.array(a).astype(_mx_dtype(qtype)).astype(mx.float32)) for a in mats]


def _expert(qtype: QuantType, d: int, f: int, seed: int) -> ExpertWeights:
    return ExpertWeights(*(quantize(qtype, a) for a in _floats(qtype, d, f, seed)))


@pytest.mark.parametrize("qtype", MLX_TYPES, ids=ids)
def test_record_planes_are_mlx_arrays_without_repacking(qtype):
    """A record's planes, viewed as MLX arrays (what the ops path and the kernels read), are
    exactly what mx.quantize returns for the same weights."""
    d, f = 128, 64
    w = _expert(qtype, d, f, 1)
    rec = RecordLayout(qtype, d, f)
    records = mx.array(np.frombuffer(pack_record(w, rec), np.uint8).reshape(1, -1))
    stack = mlx_experts.slot_planes(records, rec)
    back = unpack_record(np.array(records[0]), rec)
    for proj, planes, a in zip(("gate", "up", "down"), (stack.gate, stack.up, stack.down), _floats(qtype, d, f, 1)):
        theirs = _mlx_quantize(qtype, a)
        assert _raw(planes[0][0]) == np.array(theirs[0]).tobytes(), proj
        for ours, other in zip(planes[1:], theirs[1:]):
            assert ours is not None and ours.dtype == other.dtype and _raw(ours[0]) == _raw(other), proj
        assert back.projection(proj).scale_plane().tobytes() == w.projection(proj).scale_plane().tobytes()


# ---------------------------------------------------------------- MLX twins (ops path)


@pytest.mark.parametrize("qtype", MLX_TYPES, ids=ids)
def test_gemv_twin_agrees_with_reference(qtype):
    rng = np.random.default_rng(int(qtype))
    m = quantize(qtype, rng.standard_normal((48, 2 * layout(qtype).block_size)).astype(np.float32))
    for x in (rng.standard_normal(m.n_cols), rng.standard_normal((3, m.n_cols))):
        x = x.astype(np.float32)
        assert_backends_agree(gemv(m, x), mlx_quants.gemv(m, x), "FAST", what=qtype.name)


@pytest.mark.parametrize("qtype", MLX_TYPES, ids=ids)
def test_routed_experts_gather_qmm_agrees_with_reference(qtype):
    """The routed step over arena records on MLX's gather_qmm (the ops path) vs the reference."""
    d, f, k = 128, 64, 3
    experts = [_expert(qtype, d, f, 10 + i) for i in range(k)]
    rng = np.random.default_rng(5)
    x = rng.standard_normal(d).astype(np.float32)
    weights = rng.dirichlet(np.ones(k)).astype(np.float32)
    with using_path(KernelPath.OPS):
        fast = mlx_experts.routed_experts(experts, weights, x)
    assert_backends_agree(routed_experts(experts, weights, x), fast, "FAST", what=qtype.name)
