"""The DeltaNet decode-step kernel (kernels/deltanet.py) on the emulated path against the reference:
decoded positions after a prompt, on heads of one row slice (the made `hybrid` shape: dk = dv =
16; again with the sigmoid output gate, `deltanet_sigmoid_gate`), of four slices (dk = dv = 128, Qwen3.5's heads: 512 threads a block) and of a ragged shape
(dk = 48: a partial second slice; dv = 40: idle threads in the last warp; r = 3 v heads per k
head); the output and both new states after every step (FAST), three launches a position,
determinism, the snapshot the step keeps; and the Metal / CUDA compile check of every
specialisation these tests launch (Metal: compile-checked, not run). The decode steps also run on
the GPU path where MLX has a GPU (marked `gpu`).
"""

from __future__ import annotations

import dataclasses

import numpy as np
import pytest

mx = pytest.importorskip("mlx.core")

from mlx_agree import assert_backends_agree  # noqa: E402
from strata.mlx_backend import deltanet as mdn  # noqa: E402
from strata.mlx_backend.kernels import deltanet as step_kernel  # noqa: E402
from strata.mlx_backend.kernels.launch import LAUNCHES, KernelPath, recording, using_path  # noqa: E402
from strata.mlx_backend.kernels.preludes import Dialect  # noqa: E402
from strata.mlx_backend.model import to_mlx_params  # noqa: E402
from strata.model_config import TensorNames  # noqa: E402
from strata.reference import deltanet as rdn  # noqa: E402
from strata.reference.attention import rms_norm  # noqa: E402
from strata.testing.models import SHAPES, make_dense  # noqa: E402
from tests.kernel_paths import KERNEL_PATHS, emulated  # noqa: E402


BASE = dataclasses.replace(SHAPES["hybrid"], max_context=64)
HEADS = {  # (k heads, v heads, dk, dv)
    "hybrid_16": (2, 4, 16, 16),
    "qwen35_128": (1, 2, 128, 128),
    "ragged_48x40_r3": (1, 3, 48, 40),
    "hybrid_16_sigmoid_gate": (2, 4, 16, 16),  # the released Qwen3.8-Flash-Next's output gate
}
PROMPT, STEPS = 5, 3
RECORDED: list = []  # specialisations launched here, for the compile check


def _cfg(name: str):
    hk, hv, dk, dv = HEADS[name]
    return BASE.with_fields(linear_k_heads=hk, linear_v_heads=hv, linear_k_head_dim=dk, linear_v_head_dim=dv,
                            deltanet_sigmoid_gate=name.endswith("_sigmoid_gate"))


def _fp16_exact(dense: dict) -> dict:
    return {k: np.asarray(v, np.float32).astype(np.float16).astype(np.float32) for k, v in dense.items()}


def _to_mlx(state: rdn.DeltaNetState) -> rdn.DeltaNetState:
    return rdn.DeltaNetState(mx.array(state.conv), mx.array(state.recurrent), state.length)


def _setup(name: str, seed: int):
    cfg = _cfg(name)
    dense = _fp16_exact(make_dense(cfg, seed=seed))
    norm = dense[TensorNames.block(0, TensorNames.attn_norm)]
    rng = np.random.default_rng(seed)
    xs = rng.standard_normal((PROMPT + STEPS, cfg.hidden_size)).astype(np.float32)
    _, ref = rdn.deltanet(cfg, dense, 0, rdn.DeltaNetState.empty(cfg), rms_norm(xs[:PROMPT], norm, cfg.rms_norm_eps))
    w = to_mlx_params(cfg, dense, dtype=mx.float16, pred_q8=False).layers[0].attn
    return cfg, dense, norm, xs, ref, w


@pytest.mark.parametrize("path", KERNEL_PATHS)
@pytest.mark.parametrize("name", list(HEADS))
def test_decode_steps_are_the_references(name, path):
    cfg, dense, norm, xs, ref, w = _setup(name, seed=len(name))
    got = _to_mlx(ref)
    with using_path(path), recording() as rec:
        assert mdn.kernel_applies(cfg, w)
        for i in range(PROMPT, PROMPT + STEPS):
            want, ref = rdn.deltanet(cfg, dense, 0, ref, rms_norm(xs[i:i + 1], norm, cfg.rms_norm_eps))
            before = sum(LAUNCHES.values())
            parts, got = mdn.deltanet_partials(cfg, w, got, mx.array(xs[i:i + 1]))
            mx.eval(parts, got.conv, got.recurrent)
            assert sum(LAUNCHES.values()) - before == 3  # input projection, step, output projection
            what = f"{name} position {i}"
            assert_backends_agree(want, parts[:, 0], "FAST", what=f"{what}: output")
            assert_backends_agree(ref.recurrent, got.recurrent, "FAST", what=f"{what}: recurrent state")
            assert_backends_agree(ref.conv, got.conv, "FAST", what=f"{what}: conv state")
            assert got.length == ref.length == i + 1
            assert got.kept_positions[-1] == i + 1 and got.kept[-1].recurrent is got.recurrent
    RECORDED.extend(r for r in rec if r[0] is step_kernel.SOURCE and r not in RECORDED)


