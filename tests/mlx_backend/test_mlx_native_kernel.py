"""The fused routed-expert kernel for MLX's own types (kernels/moe_native.py) against the reference:
each affine type (4 and 8 bits, group 32 and 64, float16 and bfloat16 scales) and MXFP4, both
entries (host slots, routing on the device), both code forms bit for bit against each other, the
block shapes, the shared expert's blocks in the same launch, gpt-oss's biases and clamped SwiGLU,
and the engine choosing the kernel for these records.

Emulated (the same bodies on the CPU, CI) at a medium size: several words per lane, several
chunks per expert, a partial last lane step; marked `gpu` at gpt-oss's expert size where MLX has a GPU.
"""

from __future__ import annotations

from dataclasses import replace

import mlx.core as mx
import numpy as np
import pytest

from mlx_agree import assert_backends_agree
from strata.formats.expert_record import ExpertBiases, ExpertWeights, RecordLayout, pack_record, unpack_record
from strata.formats.quant_types import QuantType
from strata.mlx_backend import experts as mlx_experts
from strata.mlx_backend.kernels import moe, moe_native
from strata.mlx_backend.kernels.launch import LAUNCHES, KernelPath, gpu_dialect, using_path
from strata.mlx_backend.kernels.preludes import Dialect
from strata.mlx_backend.quants import native_refusal
from strata.mlx_backend.routing import route_batch
from strata.model_config import ExpertKind, RoutingOrder
from strata.reference.experts import SWIGLU, ExpertAct, routed_experts
from strata.reference.quants import quantize
from strata.reference.routing import RouterRule
from strata.testing.native_records import random_native_records
from tests.kernel_paths import KERNEL_PATHS

# the emulator-only tests carry the id too, so the device run's -k "not emulated" leaves them to CI
EMULATED_ONLY = pytest.mark.parametrize("path", KERNEL_PATHS[:1])
TYPES = [QuantType.A4G32_F16, QuantType.A4G64_BF16, QuantType.A8G32_BF16, QuantType.A8G64_F16, QuantType.MXFP4]
MEDIUM = (320, 128)  # D: 40 4-bit words per row (a second, partial lane step); F: 4 chunks of 32
GPT_OSS_EXPERT = (2880, 2880)
CLAMPED = ExpertAct(ExpertKind.CLAMPED_SWIGLU, alpha=1.702, limit=7.0)
N_RECORDS = 12


def _expert(rng, qtype: QuantType, d: int, f: int, biases: bool) -> ExpertWeights:
    normal = lambda shape, fan: (rng.standard_normal(shape) / np.sqrt(fan)).astype(np.float32)  # noqa: E731
    b = ExpertBiases(*(0.1 * rng.standard_normal(n).astype(np.float32) for n in (f, f, d))) if biases else None
    return ExpertWeights(quantize(qtype, normal((f, d), d)), quantize(qtype, normal((f, d), d)),
                         quantize(qtype, normal((d, f), f)), b)


def _case(path, qtype: QuantType, seed: int, *, biases: bool = False, act: ExpertAct = SWIGLU, k: int = 4,
          tokens: int = 2):
    d, f = GPT_OSS_EXPERT if path is KernelPath.GPU else MEDIUM
    rec = RecordLayout(qtype, d, f, biases)
    rng = np.random.default_rng(seed)
    if path is KernelPath.GPU:  # made on the device: quantizing 36 MXFP4 matrices of 2880 x 2880 takes 80 s
        host = np.array(random_native_records(rec, N_RECORDS, mx.random.key(seed)))
    else:
        host = np.stack([np.frombuffer(pack_record(_expert(rng, qtype, d, f, biases), rec), np.uint8)
                         for _ in range(N_RECORDS)])
    slots = np.stack([rng.choice(N_RECORDS, k, replace=False) for _ in range(tokens)]).astype(np.int32)
    slots[0, -1] = -1  # a skipped rank
    weights = rng.random((tokens, k)).astype(np.float32)
    x = rng.standard_normal((tokens, d)).astype(np.float32)
    ref = np.stack([routed_experts([unpack_record(host[s], rec) for s in slots[t] if s >= 0],
                                   weights[t][slots[t] >= 0], x[t], act) for t in range(tokens)])
    return rec, mx.array(host), x, slots, weights, ref


