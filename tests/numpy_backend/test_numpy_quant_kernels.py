"""The compiled CPU kernels (strata/numpy_backend/quant_kernels.py, native/quant_gemv.c) against
the float32 reference: each twin within FAST (only float32 summation order differs: x stays
float32, no activation quantization), whole-model logits within FORWARD and the same greedy
tokens, and the fallback where no compiler builds them (the reference's products, one warning)."""

from __future__ import annotations

import os
import time
import warnings
from dataclasses import replace

import numpy as np
import pytest

import strata
from engine_kinds import EXACT0, open_kind
from strata.formats.dense_weights import DenseWeights, StoredTensor, StoredType
from strata.formats.quant_types import QuantType, is_whole_blocks
from strata.model_config import ExpertKind
from strata.numpy_backend import native_build, quant_kernels
from strata.numpy_backend.engine import cpu_ops
from strata.reference import experts as ref_experts
from strata.reference.quants import gemv, quantize
from strata.testing.models import SHAPES, make_expert, make_model
from tests.mlx_agree import assert_backends_agree

needs_compiler = pytest.mark.skipif(native_build.library() is None, reason=native_build.reason() or "no build")

# strata's two-plane types (llama.cpp's block types: test_numpy_ggml_kernels.py)
PLANE_TYPES = [q for q in quant_kernels.KERNELS if not is_whole_blocks(q)]
SHAPES_RC = [(32, 64), (768, 2048), (2048, 768), (257, 96)]
GREEDY_TOKENS = 32


def _matrix(rng, rows, cols, qtype=QuantType.Q8_0):
    """Random weights with three odd rows (SPECIAL_ROWS): a block of zeros (d = 0), a row whose
    float16 scales are subnormal (Q8_0, Q4_0: the portable build widens them by hand), a block
    far larger than the rest."""
    w = rng.standard_normal((rows, cols)).astype(np.float32) / np.sqrt(cols)
    w[0, :32] = 0.0
    w[1] *= 1e-3
    w[-1, -32:] *= 1e4
    return quantize(qtype, w)


SPECIAL_ROWS = (0, 1, -1)


def _agree(ref, got, what):
    """FAST on each odd row alone and on the others together (a row 1e4 larger would hide the
    rest's errors in one max-relative comparison). ref, got [.., R]"""
    assert got.shape == ref.shape and got.dtype == ref.dtype, f"{what}: {got.shape} {got.dtype}"
    for i in SPECIAL_ROWS:
        assert_backends_agree(ref[..., i], got[..., i], "FAST", what=f"{what} row {i}")
    assert_backends_agree(ref[..., 2:-1], got[..., 2:-1], "FAST", what=f"{what} other rows")


@needs_compiler
@pytest.mark.parametrize("rows,cols", SHAPES_RC)
@pytest.mark.parametrize("tokens", [None, 1, 3, 6])  # 6: a pass of 4 rows, then 2
def test_gemv_twin_agrees(rows, cols, tokens):
    rng = np.random.default_rng([rows, cols])
    m = _matrix(rng, rows, cols)
    x = rng.standard_normal(cols if tokens is None else (tokens, cols)).astype(np.float32)
    _agree(gemv(m, x), quant_kernels.gemv(m, x), f"gemv {rows}x{cols} x{x.shape}")


@pytest.fixture(scope="module")
def portable_library():
    """The kernels built for the target's baseline (x86-64: SSE2, no AVX2): the portable C loops
    an arm64 or older x86 machine compiles."""
    lib, why = native_build.build((native_build.PORTABLE_FLAGS,))
    if lib is None:
        pytest.skip(why)
    return lib


@needs_compiler
@pytest.mark.parametrize("qtype", PLANE_TYPES, ids=lambda q: q.name)
@pytest.mark.parametrize("build", ["native", "portable"])
def test_every_kernel_agrees(qtype, build, portable_library):
    """Every type's kernel (Q4_0 and Q2_0 too, which the engines do not use yet), in the
    machine's own build and the portable one, on odd sizes, one and several rows."""
    lib = native_build.library() if build == "native" else portable_library
    fn = getattr(lib, quant_kernels.KERNELS[qtype])
    rng = np.random.default_rng(7)
    for rows, cols in SHAPES_RC:
        m = _matrix(rng, rows, cols, qtype)
        for x in (rng.standard_normal(cols).astype(np.float32), rng.standard_normal((6, cols)).astype(np.float32)):
            got = quant_kernels.run_kernel(fn, m.codes, m.scales, m.n_rows, m.n_cols, x)
            _agree(gemv(m, x), got, f"{qtype.name} {build} {rows}x{cols} x{x.shape}")


