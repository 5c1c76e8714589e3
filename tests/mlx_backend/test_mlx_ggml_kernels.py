"""The kernels for llama.cpp's types kept as stored (kernels/ggml_dot.py's decoders; the fused expert
kernel, kernels/moe_ggml.py; the dense GEMV, kernels/ggml_gemv.py) against the numpy reference
(each projection dequantized by strata/reference/ggml_quants.py, then float32 matmuls), on random
blocks of every type with a decoder, one type at a time and mixed per projection as unsloth's
files mix them; and every specialisation that ran compile-checked as Metal and CUDA source.

Emulated (the same bodies on the CPU, CI) at a small size with several super-blocks per row and
several chunks per expert; the `gpu` ids run the same cases where MLX has a GPU.
"""

from __future__ import annotations

import mlx.core as mx
import numpy as np
import pytest

from ggml_random import random_blocks
from mlx_agree import assert_backends_agree
from strata.formats.expert_record import PROJECTIONS, RecordLayout, unpack_record
from strata.formats.quant_types import QuantType, layout
from strata.mlx_backend.kernels import ggml_dot, ggml_gemv, moe_ggml
from strata.mlx_backend.kernels.launch import KernelPath, recording, using_path
from strata.mlx_backend.kernels.preludes import Dialect
from strata.reference.experts import routed_experts
from strata.reference.quants import dequantize, gemv
from strata.reference.routing import RouterRule, route
from strata.model_config import RoutingOrder
from tests.kernel_paths import KERNEL_PATHS

TYPES = list(ggml_dot.TYPES)
# the emulator-only tests carry the id too, so the device run's -k "not emulated" leaves them to CI
EMULATED_ONLY = pytest.mark.parametrize("path", KERNEL_PATHS[:1])
SMALL = (512, 256)  # D: 2 super-blocks a row, 16 groups (a partial lane step); F: 8 chunks of 32
# unsloth's mixes, and llama.cpp's own fallback: (gate, up, down) per record
MIXES = [(QuantType.Q4_K, QuantType.Q4_K, QuantType.Q5_1), (QuantType.IQ4_XS, QuantType.IQ4_XS, QuantType.IQ4_NL),
         (QuantType.Q6_K, QuantType.Q6_K, QuantType.Q8_0), (QuantType.Q3_K, QuantType.Q2_K, QuantType.GGML_MXFP4),
         (QuantType.Q4_K, QuantType.Q4_K, QuantType.Q5_0),  # llama.cpp's fallback for a 576-wide down
         (QuantType.IQ3_S, QuantType.IQ3_S, QuantType.IQ4_NL), (QuantType.IQ2_XXS, QuantType.IQ2_XXS, QuantType.Q4_K)]
N_RECORDS = 6


