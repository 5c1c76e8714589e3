"""The compiled decode step (strata/mlx_backend/compiled.py) and the device-scalar arguments it
needs from the kernel wrappers.

On the GPU: compiled and uncompiled decoding from the same prompt state agree bit for bit at
every step (the same kernels on the same inputs: only who builds the graph differs), the cache
advances, and replays launch nothing from Python. On the CPU: the wrappers give the same
results with a device index as with a Python int (emulated path), the device-scalar step
untraced equals `forward`, and MlxEngine still decodes on the ops path (no compile there) and
falls back, with one warning, when the trace fails.
"""

from __future__ import annotations

import warnings
from dataclasses import replace

import mlx.core as mx
import numpy as np
import pytest

from strata.mlx_backend import compiled as compiled_step
from strata.mlx_backend import model as mlx_model
from strata.mlx_backend.attention import MlxLayerKV, rope_table_cached
from strata.mlx_backend.compiled import CompiledDecode
from strata.mlx_backend.engine import MlxEngine
from strata.mlx_backend.kernel_plan import KernelPlan
from strata.mlx_backend.kernels import attention as attn_kernels
from strata.mlx_backend.kernels import emulate
from strata.mlx_backend.kernels import embed as embed_kernel
from strata.mlx_backend.kernels.launch import LAUNCHES, KernelPath, gpu_dialect, index_param, using_path
from strata.model_config import LayerType, Mixer
from strata.reference.deltanet import DeltaNetState
from strata.testing.mlx_params import SEED_SHAPE, random_params

gpu = [pytest.mark.gpu, pytest.mark.skipif(gpu_dialect() is None, reason="no MLX GPU here")]
emulated = pytest.mark.skipif(not emulate.available(), reason="no C++20 compiler")

# a small model of the reference engine's class (the decoded-token test's shape in test_mlx_kernels.py)
SMALL = replace(SEED_SHAPE, n_layers=2, hidden_size=256, n_experts=16, n_experts_per_token=4, expert_ffn_size=64,
                shared_ffn_size=64, n_heads=4, n_kv_heads=2, head_dim=64, vocab_size=512, max_context=64)
# a hybrid of the same size: DeltaNet, DeltaNet, gated attention with partial rotary
SMALL_HYBRID = SMALL.with_fields(n_layers=3,
                                 layer_types=(LayerType(Mixer.DELTANET), LayerType(Mixer.DELTANET), LayerType()),
                       rotary_dim=16, attention_output_gate=True, linear_k_heads=2, linear_v_heads=4,
                       linear_k_head_dim=32, linear_v_head_dim=32, linear_conv_kernel=4)
PROMPT = np.array([7, 3, 11])
STEPS = 6


def _bits_equal(a, b) -> bool:
    a, b = np.asarray(a), np.asarray(b)
    return a.shape == b.shape and a.dtype == b.dtype and a.tobytes() == b.tobytes()


def _prefilled(p):
    logits, state = mlx_model.forward(p, mlx_model.MlxModelState.empty(p.cfg), PROMPT)
    mx.eval(logits)
    return int(np.argmax(np.array(logits[-1]))), state


def greedy_steps(p, steps: int = 3, *, compiled: bool = False):
    """The prompt's forward, then `steps` greedy tokens (uncompiled forward, or a CompiledDecode
    built on the prompt's state) -> (logits float32 [steps + 1, V], the first attention layer's
    keys, its values)."""
    state = mlx_model.MlxModelState.empty(p.cfg)
    logits, state = mlx_model.forward(p, state, PROMPT)
    out = [np.array(logits[-1])]
    step = CompiledDecode(p, state) if compiled else None
    for _ in range(steps):
        tok = int(np.argmax(out[-1]))
        logits, state = step(state, tok) if compiled else mlx_model.forward(p, state, np.array([tok]))
        out.append(np.array(logits[-1]))
    kv = next(layer for layer in state.layers if hasattr(layer, "keys"))
    return np.stack(out), np.array(kv.keys), np.array(kv.values)


