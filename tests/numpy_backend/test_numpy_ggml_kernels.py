"""The compiled CPU kernels of llama.cpp's block types (Q4_K, Q5_K, Q6_K, Q3_K, Q2_K, IQ4_NL, IQ4_XS,
MXFP4, Q5_1; native/quant_gemv.c's second half) against the reference: dequantize with
strata.reference.ggml_quants (held bit for bit to gguf's), then a float32 product. Each within FAST
(tests/budgets.py): x stays float32 and the weights are the reference's exactly, so only the order
of float32 sums differs (the offsets of Q4_K / Q5_K / Q2_K / Q5_1 multiply x's 16-weight sums, a
reordering of the same terms). Random blocks with edge scales, in the native and the portable
build; the fused experts with mixed projection types; the engines on these types by default."""

from __future__ import annotations

import numpy as np
import pytest

import strata
from engine_kinds import EXACT0, open_kind
from strata.formats import ggml_blocks
from strata.formats.dense_weights import DenseWeights, StoredTensor, StoredType
from strata.formats.expert_record import ExpertWeights
from strata.formats.quant_types import QuantType, ggml_block_name, layout
from strata.numpy_backend import native_build, quant_kernels
from strata.reference import experts as ref_experts
from strata.reference.quants import gemv
from strata.testing.ggml_random import random_block_matrix
from strata.testing.models import make_model
from tests.mlx_agree import assert_backends_agree

needs_compiler = pytest.mark.skipif(native_build.library() is None, reason=native_build.reason() or "no build")

BLOCK_TYPES = [QuantType.Q4_K, QuantType.Q5_K, QuantType.Q6_K, QuantType.Q3_K, QuantType.Q2_K, QuantType.IQ4_NL,
               QuantType.IQ4_XS, QuantType.GGML_MXFP4, QuantType.Q5_1]
FLOAT16_SCALES = ("d", "dmin", "m")
# rows with odd scales (see _matrix); compared each on its own, the rest together
ZERO, SUBNORMAL, NEGATIVE, LARGE = 0, 1, 2, -1
SPECIAL_ROWS = (ZERO, SUBNORMAL, NEGATIVE, LARGE)


def _shapes(qtype):
    """(rows, cols): odd row counts (not multiples of the threads or of 4 tokens), whole blocks"""
    block = layout(qtype).block_size
    return [(5, block), (257, 2 * block if block > 32 else 96), (96, 768)]


def _matrix(rng, qtype, rows, cols):
    """Random blocks (values' rms ~ 1/sqrt(cols)) with four odd rows: the first block all-zero
    scales (d = dmin = m = 0; MXFP4 the smallest exponent, e = 0); every float16 d subnormal
    (MXFP4 e = 1: a subnormal float32 scale); negative d; the last block 1e4 times larger
    (MXFP4: 2^13)."""
    m = random_block_matrix(qtype, rows, cols, rng, rms=1.0 / np.sqrt(cols))
    blocks = ggml_blocks.view_blocks(ggml_block_name(qtype), m.codes).reshape(rows, -1)  # a view of m.codes
    if qtype is QuantType.GGML_MXFP4:
        e = blocks["e"]  # field first: a view that writes through to m.codes
        e[ZERO, 0], e[SUBNORMAL] = 0, 1
        e[LARGE, -1] += 13
        return m
    fields = [f for f in FLOAT16_SCALES if f in blocks.dtype.names]
    tiny = np.float32(3e-5) / np.abs(blocks["d"][SUBNORMAL].astype(np.float32)).max()  # d below 2^-14: subnormal
    for f in fields:
        v = blocks[f]  # field first: a view that writes through to m.codes
        v[ZERO, 0] = 0.0
        v[SUBNORMAL] = v[SUBNORMAL].astype(np.float32) * tiny
        v[LARGE, -1] = v[LARGE, -1].astype(np.float32) * np.float32(1e4)
    blocks["d"][NEGATIVE] = -blocks["d"][NEGATIVE]
    sub = blocks[SUBNORMAL]["d"].view(np.uint16)
    assert ((sub & 0x7C00) == 0).all() and (sub & 0x3FF).any()  # subnormal indeed
    return m


def _agree(ref, got, what):
    assert got.shape == ref.shape and got.dtype == ref.dtype, f"{what}: {got.shape} {got.dtype}"
    for i in SPECIAL_ROWS:
        assert_backends_agree(ref[..., i], got[..., i], "FAST", what=f"{what} row {i}")
    assert_backends_agree(ref[..., 3:-1], got[..., 3:-1], "FAST", what=f"{what} other rows")