def random_records(rec: RecordLayout, n: int, seed: int) -> np.ndarray:
    """n arena records of random blocks (finite scales, no edge values: the products stay in
    float32's range). uint8 [n, padded_bytes]"""
    rng = np.random.default_rng(seed)
    out = np.zeros((n, rec.padded_bytes), np.uint8)
    for i in range(n):
        for p, proj in enumerate(PROJECTIONS):
            q = rec.qtype_of(proj)
            rows, cols = rec.shape(proj)
            c, s = rec.codes(proj), rec.scales(proj)
            if q is QuantType.Q8_0:  # two planes: int8 codes, float16 d per 32
                out[i, c.offset:c.end] = rng.integers(0, 256, c.nbytes, dtype=np.uint8)
                d = (rng.standard_normal(s.nbytes // 2) * 0.01).astype(np.float16)
                out[i, s.offset:s.end] = d.view(np.uint8)
            else:
                n_blocks = rows * cols // layout(q).block_size
                out[i, c.offset:c.end] = random_blocks(q, n_blocks, seed * 1000 + 10 * i + p, edges=False)
    return out


def _activations(rng, record: np.ndarray, rec: RecordLayout, tokens: int) -> np.ndarray:
    """x [T, D] scaled so that a gate row's product is of order 1 (the types' scales span
    1e0..1e3 on random blocks: silu would saturate). float32 [T, D]"""
    x = rng.standard_normal((tokens, rec.hidden)).astype(np.float32)
    gate = unpack_record(record, rec).gate
    return (x / np.float32(np.std(gemv(gate, x[0])) + 1e-30)).astype(np.float32)


def _case(rec: RecordLayout, seed: int, k: int = 3, tokens: int = 2):
    rng = np.random.default_rng(seed)
    host = random_records(rec, N_RECORDS, seed)
    slots = np.stack([rng.choice(N_RECORDS, k, replace=False) for _ in range(tokens)]).astype(np.int32)
    slots[0, -1] = -1  # a skipped rank
    weights = rng.random((tokens, k)).astype(np.float32)
    x = _activations(rng, host[0], rec, tokens)
    ref = np.stack([routed_experts([unpack_record(host[s], rec) for s in slots[t] if s >= 0],
                                   weights[t][slots[t] >= 0], x[t]) for t in range(tokens)])
    return host, x, slots, weights, ref


def _layout(types) -> RecordLayout:
    g, u, d = types
    return RecordLayout(g, *SMALL, up_qtype=u, down_qtype=d)


@pytest.mark.parametrize("path", KERNEL_PATHS)
@pytest.mark.parametrize("qtype", TYPES, ids=[q.name for q in TYPES])
def test_fused_ggml_experts_against_reference(path, qtype):
    rec = _layout((qtype,) * 3)
    host, x, slots, weights, ref = _case(rec, seed=int(qtype))
    with using_path(path):
        got = moe_ggml.moe_slots(mx.array(host), rec, mx.array(x), slots, weights)
        assert got.shape == (2, 3 * rec.expert_ffn // moe_ggml.FC, rec.hidden)
        assert_backends_agree(ref, got.sum(axis=1), "GGML_KERNEL", what=f"fused {qtype.name}")


@pytest.mark.parametrize("path", KERNEL_PATHS)
@pytest.mark.parametrize("types", MIXES, ids=["/".join(q.name for q in m) for m in MIXES])
def test_fused_ggml_experts_mixed_per_projection(path, types):
    rec = _layout(types)
    assert rec.mixed
    host, x, slots, weights, ref = _case(rec, seed=sum(map(int, types)))
    with using_path(path):
        got = moe_ggml.moe_slots(mx.array(host), rec, mx.array(x), slots, weights)
        assert_backends_agree(ref, got.sum(axis=1), "GGML_KERNEL", what=f"fused {rec.type_names}")


@EMULATED_ONLY
def test_fused_ggml_experts_partial_batches(path):
    """D = 1280: 40 groups a row (a partial second lane step) and 5 down rows a thread (a full
    batch of DOWN_ROWS, then a partial one)."""
    rec = RecordLayout(QuantType.Q4_K, 1280, 64, up_qtype=QuantType.Q6_K, down_qtype=QuantType.Q5_0)
    assert (rec.hidden + moe_ggml.THREADS - 1) // moe_ggml.THREADS % moe_ggml.DOWN_ROWS
    host, x, slots, weights, ref = _case(rec, seed=5, k=2, tokens=1)
    with using_path(path):
        got = moe_ggml.moe_slots(mx.array(host), rec, mx.array(x), slots, weights)
        assert_backends_agree(ref, got.sum(axis=1), "GGML_KERNEL", what="D=1280")


@pytest.mark.parametrize("path", KERNEL_PATHS)
def test_fused_ggml_experts_routing_on_the_device(path):
    """moe_route: every expert resident at slot_base + e, the softmax rule ranked in the kernel."""
    rec = _layout(MIXES[0])
    host = random_records(rec, N_RECORDS + 1, seed=7)
    rng = np.random.default_rng(7)
    x = _activations(rng, host[0], rec, 2)
    z = rng.standard_normal((2, N_RECORDS)).astype(np.float32)
    rule = RouterRule(k=3, order=RoutingOrder.SOFTMAX_TOPK, norm_topk_prob=True)
    ref = []
    for t in range(2):
        sel = route(z[t], rule)
        ref.append(routed_experts([unpack_record(host[1 + e], rec) for e in sel.experts], sel.weights, x[t]))
    with using_path(path):
        got = moe_ggml.moe_route(mx.array(host), rec, mx.array(x), mx.array(z), 1, 3, rule.order, rule.norm_topk_prob)
        assert_backends_agree(np.stack(ref), got.sum(axis=1), "GGML_KERNEL", what="routed on the device")


def test_supports_names_what_it_cannot_run():
    assert moe_ggml.supports(_layout(MIXES[0])) is None
    assert "IQ2_XS" in moe_ggml.supports(RecordLayout(QuantType.IQ2_XS, *SMALL))
    assert "biases" in moe_ggml.supports(RecordLayout(QuantType.Q4_K, *SMALL, biases=True))


@EMULATED_ONLY
def test_shared_expert_blocks_ride_in_the_ggml_launch(path):
    rec = _layout(MIXES[2])
    host, x, slots, weights, _ = _case(rec, seed=9)
    rng = np.random.default_rng(10)
    fs = 64
    sh = tuple(mx.array((rng.standard_normal(s) / 16).astype(np.float16)) for s in ((fs, rec.hidden),) * 2 + ((rec.hidden, fs),))
    with using_path(path):
        routed, shared = moe_ggml.moe_slots(mx.array(host), rec, mx.array(x), slots, weights, shared=sh)
        alone = moe_ggml.moe_slots(mx.array(host), rec, mx.array(x), slots, weights)
        np.testing.assert_array_equal(np.array(routed), np.array(alone))
        from strata.mlx_backend.kernels import shared as shared_kernel
        np.testing.assert_array_equal(np.array(shared), np.array(shared_kernel.shared_partials(mx.array(x), *sh)))


@EMULATED_ONLY
@pytest.mark.parametrize("dialect", [Dialect.METAL, Dialect.CUDA], ids=["metal", "cuda"])
def test_every_ggml_specialisation_compiles(tmp_path, dialect, path):
    """Metal: compile-checked (g++ against tests/metal_stub), never run here; CUDA likewise."""
    from test_metal_compile import _check

    rec = _layout(MIXES[0])
    host = mx.array(random_records(rec, 2, seed=3))
    x = mx.array(np.ones((1, rec.hidden), np.float32))
    with using_path(KernelPath.EMULATED), recording() as specs:
        for types in [(q,) * 3 for q in TYPES] + MIXES:
            r = _layout(types)
            mx.eval(moe_ggml.moe_slots(mx.array(random_records(r, 2, seed=1)), r, x, np.array([[0, 1, -1]]),
                                       np.ones((1, 3), np.float32)))  # k = 3: the emulator builds of the tests above
        mx.eval(moe_ggml.moe_route(host, rec, x, mx.zeros((1, 2)), 0, 1, RoutingOrder.SOFTMAX_TOPK, True))
        sh = tuple(mx.zeros(s, mx.float16) for s in ((64, rec.hidden),) * 2 + ((rec.hidden, 64),))
        mx.eval(moe_ggml.moe_slots(host, rec, x, np.array([[0]]), np.ones((1, 1), np.float32), shared=sh))
    assert len(specs) >= len(TYPES) + len(MIXES) + 2
    errors = [e for e in (_check(tmp_path, dialect, s) for s in specs) if e]
    assert not errors, "\n\n".join(errors)


# ---------------------------------------------------------------- the dense GEMV

DENSE_TYPES = [QuantType.Q6_K, QuantType.Q5_K, QuantType.Q4_K, QuantType.Q8_0, QuantType.IQ4_XS]


def _dense_case(qtype: QuantType, rows: int, cols: int, seed: int):
    """(w, scales or None, x, the reference's y): rows of random blocks, dequantized by the
    reference, then a float32 matmul."""
    from strata.formats.quant_matrix import QuantMatrix
    from strata.formats.quant_types import row_bytes

    rng = np.random.default_rng(seed)
    lay = layout(qtype)
    if qtype is QuantType.Q8_0:
        codes = rng.integers(0, 256, (rows, cols), dtype=np.uint8)
        d = (rng.standard_normal((rows, cols // 32)) * 0.01).astype(np.float16)
        m = QuantMatrix(qtype, rows, cols, codes, d)
        w, scales = codes, d.view(np.uint8)
    else:
        codes = random_blocks(qtype, rows * cols // lay.block_size, seed, edges=False).reshape(rows, -1)
        assert codes.shape[1] == row_bytes(qtype, cols)
        m = QuantMatrix.from_planes(qtype, rows, cols, codes, np.zeros(0, np.uint8))
        w, scales = codes, None
    x = rng.standard_normal((2, cols)).astype(np.float32)
    x = (x / np.float32(np.std(gemv(m, x[0])) + 1e-30)).astype(np.float32)
    return w, scales, x, np.stack([gemv(m, x[t]) for t in range(2)])


@pytest.mark.parametrize("path", KERNEL_PATHS)
@pytest.mark.parametrize("qtype", DENSE_TYPES, ids=[q.name for q in DENSE_TYPES])
def test_dense_ggml_gemv_against_reference(path, qtype):
    w, scales, x, ref = _dense_case(qtype, 20, 768, seed=int(qtype))  # 20 rows: a partial block of warps
    with using_path(path):
        got = ggml_gemv.ggml_gemv(qtype, mx.array(w), mx.array(x), None if scales is None else mx.array(scales))
        assert_backends_agree(ref, got, "GGML_KERNEL", what=f"GEMV {qtype.name}")


@EMULATED_ONLY
@pytest.mark.parametrize("dialect", [Dialect.METAL, Dialect.CUDA], ids=["metal", "cuda"])
def test_every_dense_gemv_specialisation_compiles(tmp_path, dialect, path):
    from test_metal_compile import _check

    with using_path(KernelPath.EMULATED), recording() as specs:
        for qtype in TYPES:
            w, scales, x, _ = _dense_case(qtype, 8, 256, seed=1)
            mx.eval(ggml_gemv.ggml_gemv(qtype, mx.array(w), mx.array(x), None if scales is None else mx.array(scales)))
    assert len(specs) == len(TYPES)
    errors = [e for e in (_check(tmp_path, dialect, s) for s in specs) if e]
    assert not errors, "\n\n".join(errors)


@pytest.mark.parametrize("qtype", TYPES, ids=[q.name for q in TYPES])
def test_benchmark_records_are_valid_and_finite(qtype):
    """strata.testing.ggml_records (the benchmarks' device-made records): llama.cpp's layout for the
    seed's 576-wide down (its fallback type where rows are not whole super-blocks), finite weights."""
    from strata.testing.ggml_records import LLAMA_FALLBACK, ggml_layout, random_ggml_records

    rec = ggml_layout(qtype, 512, 576)
    assert rec.qtype_of("down") is (qtype if 576 % layout(qtype).block_size == 0 else LLAMA_FALLBACK[qtype])
    host = np.array(random_ggml_records(rec, 4, mx.random.key(int(qtype)), distinct=2))
    np.testing.assert_array_equal(host[0], host[2])
    w = unpack_record(host[1], rec)
    for proj in PROJECTIONS:
        v = dequantize(w.projection(proj))
        assert np.all(np.isfinite(v)) and np.abs(v).max() < 128 and np.abs(v).max() > 0, proj  # |d sc q| <= 0.02 x 127 x 32