def _decode_both(p, traced: bool):
    """Decode STEPS tokens uncompiled (forward) and through CompiledDecode from two copies of the
    prompt state (own KV buffers each) -> per-step logits of both, the final states."""
    tok, ref_state = _prefilled(p)
    _, got_state = _prefilled(p)
    step = CompiledDecode(p, got_state, traced=traced)
    ref, got = [], []
    for i in range(STEPS):
        lr, ref_state = mlx_model.forward(p, ref_state, np.array([tok]))
        lg, got_state = step(got_state, tok)
        ref.append(np.array(lr[-1]))
        got.append(np.array(lg[-1]))
        assert got_state.length == ref_state.length == len(PROMPT) + i + 1
        tok = int(np.argmax(ref[-1]))
    return ref, got, ref_state, got_state, step


def _assert_same_decode(ref, got, ref_state, got_state):
    for i, (r, g) in enumerate(zip(ref, got)):
        assert _bits_equal(r, g), f"step {i}: max |diff| {np.abs(r - g).max()}"
    n = got_state.length
    for l, (a, b) in enumerate(zip(ref_state.layers, got_state.layers)):
        if isinstance(a, DeltaNetState):  # new arrays each step, and the snapshots kept at the same positions
            assert b.length == a.length and b.kept_positions == a.kept_positions, f"layer {l}: kept positions"
            for name, x, y in (("conv", a.conv, b.conv), ("recurrent", a.recurrent, b.recurrent)):
                assert _bits_equal(np.array(x), np.array(y)), f"layer {l} {name} state differs"
            assert b.kept[-1].recurrent is b.recurrent
            continue
        for name, x, y in (("keys", a.keys, b.keys), ("values", a.values, b.values)):
            x, y = np.array(x), np.array(y)
            assert _bits_equal(x[:, :n], y[:, :n]), f"layer {l} {name}: positions 0..{n - 1} differ"
            assert np.any(y[:, n - 1] != 0), f"layer {l} {name}: position {n - 1} not written"
            assert not np.any(y[:, n:]), f"layer {l} {name}: written past position {n - 1}"


# ---------------------------------------------------------------- GPU


@pytest.mark.gpu
@pytest.mark.skipif(gpu_dialect() is None, reason="no MLX GPU here")
def test_compiled_decode_matches_uncompiled_bit_for_bit():
    with using_path(KernelPath.GPU):
        p = random_params(SMALL, seed=3, pred_q8=False)
        ref, got, ref_state, got_state, step = _decode_both(p, traced=True)
        _assert_same_decode(ref, got, ref_state, got_state)
        assert step.calls == STEPS
        # a replay runs no Python wrapper (no launch() call): the trace was made once
        before = sum(LAUNCHES.values())
        logits, _ = step(got_state, int(np.argmax(got[-1])))
        mx.eval(logits)
        assert sum(LAUNCHES.values()) == before


@pytest.mark.gpu
@pytest.mark.skipif(gpu_dialect() is None, reason="no MLX GPU here")
def test_mlx_engine_compiled_and_uncompiled_agree():
    with using_path(KernelPath.GPU):
        p = random_params(SMALL, seed=4, pred_q8=False)
        outs = []
        for flag in (False, True):
            eng = MlxEngine(p, compiled=flag)
            with warnings.catch_warnings(record=True) as caught:
                warnings.simplefilter("always")
                out = [eng.prefill(list(PROMPT))]
                for _ in range(STEPS):
                    out.append(eng.decode(int(np.argmax(out[-1]))))
            assert not [w for w in caught if "compiled decode" in str(w.message)], eng.compile_error
            assert eng.compile_error is None
            assert (eng._step is not None) is flag
            assert eng.length == len(PROMPT) + STEPS
            outs.append(np.stack(out))
        assert _bits_equal(outs[0], outs[1])


