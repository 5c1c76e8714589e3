"""The Q2_0 tile kernel's bodies (kernels/q2_tiles.py TileForm: COLS, kernels/q2_tiles_cols.py;
BREG, kernels/q2_tiles_breg.py): bit for bit one another on every specialisation the prompt path
launches (gate | up gathered, with silu(g) u in the kernel or not; down scattered and weighted; 64
and 128 columns a block; tiles part-filled and several a group), on the emulator and the GPU where
MLX has one; each step takes its fastest body; the sources compile for Metal and CUDA."""

from __future__ import annotations

import mlx.core as mx
import numpy as np
import pytest

from kernel_paths import KERNEL_PATHS
from q2_records import CFG, q2_records
from strata.mlx_backend.grouped_tiles import tile_table
from strata.mlx_backend.kernels import emulate
from strata.mlx_backend.kernels import q2_tiles as qt
from strata.mlx_backend.kernels.launch import KernelPath, recording, using_path
from strata.mlx_backend.kernels.preludes import Dialect

STEPS = ["gate_up", "gate_up_hidden", "down"]


def _inputs(t: int, k: int, seed: int, skewed: bool):
    """x [t, D], the down step's rows [t k, F], sorted pairs, weights; skewed: every token on experts 3, 0, 4."""
    rng = np.random.default_rng(seed)
    if skewed:
        ids = np.tile(np.array([3, 0, 4][:k], np.int32), (t, 1))
    else:
        ids = np.stack([rng.choice(CFG.n_experts, k, replace=False) for _ in range(t)]).astype(np.int32)
    flat = mx.array(ids.reshape(-1))
    order = mx.argsort(flat).astype(mx.int32)
    x = mx.array(rng.standard_normal((t, CFG.hidden_size)).astype(np.float32))
    hid = mx.array(rng.standard_normal((t * k, CFG.expert_ffn_size)).astype(np.float32))
    w = mx.array(rng.uniform(0.1, 1.0, t * k).astype(np.float32))
    return flat, order, x, hid, w


def _step(form, step, bn, flat, order, x, hid, w, k, records, rec) -> np.ndarray:
    tiles = tile_table(flat[order], CFG.n_experts, qt.BM // 2)
    n = flat.size
    if step == "down":
        y = qt.q2_tiles(hid, order, order, w, tiles, n, records, rec, ("down",), gather=False, scatter=True, bn=bn,
                        form=form)
    else:
        y = qt.q2_tiles(x, order // k, order, w, tiles, n, records, rec, ("gate", "up"), gather=True, scatter=False,
                        bn=bn, hidden=step == "gate_up_hidden", form=form)
    return np.array(y)


@pytest.mark.parametrize("path", KERNEL_PATHS)
@pytest.mark.parametrize("step", STEPS)
@pytest.mark.parametrize("bn", [128, 64])
def test_the_bodies_are_the_same_bits(path, step, bn):
    """The same mma per accumulator in the same k order and the same epilogue sums: the same bits
    (x 50 tokens top-3 over 5 experts: part-filled tiles; R = 192 / F = 96 leave blocks part-used)."""
    rec, _, records = q2_records()
    k = 3
    flat, order, x, hid, w = _inputs(50, k, 7, skewed=False)
    with using_path(path):
        cols = _step(qt.TileForm.COLS, step, bn, flat, order, x, hid, w, k, records, rec)
        breg = _step(qt.TileForm.BREG, step, bn, flat, order, x, hid, w, k, records, rec)
    assert np.isfinite(cols).all()
    np.testing.assert_array_equal(breg, cols)


@pytest.mark.parametrize("path", KERNEL_PATHS)
def test_the_bodies_agree_on_crowded_experts(path):
    """Every token on the same 3 experts: groups of 70 pairs, three tiles each (two full)."""
    rec, _, records = q2_records()
    k = 3
    flat, order, x, hid, w = _inputs(70, k, 8, skewed=True)
    with using_path(path):
        for step in STEPS:
            cols = _step(qt.TileForm.COLS, step, 128, flat, order, x, hid, w, k, records, rec)
            breg = _step(qt.TileForm.BREG, step, 128, flat, order, x, hid, w, k, records, rec)
            np.testing.assert_array_equal(breg, cols, err_msg=step)


@pytest.mark.skipif(not emulate.available(), reason="no C++ compiler")
def test_each_step_takes_its_fastest_body_by_default():
    """form None: gate | up and down launch q2_tiles.BEST's bodies (the H200's fastest for each);
    a form given is what launches."""
    rec, _, records = q2_records()
    flat, order, x, hid, w = _inputs(6, 2, 0, skewed=False)
    for step, planes in (("gate_up_hidden", ("gate", "up")), ("down", ("down",))):
        with using_path(KernelPath.EMULATED), recording() as specs:
            _step(None, step, 128, flat, order, x, hid, w, 2, records, rec)
        assert [s.name for s, *_ in specs] == [qt.SOURCES[qt.BEST[planes]].name]
    for form in qt.TileForm:
        with using_path(KernelPath.EMULATED), recording() as specs:
            _step(form, "down", 128, flat, order, x, hid, w, 2, records, rec)
        assert [s.name for s, *_ in specs] == [qt.SOURCES[form].name]


@pytest.mark.skipif(not emulate.available(), reason="no C++ compiler")
@pytest.mark.parametrize("dialect", [Dialect.METAL, Dialect.CUDA], ids=["metal", "cuda"])
def test_every_body_compiles(tmp_path, dialect):
    """Each body's specialisations (every step, 64 and 128 columns) as the full Metal and CUDA
    sources (Metal: compile-checked, not run)."""
    from test_metal_compile import _check

    rec, _, records = q2_records()
    flat, order, x, hid, w = _inputs(6, 2, 0, skewed=False)
    with using_path(KernelPath.EMULATED), recording() as specs:
        for form in qt.TileForm:
            for step in STEPS:
                for bn in (128, 64):
                    _step(form, step, bn, flat, order, x, hid, w, 2, records, rec)
    assert len(specs) == len(qt.TileForm) * len(STEPS) * 2
    errors = [e for e in (_check(tmp_path, dialect, s) for s in specs) if e]
    assert not errors, "\n\n".join(errors)