@emulated
def test_the_kept_snapshot_survives_the_next_step():
    """The step writes new state arrays: trimming back one position restores the kept state bit for bit."""
    cfg, _, _, xs, ref, w = _setup("hybrid_16", seed=3)
    st = _to_mlx(ref)
    with using_path(KernelPath.EMULATED):
        _, st = mdn.deltanet_partials(cfg, w, st, mx.array(xs[PROMPT:PROMPT + 1]))
        kept = np.array(st.recurrent), np.array(st.conv)
        _, st2 = mdn.deltanet_partials(cfg, w, st, mx.array(xs[PROMPT + 1:PROMPT + 2]))
        mx.eval(st2.recurrent)
    back = st2.trim(PROMPT + 1)
    np.testing.assert_array_equal(np.array(back.recurrent), kept[0])
    np.testing.assert_array_equal(np.array(back.conv), kept[1])
    assert not np.array_equal(np.array(st2.recurrent), kept[0])


@emulated
def test_the_step_is_deterministic():
    cfg, _, _, xs, ref, w = _setup("qwen35_128", seed=5)
    st = _to_mlx(ref)
    x = mx.array(xs[PROMPT:PROMPT + 1])
    with using_path(KernelPath.EMULATED):
        a, sa = mdn.deltanet_partials(cfg, w, st, x)
        b, sb = mdn.deltanet_partials(cfg, w, st, x)
        for u, v in ((a, b), (sa.recurrent, sb.recurrent), (sa.conv, sb.conv)):
            np.testing.assert_array_equal(np.array(u), np.array(v))


@emulated
def test_heads_too_large_for_a_block_take_the_ops_path():
    """dk = dv = 256 needs 8 x 256 threads a block: refused by the kernel, so the layer runs the ops twin."""
    cfg = _cfg("hybrid_16").with_fields(linear_k_head_dim=256, linear_v_head_dim=256)
    assert not step_kernel.fits(256, 256, cfg.deltanet.linear_conv_kernel)
    assert step_kernel.fits(128, 128, 4) and not step_kernel.fits(128, 128, 1)
    w = to_mlx_params(cfg, _fp16_exact(make_dense(cfg, seed=1)), dtype=mx.float16, pred_q8=False).layers[0].attn
    with using_path(KernelPath.EMULATED):
        assert not mdn.kernel_applies(cfg, w)
        before = sum(LAUNCHES.values())
        parts, _ = mdn.deltanet_partials(cfg, w, mdn.empty_state(cfg), mx.ones((1, cfg.hidden_size)))
        mx.eval(parts)
        assert sum(LAUNCHES.values()) == before
    with pytest.raises(ValueError, match="threads a block"):
        step_kernel.deltanet_step(mx.zeros((1, 2 * 256 * 2 + 4 * 256 * 2 + 8)), mx.zeros((2 * 256 * 2 + 4 * 256, 3)),
                                  mx.zeros((2 * 256 * 2 + 4 * 256, 4), mx.float16), mx.zeros((4,)), mx.zeros((4,)),
                                  mx.zeros((256,), mx.float16), mx.zeros((4, 256, 256)), k_heads=2, eps=1e-6,
                                  l2_eps=1e-6, softplus_max=20.0)


@emulated
@pytest.mark.parametrize("dialect", [Dialect.METAL, Dialect.CUDA], ids=["metal", "cuda"])
def test_every_step_specialisation_compiles(tmp_path, dialect):
    """Compile-checked, not run (Metal): the full Metal and CUDA sources of every shape above."""
    from test_metal_compile import _check

    if len(RECORDED) < len(HEADS):  # run alone: record them here
        for name in HEADS:
            test_decode_steps_are_the_references(name, KernelPath.EMULATED)
    errors = [e for e in (_check(tmp_path, dialect, s) for s in RECORDED) if e]
    assert not errors, "\n\n".join(errors)