# ---------------------------------------------------------------- CPU: the wrappers with a device index


@emulated
def test_attend_with_a_device_position_matches_the_int():
    cfg = SMALL
    rng = np.random.default_rng(0)
    hd, h, kvh = cfg.head_dim, cfg.n_heads, cfg.n_kv_heads
    qkv = mx.array(rng.standard_normal((1, (h + 2 * kvh) * hd)).astype(np.float32))
    norm = mx.array(rng.uniform(0.5, 1.5, hd).astype(np.float16))
    cos, sin = rope_table_cached(cfg)
    pos0 = 5
    hist = rng.standard_normal((kvh, pos0, hd)).astype(np.float32)
    outs, caches = [], []
    with using_path(KernelPath.EMULATED):
        for pos in (None, index_param(pos0)):
            kv = MlxLayerKV.empty(cfg)
            np.array(kv.keys, copy=False)[:, :pos0] = hist  # the same history in both caches
            np.array(kv.values, copy=False)[:, :pos0] = -hist
            out = attn_kernels.attend(qkv, norm, norm, cos, sin, kv.keys, kv.values, pos0, cfg.rms_norm_eps, h, pos=pos)
            outs.append(np.array(out))
            caches.append((np.array(kv.keys), np.array(kv.values)))
    assert _bits_equal(outs[0], outs[1])
    for a, b in zip(caches[0], caches[1]):
        assert _bits_equal(a, b)
        assert np.any(b[:, pos0]) and not np.any(b[:, pos0 + 1:])


def test_attend_rejects_a_bad_position():
    cfg = SMALL
    kv = MlxLayerKV.empty(cfg)
    qkv = mx.zeros((1, (cfg.n_heads + 2 * cfg.n_kv_heads) * cfg.head_dim))
    cos, sin = rope_table_cached(cfg)
    with pytest.raises(ValueError, match="int32"):
        attn_kernels.attend(qkv, None, None, cos, sin, kv.keys, kv.values, 0, 1e-6, cfg.n_heads,
                            pos=mx.zeros((8,), mx.float32))


@emulated
def test_embed_rows_with_a_device_id_matches_the_host_id():
    table = mx.array(np.random.default_rng(1).standard_normal((40, 64)).astype(np.float16))
    with using_path(KernelPath.EMULATED):
        host = embed_kernel.embed_rows(table, np.array([17], np.int32), 1)
        dev = embed_kernel.embed_rows(table, index_param(17), 1)
        assert _bits_equal(np.array(host), np.array(dev))
        assert _bits_equal(np.array(dev)[0], np.array(table[17]).astype(np.float32))
    with pytest.raises(ValueError, match="int32"):
        embed_kernel.embed_rows(table, mx.array([1.0] * 8), 1)


@emulated
def test_device_scalar_step_untraced_equals_forward_on_the_emulator():
    """The body the GPU traces (model.decode_device through CompiledDecode, traced=False) against
    `forward`, bit for bit, with the KV cache written at the same positions."""
    with using_path(KernelPath.EMULATED):
        p = random_params(SMALL, seed=5, pred_q8=False)
        ref, got, ref_state, got_state, step = _decode_both(p, traced=False)
    _assert_same_decode(ref, got, ref_state, got_state)
    assert step.calls == STEPS


@emulated
def test_device_scalar_step_untraced_equals_forward_on_a_hybrid():
    """A hybrid's step: the DeltaNet states are the step's inputs and outputs (the decode-step
    kernel), the gated, partially rotary attention runs attend; bit for bit against `forward`."""
    with using_path(KernelPath.EMULATED):
        p = random_params(SMALL_HYBRID, seed=9, pred_q8=False)
        assert compiled_step.unsupported(p, traced=False) is None
        ref, got, ref_state, got_state, step = _decode_both(p, traced=False)
    _assert_same_decode(ref, got, ref_state, got_state)
    assert got_state.kept_position(len(PROMPT) + 2) == len(PROMPT) + 2  # every decoded position kept