@pytest.fixture(scope="module")
def portable_library():
    """The kernels built for the target's baseline (x86-64: SSE2, no AVX2): the portable C loops."""
    lib, why = native_build.build((native_build.PORTABLE_FLAGS,))
    if lib is None:
        pytest.skip(why)
    return lib


def test_every_block_type_has_a_kernel_and_the_engines_use_it():
    assert set(BLOCK_TYPES) <= set(quant_kernels.KERNELS)
    assert set(BLOCK_TYPES) <= quant_kernels.COMPILED_TYPES


@needs_compiler
@pytest.mark.parametrize("qtype", BLOCK_TYPES, ids=lambda q: q.name)
@pytest.mark.parametrize("build", ["native", "portable"])
def test_block_kernel_agrees_with_the_reference(qtype, build, portable_library):
    lib = native_build.library() if build == "native" else portable_library
    fn = getattr(lib, quant_kernels.KERNELS[qtype])
    rng = np.random.default_rng(int(qtype))
    for rows, cols in _shapes(qtype):
        m = _matrix(rng, qtype, rows, cols)
        for x in (rng.standard_normal(cols).astype(np.float32), rng.standard_normal((6, cols)).astype(np.float32)):
            want = gemv(m, x)
            assert np.isfinite(want).all()
            got = quant_kernels.run_kernel(fn, m.codes, m.scales, m.n_rows, m.n_cols, x)
            _agree(want, got, f"{qtype.name} {build} {rows}x{cols} x{x.shape}")


@needs_compiler
@pytest.mark.parametrize("qtype", [QuantType.Q4_K, QuantType.GGML_MXFP4], ids=lambda q: q.name)
def test_block_gemv_twin_threads_and_long_prompts(qtype, monkeypatch):
    """quant_kernels.gemv takes these types: split over threads bit for bit the one-thread
    result; up to max_compiled_rows (64 for the block types, whose widening costs more than
    Q8_0's) on the kernel, more the reference's product."""
    rng = np.random.default_rng(11)
    m = random_block_matrix(qtype, 1031, 1024, rng)  # above PARALLEL_MIN_WEIGHTS
    x = rng.standard_normal((2, 1024)).astype(np.float32)
    _agree(gemv(m, x), quant_kernels.gemv(m, x), qtype.name)
    np.testing.assert_array_equal(quant_kernels.gemv(m, x, threads=3), quant_kernels.gemv(m, x))
    most = quant_kernels.max_compiled_rows(qtype)
    assert most == quant_kernels.MAX_COMPILED_ROWS_BLOCKS > quant_kernels.MAX_COMPILED_ROWS
    calls = []
    run = quant_kernels.run_kernel
    monkeypatch.setattr(quant_kernels, "run_kernel", lambda *a, **k: calls.append(1) or run(*a, **k))
    at_most = rng.standard_normal((most, 1024)).astype(np.float32)
    assert_backends_agree(gemv(m, at_most), quant_kernels.gemv(m, at_most), "FAST", what=f"{qtype.name} {most} rows")
    assert calls == [1]
    long = rng.standard_normal((most + 1, 1024)).astype(np.float32)
    np.testing.assert_array_equal(quant_kernels.gemv(m, long), gemv(m, long))
    assert calls == [1]


def _expert(rng, gate, up, down, hidden=256, ffn=512):
    return ExpertWeights(gate=random_block_matrix(gate, ffn, hidden, rng, rms=hidden ** -0.5),
                         up=random_block_matrix(up, ffn, hidden, rng, rms=hidden ** -0.5),
                         down=random_block_matrix(down, hidden, ffn, rng, rms=ffn ** -0.5))


@needs_compiler
@pytest.mark.parametrize("types", [(QuantType.Q4_K,) * 3, (QuantType.Q4_K, QuantType.Q4_K, QuantType.Q5_1),
                                   (QuantType.IQ3_S, QuantType.IQ3_S, QuantType.IQ4_NL)],
                         ids=["Q4_K", "Q4_K-Q5_1-down", "IQ3_S-no-kernel"])