@needs_compiler
@pytest.mark.parametrize("threads", [2, 3])
def test_threaded_products_equal_one_threads(threads):
    """Rows split over threads: each row's arithmetic is unchanged, so bit for bit."""
    rng = np.random.default_rng(8)
    m = _matrix(rng, 1031, 1024)  # above PARALLEL_MIN_WEIGHTS, rows not a multiple of the threads
    assert m.n_rows * m.n_cols >= quant_kernels.PARALLEL_MIN_WEIGHTS
    x = rng.standard_normal((2, 1024)).astype(np.float32)
    np.testing.assert_array_equal(quant_kernels.gemv(m, x, threads=threads), quant_kernels.gemv(m, x))


@needs_compiler
@pytest.mark.skipif(not hasattr(os, "fork"), reason="no fork here")
def test_threaded_products_run_in_a_forked_child():
    """A child forked after the library's workers started has none of them: its threaded
    product is still right and returns (the caller claims the chunks no worker takes; a fixed
    share per thread would wait forever for the parent's workers)."""
    rng = np.random.default_rng(11)
    m = _matrix(rng, 1031, 1024)
    x = rng.standard_normal(1024).astype(np.float32)
    want = quant_kernels.gemv(m, x, threads=2)  # the workers start here, in the parent
    pid = os.fork()
    if pid == 0:  # the child: exit status 0 only if its threaded product is the parent's
        ok = False
        try:
            ok = np.array_equal(quant_kernels.gemv(m, x, threads=2), want)
        finally:
            os._exit(0 if ok else 1)
    deadline = time.monotonic() + 60
    while time.monotonic() < deadline:
        done, status = os.waitpid(pid, os.WNOHANG)
        if done:
            assert os.waitstatus_to_exitcode(status) == 0
            return
        time.sleep(0.05)
    os.kill(pid, 9)
    os.waitpid(pid, 0)
    raise AssertionError("the forked child's threaded product hung")


@needs_compiler
def test_gemv_over_many_rows_is_the_reference():
    """A prompt's product (more than MAX_COMPILED_ROWS rows) is the reference's, bit for bit."""
    rng = np.random.default_rng(1)
    m = _matrix(rng, 64, 128)
    x = rng.standard_normal((quant_kernels.MAX_COMPILED_ROWS + 1, 128)).astype(np.float32)
    np.testing.assert_array_equal(quant_kernels.gemv(m, x), gemv(m, x))


def test_a_type_without_a_kernel_is_the_reference():
    rng = np.random.default_rng(2)
    m = _matrix(rng, 64, 128, QuantType.A4G64_F16)  # MLX's affine 4-bit: no compiled kernel
    x = rng.standard_normal(128).astype(np.float32)
    assert m.qtype not in quant_kernels.COMPILED_TYPES
    np.testing.assert_array_equal(quant_kernels.gemv(m, x), gemv(m, x))


@needs_compiler
@pytest.mark.parametrize("shape", ["tiny", "gpt-oss"])  # SwiGLU; the clamped SwiGLU with biases
def test_swiglu_expert_twin_agrees(shape):
    cfg = replace(SHAPES[shape], hidden_size=256, expert_ffn_size=128)
    w = make_expert(cfg, 0, 0, 3, QuantType.Q8_0)
    act = ref_experts.expert_act(cfg)
    assert (w.biases is not None) == (cfg.gpt_oss.expert_kind is ExpertKind.CLAMPED_SWIGLU)
    x = np.random.default_rng(3).standard_normal(256).astype(np.float32)
    assert_backends_agree(ref_experts.swiglu_expert(w, x, act), quant_kernels.swiglu_expert(w, x, act), "FAST",
                          what=shape)