@pytest.mark.parametrize("path", KERNEL_PATHS)
@pytest.mark.parametrize("qtype", TYPES, ids=[q.name for q in TYPES])
def test_fused_native_experts_against_reference(path, qtype):
    with using_path(path):
        rec, records, x, slots, weights, ref = _case(path, qtype, seed=int(qtype))
        got = moe_native.moe_slots(records, rec, mx.array(x), slots, weights)
        assert got.shape == (2, 4 * rec.expert_ffn // 32, rec.hidden)
        assert_backends_agree(ref, got.sum(axis=1), "FAST", what=f"fused {qtype.name}")
        # the exponent code form (Metal's) and the subnormal one (CUDA's), each held to the
        # reference; on CUDA, where NVRTC contracts DN = 0's multiply-adds into FMAs as DN = 1
        # writes them, the same bits (the emulator's g++ does not contract: products rounded apart)
        forms = [np.array(moe_native.moe_slots(records, rec, mx.array(x), slots, weights, denormals=dn))
                 for dn in (False, True)]
        for dn, form in enumerate(forms):
            assert_backends_agree(ref, form.sum(axis=1), "FAST", what=f"fused {qtype.name} DN={dn}")
        if path is KernelPath.GPU and gpu_dialect() is Dialect.CUDA:
            np.testing.assert_array_equal(forms[0], forms[1])


@pytest.mark.parametrize("qtype", [QuantType.A4G64_F16, QuantType.MXFP4], ids=["A4G64_F16", "MXFP4"])
@EMULATED_ONLY
def test_block_shapes_and_loads_agree_bit_for_bit(qtype, monkeypatch, path):
    """FC = 32 / 64 chunks, 128 / 512 threads, h in registers or threadgroup memory, vector or
    word loads, the lane steps unrolled or a loop, x's rows in threadgroup memory padded or dense:
    the same products summed in the same order per chunk."""
    with using_path(KernelPath.EMULATED):
        rec, records, x, slots, weights, ref = _case(KernelPath.EMULATED, qtype, seed=3)
        run = lambda **kw: np.array(moe_native.moe_slots(records, rec, mx.array(x), slots, weights, **kw))  # noqa: E731
        base = run(fc=32, threads=256, hx_shared=False)
        for kw in (dict(threads=128), dict(threads=512), dict(hx_shared=True), dict(vector_loads=False),
                   dict(unroll=True), dict(unroll=False)):
            np.testing.assert_array_equal(base, run(fc=32, **{"threads": 256, "hx_shared": False, **kw}), err_msg=str(kw))
        moe_native._template.cache_clear()
        monkeypatch.setattr(moe_native, "SHARED_BYTES", moe_native.x_shared_bytes(qtype, rec.hidden) - 1)
        assert moe_native.x_stride(qtype, rec.hidden) == 8  # the padded rows no longer fit: dense
        np.testing.assert_array_equal(base, run(fc=32, threads=256, hx_shared=False))
        monkeypatch.undo()
        moe_native._template.cache_clear()
        wide = run(fc=64)
        assert_backends_agree(ref, wide.sum(axis=1), "FAST", what="FC = 64")
        # 8 tokens: the many-token block shape (FC = 64, h in threadgroup memory; MXFP4 keeps FC = 32)
        rec, records, x, slots, weights, ref = _case(KernelPath.EMULATED, qtype, seed=4, tokens=moe.MANY_TOKENS)
        shape = moe_native.block_shape(rec, len(x))
        assert shape == (moe_native.MANY_TOKENS_SHAPE if qtype is not QuantType.MXFP4 else (32, 256, False))
        got = moe_native.moe_slots(records, rec, mx.array(x), slots, weights)
        assert got.shape[1] == 4 * rec.expert_ffn // shape.fc
        assert_backends_agree(ref, got.sum(axis=1), "FAST", what="many-token shape")


@pytest.mark.parametrize("path", KERNEL_PATHS)
@pytest.mark.parametrize("qtype", [QuantType.MXFP4, QuantType.A8G32_F16], ids=["MXFP4", "A8G32_F16"])
def test_gpt_oss_biases_and_clamped_swiglu(path, qtype):
    with using_path(path):
        rec, records, x, slots, weights, ref = _case(path, qtype, seed=5, biases=True, act=CLAMPED)
        got = moe_native.moe_slots(records, rec, mx.array(x), slots, weights, act=CLAMPED)
        assert_backends_agree(ref, got.sum(axis=1), "FAST", what=f"{qtype.name} with biases, clamped SwiGLU")
        # the fused kernel is what the engine's expert step takes for these records
        assert mlx_experts._routed_kernel_ok(rec, CLAMPED)
        via_engine = mlx_experts.routed_partials(records, rec, mx.array(x), slots, weights, act=CLAMPED)
        np.testing.assert_array_equal(np.array(via_engine), np.array(got))


@pytest.mark.parametrize("path", KERNEL_PATHS)
@pytest.mark.parametrize("order", [RoutingOrder.SOFTMAX_TOPK, RoutingOrder.TOPK_SOFTMAX], ids=["softmax_topk", "topk_softmax"])
def test_routing_on_the_device_matches_host_slots(path, order):
    """moe_route ranks the logits in the block: the same experts as the host rule and its weights
    to float32 reordering, so moe_slots' sums with the host's selection."""
    with using_path(path):
        rec, records, x, _, _, _ = _case(path, QuantType.MXFP4, seed=7, biases=True, act=CLAMPED)
        z = np.random.default_rng(8).standard_normal((2, N_RECORDS)).astype(np.float32)
        rule = RouterRule(k=4, order=order, norm_topk_prob=True)
        z[1, 5] = z[1, 7]  # an exact tie: the lower id wins on both sides
        sels = route_batch(z, rule)
        slots = np.stack([s.experts for s in sels]).astype(np.int32)
        weights = np.stack([s.weights for s in sels]).astype(np.float32)
        got = moe_native.moe_route(records, rec, mx.array(x), mx.array(z), 0, 4, order, True, act=CLAMPED)
        want = moe_native.moe_slots(records, rec, mx.array(x), slots, weights, act=CLAMPED)
        assert_backends_agree(np.array(want).sum(axis=1), got.sum(axis=1), "FAST", what=f"device routing {order.value}")
        via_engine = mlx_experts.routed_partials_route(records, rec, None, mx.array(x), mx.array(z), 0, rule, CLAMPED)
        np.testing.assert_array_equal(np.array(via_engine), np.array(got))


@EMULATED_ONLY
def test_shared_expert_blocks_ride_in_the_native_launch(path):
    with using_path(KernelPath.EMULATED):
        rec, records, x, slots, weights, _ = _case(KernelPath.EMULATED, QuantType.A4G32_BF16, seed=9)
        rng = np.random.default_rng(10)
        fs = 64
        sh = tuple(mx.array((rng.standard_normal(s) / 16).astype(np.float16)) for s in ((fs, rec.hidden),) * 2 + ((rec.hidden, fs),))
        routed, shared = moe_native.moe_slots(records, rec, mx.array(x), slots, weights, shared=sh)
        alone = moe_native.moe_slots(records, rec, mx.array(x), slots, weights)
        np.testing.assert_array_equal(np.array(routed), np.array(alone))
        from strata.mlx_backend.kernels import shared as shared_kernel
        np.testing.assert_array_equal(np.array(shared), np.array(shared_kernel.shared_partials(mx.array(x), *sh)))


def test_engine_takes_the_kernel_where_it_serves():
    """_routed_kernel_ok: the native kernel for MLX's types on a kernel path (biases and the
    clamped SwiGLU included); the ops path stays the ops path; shapes the kernel refuses go to
    gather_qmm."""
    rec = RecordLayout(QuantType.A4G64_F16, *MEDIUM)
    with using_path(KernelPath.EMULATED):
        assert mlx_experts._routed_kernel_ok(rec)
        assert mlx_experts._routed_kernel_ok(RecordLayout(QuantType.MXFP4, *MEDIUM, True), CLAMPED)
        too_wide = RecordLayout(QuantType.A4G32_F16, 9216, 64)
        assert moe_native.supports(too_wide) is not None and not mlx_experts._routed_kernel_ok(too_wide)
    with using_path(KernelPath.OPS):
        assert not mlx_experts._routed_kernel_ok(rec)


def test_mxfp4_refusal_only_where_no_kernel_serves(monkeypatch):
    """On MLX's CUDA build gather_qmm has no MXFP4 kernel for float32 activations: the records
    are refused on the ops path (one line), served on the kernel path."""
    from strata.mlx_backend import quants
    monkeypatch.setattr(quants, "_on_cuda", lambda: True)
    rec = RecordLayout(QuantType.MXFP4, *MEDIUM)
    with using_path(KernelPath.OPS):
        assert "gather_qmm" in native_refusal(QuantType.MXFP4, rec)
    with using_path(KernelPath.EMULATED):
        assert native_refusal(QuantType.MXFP4, rec) is None
        assert native_refusal(QuantType.MXFP4) is None
        assert "gather_qmm" in native_refusal(QuantType.MXFP4, RecordLayout(QuantType.MXFP4, 9216, 64))
    assert native_refusal(QuantType.A4G32_F16, rec) is None


@pytest.fixture(scope="module")
def native_specialisations() -> list:
    """Every specialisation of the native kernel a small case launches: each type's slots entry
    (both code forms), gpt-oss's biases and clamped SwiGLU, the routing entry, the shared blocks."""
    from strata.mlx_backend.kernels.launch import recording

    with using_path(KernelPath.EMULATED), recording() as rec:
        for qtype in TYPES:
            for dn in (False, True):
                r = RecordLayout(qtype, 128, 64)
                records = random_native_records(r, 4, mx.random.key(0))
                mx.eval(moe_native.moe_slots(records, r, mx.ones((1, 128)), np.array([[0, 2]]), np.ones((1, 2)),
                                             denormals=dn))
        r = RecordLayout(QuantType.MXFP4, 128, 64, True)
        records = random_native_records(r, 4, mx.random.key(1))
        mx.eval(moe_native.moe_route(records, r, mx.ones((1, 128)), mx.ones((1, 4)), 0, 2, RoutingOrder.TOPK_SOFTMAX,
                                     False, act=CLAMPED))
        sh = (mx.zeros((16, 128), mx.float16), mx.zeros((16, 128), mx.float16), mx.zeros((128, 16), mx.float16))
        mx.eval(*moe_native.moe_slots(records, r, mx.ones((1, 128)), np.array([[1, 3]]), np.ones((1, 2)), act=CLAMPED,
                                      shared=sh))
    assert len(rec) == 2 * len(TYPES) + 2
    return rec


@pytest.mark.parametrize("dialect", [Dialect.METAL, Dialect.CUDA], ids=["metal", "cuda"])
@EMULATED_ONLY
def test_native_kernel_sources_compile(tmp_path, native_specialisations, dialect, path):
    """The full Metal and CUDA sources of every specialisation, syntax-checked with g++ against the
    stubs (tests/mlx_backend/test_metal_compile.py). Metal: compile-checked, not run."""
    from test_metal_compile import _check

    errors = [e for e in (_check(tmp_path, dialect, s) for s in native_specialisations) if e]
    assert not errors, "\n\n".join(errors)


@EMULATED_ONLY
def test_gpt_oss_mxfp4_engines_run_the_native_kernel(tmp_path, path):
    """A made gpt-oss model with MXFP4 experts (biases, clamped SwiGLU, sinks, a window of 8)
    through the MLX engines on the emulated kernel path: the native kernel does the routed
    experts (routing on the device all-resident, host slots streaming) and the logits agree with
    the reference over a prompt longer than the window, then decodes."""
    import strata
    from engine_kinds import agree, open_kind
    from strata.mlx_backend.kernels.launch import HOST_INPUTS, LAUNCHES
    from strata.testing.models import make_model

    prompt = list(b"def fibonacci(n): return n")
    made = make_model(tmp_path / "m", "gpt-oss", seed=5, expert_type=QuantType.MXFP4, dense_type=QuantType.F16)
    with strata.load(made.model_path) as m:
        assert len(prompt) > 2 * m.cfg.gpt_oss.sliding_window
        with open_kind(m, "reference") as ref:
            want = np.stack([ref.prefill(prompt)] + [ref.decode(t) for t in prompt[:3]])
        for kind, entry in (("mlx-resident", "strata_moe_native_route"), ("mlx-min", "strata_moe_native_slots")):
            LAUNCHES.clear()
            HOST_INPUTS.clear()
            with using_path(KernelPath.EMULATED), open_kind(m, kind) as eng:
                got = np.stack([eng.prefill(prompt)] + [eng.decode(t) for t in prompt[:3]])
            assert LAUNCHES[entry] == 4 * m.cfg.n_layers, dict(LAUNCHES)  # every MoE layer, every step
            # all-resident: no host array reaches the kernel (alpha and limit are a device constant);
            # streaming: the host's slots and weights, 2 per launch
            assert HOST_INPUTS[entry] == (0 if kind == "mlx-resident" else 2 * LAUNCHES[entry]), dict(HOST_INPUTS)
            agree(kind, want, got, f"gpt-oss MXFP4, {kind}, native kernel")


def _native_model(qtype: QuantType):
    """MlxParams of the tiny shape (hidden 64, a shared expert) with `qtype` experts, float16-exact dense weights."""
    from models import DictExperts
    from strata.mlx_backend import model as mlx_model
    from strata.reference.model import ModelParams
    from strata.testing.models import SHAPES, make_dense, make_expert

    cfg = replace(SHAPES["tiny"], expert_ffn_size=64)
    experts = {(l, e): make_expert(cfg, 0, l, e, qtype) for l in range(cfg.n_layers) for e in range(cfg.n_experts)}
    return mlx_model.from_reference(ModelParams(cfg, make_dense(cfg, 0), DictExperts(experts)))


@pytest.mark.parametrize("path", KERNEL_PATHS)
def test_compiled_decode_runs_the_native_kernel(path):
    """The all-resident decode step (one launch per layer: routed + shared blocks) on A4G64_BF16
    experts: traced by mx.compile on the GPU, untraced on the emulator; bit for bit against `forward`."""
    from test_mlx_compiled import _assert_same_decode, _decode_both

    with using_path(path):
        p = _native_model(QuantType.A4G64_BF16)
        LAUNCHES.clear()
        ref, got, ref_state, got_state, _ = _decode_both(p, traced=path is KernelPath.GPU)
        assert LAUNCHES["strata_moe_native_route"] > 0 and not LAUNCHES["strata_shared_expert"]
    _assert_same_decode(ref, got, ref_state, got_state)