@pytest.mark.parametrize("threads", [1, 3])
def test_expert_stack_with_mixed_projection_types(types, threads):
    """A llama.cpp file's experts (Q4_K gate and up, a Q5_1 down) in one fused call, within FAST
    of the reference's swiglu_expert; a projection type without a kernel (IQ3_S) expert by
    expert, its compiled projections still compiled."""
    rng = np.random.default_rng(12)
    ws = [_expert(rng, *types) for _ in range(5)]
    x = rng.standard_normal(256).astype(np.float32)
    got = quant_kernels.expert_stack(ws, x, threads=threads)
    assert got.shape == (5, 256) and got.dtype == np.float32
    for i, w in enumerate(ws):
        assert_backends_agree(ref_experts.swiglu_expert(w, x), got[i], "FAST", what=f"{types} expert {i}")
    np.testing.assert_array_equal(got, quant_kernels.expert_stack(ws, x))


@needs_compiler
@pytest.mark.parametrize("build", ["native", "portable"])
def test_fused_kernel_of_every_type_in_both_builds(build, portable_library):
    lib = native_build.library() if build == "native" else portable_library
    rng = np.random.default_rng(13)
    x = rng.standard_normal(256).astype(np.float32)
    for qtype in BLOCK_TYPES:
        ws = [_expert(rng, qtype, qtype, qtype) for _ in range(2)]
        got = quant_kernels.run_stack_kernel(quant_kernels.stack_kernel(lib, qtype, qtype, qtype), ws, x)
        for i, w in enumerate(ws):
            assert_backends_agree(ref_experts.swiglu_expert(w, x), got[i], "FAST", what=f"{qtype.name} {build} {i}")


GREEDY_TOKENS = 16


@pytest.fixture(scope="module", params=[QuantType.Q4_K, QuantType.Q6_K, QuantType.GGML_MXFP4, QuantType.Q5_1],
                ids=lambda q: q.name)
def block_model(request, tmp_path_factory):
    """The tiny made model at K-quant widths (hidden and expert ffn 256), experts of the type, dense Q8_0."""
    return make_model(tmp_path_factory.mktemp(request.param.name) / "m", "tiny", seed=5, expert_type=request.param,
                      dense_type=QuantType.Q8_0, hidden_size=256, expert_ffn_size=256, n_heads=4, head_dim=64)


@needs_compiler
@pytest.mark.parametrize("kind", ["reference", "numpy-min"])
def test_engine_on_block_kernels_matches_the_reference(block_model, kind):
    """By default (cpu_kernels on) the engines compute these experts on the compiled kernels, not
    numpy's (the streaming report names no slow type): prefill, then greedy decodes on both, the
    same tokens, every step's logits within FORWARD."""
    with strata.load(block_model.model_path) as m:
        engines = [open_kind(m, kind, EXACT0.replace(cpu_kernels=on)) for on in (False, True)]
        try:
            assert [e.ops.compiled if kind == "reference" else e.compute.ops.compiled for e in engines] == [False, True]
            prompt = np.frombuffer(b"K-quants", np.uint8).astype(np.int64)
            logits = [e.prefill(prompt) for e in engines]
            if kind == "numpy-min":
                assert "numpy's float32 products" not in engines[1].report().io
            for step in range(GREEDY_TOKENS):
                assert_backends_agree(logits[0], logits[1], "FORWARD", what=f"{kind} step {step}")
                tokens = [int(np.argmax(l)) for l in logits]
                assert tokens[0] == tokens[1], f"{kind} step {step}: greedy token {tokens[1]}, reference {tokens[0]}"
                logits = [e.decode(tokens[0]) for e in engines]
        finally:
            for e in engines:
                e.close()


@needs_compiler
@pytest.mark.parametrize("stored", [t for t in StoredType if t.whole_blocks], ids=lambda t: t.name)
def test_compiled_dense_linear_on_block_types(stored, monkeypatch):
    """A dense matrix held as one of llama.cpp's block types (a GGUF's Q6_K head, its attention)
    goes to the kernel, within FAST of DenseWeights' own product (widened with gguf's dequantizer)."""
    rng = np.random.default_rng(14)
    m = _matrix(rng, stored.quant_type, 96, 512)
    dense = DenseWeights({"w": StoredTensor(stored, (96, 512), m.codes)})
    x = rng.standard_normal((3, 512)).astype(np.float32)
    _agree(dense.linear("w", x), quant_kernels.CompiledDense(dense).linear("w", x), stored.name)
    calls = []
    run = quant_kernels.run_kernel
    monkeypatch.setattr(quant_kernels, "run_kernel", lambda *a, **k: calls.append(a[0]) or run(*a, **k))
    quant_kernels.CompiledDense(dense).linear("w", x)
    assert calls == [getattr(native_build.library(), quant_kernels.KERNELS[stored.quant_type])]  # not widened