@needs_compiler
@pytest.mark.parametrize("qtype", [QuantType.Q8_0, QuantType.Q2_0], ids=lambda q: q.name)  # fused; per expert
@pytest.mark.parametrize("threads", [1, 3])
def test_expert_stack_agrees(qtype, threads):
    """One token's experts in one call: each row within FAST of the reference's swiglu_expert
    (the fused kernel for a compiled type, its own products otherwise), any thread count alike."""
    cfg = replace(SHAPES["tiny"], hidden_size=256, expert_ffn_size=96)
    ws = [make_expert(cfg, 0, 0, e, qtype) for e in range(5)]
    x = np.random.default_rng(9).standard_normal(256).astype(np.float32)
    got = quant_kernels.expert_stack(ws, x, threads=threads)
    assert got.shape == (5, 256) and got.dtype == np.float32
    for i, w in enumerate(ws):
        assert_backends_agree(ref_experts.swiglu_expert(w, x), got[i], "FAST", what=f"{qtype.name} expert {i}")
    np.testing.assert_array_equal(got, quant_kernels.expert_stack(ws, x))


@needs_compiler
@pytest.mark.parametrize("qtype", PLANE_TYPES, ids=lambda q: q.name)
@pytest.mark.parametrize("build", ["native", "portable"])
def test_every_fused_experts_kernel_agrees(qtype, build, portable_library):
    lib = native_build.library() if build == "native" else portable_library
    cfg = replace(SHAPES["tiny"], hidden_size=128, expert_ffn_size=64)
    ws = [make_expert(cfg, 1, 0, e, qtype) for e in range(3)]
    x = np.random.default_rng(10).standard_normal(128).astype(np.float32)
    fn = quant_kernels.stack_kernel(lib, qtype, qtype, qtype)
    got = quant_kernels.run_stack_kernel(fn, ws, x)
    for i, w in enumerate(ws):
        assert_backends_agree(ref_experts.swiglu_expert(w, x), got[i], "FAST", what=f"{qtype.name} {build} expert {i}")
    # split over the library's workers in the same call: each expert's arithmetic unchanged
    np.testing.assert_array_equal(quant_kernels.run_stack_kernel(fn, ws, x, threads=2), got)


@needs_compiler
def test_compiled_dense_linear_agrees():
    """Q8_0 matrices on the kernel within FAST; other stored types and float32 arrays are
    DenseWeights' own product, bit for bit."""
    rng = np.random.default_rng(4)
    q = _matrix(rng, 96, 256)
    f16 = rng.standard_normal((96, 256)).astype(np.float16)
    held = {"q8": StoredTensor(StoredType.Q8_0, (96, 256), q.codes.view(np.int8), q.scales),
            "f16": StoredTensor(StoredType.F16, (96, 256), f16),
            "f32": rng.standard_normal((96, 256)).astype(np.float32)}
    ref, fast = DenseWeights(held), quant_kernels.CompiledDense(DenseWeights(held))
    x = rng.standard_normal((1, 256)).astype(np.float32)
    _agree(ref.linear("q8", x), fast.linear("q8", x), "q8")
    for name in ("f16", "f32"):
        np.testing.assert_array_equal(fast.linear(name, x), ref.linear(name, x))


@pytest.fixture(scope="module")
def q8_model(tmp_path_factory):
    return make_model(tmp_path_factory.mktemp("q8") / "m", "tiny", seed=5, expert_type=QuantType.Q8_0,
                      dense_type=QuantType.Q8_0)


@pytest.fixture(scope="module", params=[QuantType.Q8_0, QuantType.Q4_0, QuantType.Q2_0], ids=lambda q: q.name)
def typed_model(request, q8_model, tmp_path_factory):
    """The Q8_0 model, or one with Q4_0 / Q2_0 experts (dense Q8_0): each expert type on its kernels."""
    if request.param is QuantType.Q8_0:
        return q8_model
    return make_model(tmp_path_factory.mktemp(request.param.name) / "m", "tiny", seed=5, expert_type=request.param,
                      dense_type=QuantType.Q8_0)


@needs_compiler
@pytest.mark.parametrize("kind", ["reference", "numpy-min"])
def test_engine_on_compiled_kernels_matches_the_reference(typed_model, kind):
    """Prefill, then GREEDY_TOKENS greedy decodes on both: the same tokens, every step's logits
    within FORWARD of the float32 products'."""
    with strata.load(typed_model.model_path) as m:
        engines = [open_kind(m, kind, EXACT0.replace(cpu_kernels=on)) for on in (False, True)]
        try:
            assert [e.ops.compiled if kind == "reference" else e.compute.ops.compiled for e in engines] == [False, True]
            prompt = np.frombuffer(b"The kernels", np.uint8).astype(np.int64)
            logits = [e.prefill(prompt) for e in engines]
            for step in range(GREEDY_TOKENS):
                assert_backends_agree(logits[0], logits[1], "FORWARD", what=f"{kind} step {step}")
                tokens = [int(np.argmax(l)) for l in logits]
                assert tokens[0] == tokens[1], f"{kind} step {step}: greedy token {tokens[1]}, reference {tokens[0]}"
                logits = [e.decode(tokens[0]) for e in engines]
        finally:
            for e in engines:
                e.close()