@pytest.mark.gpu
@pytest.mark.skipif(gpu_dialect() is None, reason="no MLX GPU here")
def test_compiled_decode_matches_uncompiled_on_a_hybrid():
    with using_path(KernelPath.GPU):
        p = random_params(SMALL_HYBRID, seed=10, pred_q8=False)
        assert compiled_step.unsupported(p) is None
        ref, got, ref_state, got_state, step = _decode_both(p, traced=True)
        _assert_same_decode(ref, got, ref_state, got_state)
        before = sum(LAUNCHES.values())
        logits, _ = step(got_state, int(np.argmax(got[-1])))
        mx.eval(logits)
        assert sum(LAUNCHES.values()) == before  # replayed: the DeltaNet states are inputs, not a retrace


def test_compiled_decode_checks_like_forward():
    with using_path(KernelPath.OPS):
        p = random_params(SMALL, seed=6, pred_q8=False)
        assert "ops path" in compiled_step.unsupported(p)
        with pytest.raises(ValueError, match="ops path"):
            CompiledDecode(p, mlx_model.MlxModelState.empty(SMALL))
        state = mlx_model.MlxModelState.empty(SMALL)
        with pytest.raises(ValueError, match=r"token ids must be in \[0, 512\)"):
            compiled_step.check_decode(p, state, 512)
        full = mlx_model.MlxModelState(tuple(MlxLayerKV(kv.keys, kv.values, SMALL.max_context) for kv in state.layers))
        with pytest.raises(ValueError, match="exceed the context"):
            compiled_step.check_decode(p, full, 1)
    if emulate.available():
        with using_path(KernelPath.EMULATED):
            assert "emulated path" in compiled_step.unsupported(p)
            assert compiled_step.unsupported(p, traced=False) is None
            step = CompiledDecode(p, state, traced=False)
            assert step.bound_to(state) and not step.bound_to(mlx_model.MlxModelState.empty(SMALL))


# ---------------------------------------------------------------- CPU: MlxEngine


def _engine_run(eng) -> np.ndarray:
    out = [eng.prefill(list(PROMPT))]
    for _ in range(STEPS):
        out.append(eng.decode(int(np.argmax(out[-1]))))
    return np.stack(out)


def test_mlx_engine_on_the_ops_path_does_not_compile():
    with using_path(KernelPath.OPS):
        p = random_params(SMALL, seed=7, pred_q8=False)
        plain = _engine_run(MlxEngine(p, compiled=False))
        eng = MlxEngine(p)
        assert eng.compiled is KernelPlan().compiled_decode
        with warnings.catch_warnings(record=True) as caught:
            warnings.simplefilter("always")
            got = _engine_run(eng)
        assert not [w for w in caught if "compiled decode" in str(w.message)]
        assert eng._step is None and eng.compile_error is None
        assert eng.length == len(PROMPT) + STEPS
    assert _bits_equal(plain, got)


@emulated
def test_mlx_engine_falls_back_once_when_the_trace_fails(monkeypatch):
    """Forced to compile on the emulator (whose launches evaluate their inputs: not allowed in a
    trace), the engine warns once, remembers why, and decodes uncompiled with the same logits."""
    real = compiled_step.unsupported
    monkeypatch.setattr(compiled_step, "unsupported", lambda p, traced=True: real(p, traced=False))
    with using_path(KernelPath.EMULATED):
        p = random_params(SMALL, seed=8, pred_q8=False)
        plain = _engine_run(MlxEngine(p, compiled=False))
        eng = MlxEngine(p, compiled=True)
        with pytest.warns(RuntimeWarning, match="compiled decode step failed") as caught:
            got = _engine_run(eng)
    assert len([w for w in caught if "compiled decode" in str(w.message)]) == 1
    assert eng.compile_error is not None and eng._step is None
    assert eng.length == len(PROMPT) + STEPS
    assert _bits_equal(plain, got)