def test_without_a_compiler_the_engine_warns_and_computes_the_reference(q8_model, monkeypatch, tmp_path):
    monkeypatch.setattr(native_build, "_loaded", {})
    monkeypatch.setenv("PATH", str(tmp_path))  # no cc, gcc or clang on it
    monkeypatch.delenv("CC", raising=False)
    assert native_build.library() is None
    assert "no C compiler" in native_build.reason()
    with pytest.warns(RuntimeWarning, match="compiled CPU kernels unavailable"):
        ops = cpu_ops(EXACT0)
    assert not ops.compiled
    with warnings.catch_warnings():
        warnings.simplefilter("ignore", RuntimeWarning)
        with strata.load(q8_model.model_path) as m:
            got, want = (open_kind(m, "reference", EXACT0.replace(cpu_kernels=on)) for on in (True, False))
            prompt = np.arange(1, 9)
            np.testing.assert_array_equal(got.prefill(prompt), want.prefill(prompt))
            np.testing.assert_array_equal(got.decode(7), want.decode(7))
            got.close(), want.close()


def test_a_failing_build_is_one_line(monkeypatch, tmp_path):
    monkeypatch.setattr(native_build, "_loaded", {})
    monkeypatch.setattr(native_build, "cache_dir", lambda: tmp_path)
    monkeypatch.setenv("CC", "false")  # a "compiler" that always fails
    assert native_build.library() is None
    why = native_build.reason()
    assert why.startswith("false could not build quant_gemv.c") and "\n" not in why


@needs_compiler
@pytest.mark.parametrize("qtype", [QuantType.A4G32_F16, QuantType.Q2_0, QuantType.Q8_0], ids=lambda q: q.name)
def test_a_streaming_report_names_experts_without_a_kernel(tmp_path, qtype):
    made = make_model(tmp_path / "m", "tiny", seed=6, expert_type=qtype)
    with strata.load(made.model_path) as m:
        eng = open_kind(m, "numpy-full")
        try:
            eng.prefill(np.arange(1, 5))
            note = f"{qtype.name} experts on numpy's float32 products"
            assert (note in eng.report().io) == (qtype not in quant_kernels.COMPILED_TYPES)
        finally:
            eng.close()


@needs_compiler
@pytest.mark.parametrize("shape,names", [("hybrid", ("ssm_qkv", "ssm_z", "ssm_beta", "ssm_alpha", "ssm_out")),
                                         ("mla", ("attn_kv_a_mqa", "attn_output"))])
def test_deltanet_and_mla_project_on_the_kernels(tmp_path, monkeypatch, shape, names):
    """The DeltaNet and MLA mixers' Q8_0 projections go through the engine's DenseWeights.linear
    (the compiled kernel), and the engine stays within FORWARD of the float32 products with the
    same greedy tokens."""
    made = make_model(tmp_path / shape, shape, seed=4, expert_type=QuantType.Q8_0, dense_type=QuantType.Q8_0)
    on_kernel: set[str] = set()
    linear = quant_kernels.CompiledDense.linear

    def spy(self, name, x):
        if self.stored_type(name) is StoredType.Q8_0:
            on_kernel.add(name.rsplit(".", 2)[-2])  # blk.L.<name>.weight -> <name>
        return linear(self, name, x)

    monkeypatch.setattr(quant_kernels.CompiledDense, "linear", spy)
    with strata.load(made.model_path) as m:
        engines = [open_kind(m, "reference", EXACT0.replace(cpu_kernels=on)) for on in (False, True)]
        try:
            prompt = np.frombuffer(b"mixers", np.uint8).astype(np.int64)
            logits = [e.prefill(prompt) for e in engines]
            for step in range(4):
                assert_backends_agree(logits[0], logits[1], "FORWARD", what=f"{shape} step {step}")
                token = int(np.argmax(logits[0]))
                assert int(np.argmax(logits[1])) == token
                logits = [e.decode(token) for e in engines]
        finally:
            for e in engines:
                e.close()
    assert set(names) <= on_kernel, f"{shape}: {sorted(set(names) - on_kernel)} not on the kernel"
