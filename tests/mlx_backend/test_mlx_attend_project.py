"""Attention and its output projection in one launch (kernels/attend_project.py) against the
reference and against the two launches it replaces, on the emulated kernels (small heads) and on
the GPU (the seed shape's 16 / 4 heads of 128 over D = 2560; marked `gpu`): a prompt chunk, then
decoded tokens, the cache it writes, determinism. The emulated chunk tests over every head
shape, the gate and partial rotary are in test_mlx_attention_kernels.py (both forms)."""

from __future__ import annotations

from dataclasses import replace

import mlx.core as mx
import numpy as np
import pytest

from mlx_agree import assert_backends_agree
from strata.mlx_backend.attention import MlxLayerKV, attention_partials, rope_table_cached
from strata.mlx_backend.kernel_plan import KernelPlan, using_plan
from strata.mlx_backend.kernels import attend_project
from strata.mlx_backend.kernels.launch import LAUNCHES, KernelPath, using_path
from strata.model_config import QKNorm, TensorNames
from strata.reference.attention import LayerKV, attention, rms_norm
from strata.testing.models import SHAPES
from tests.kernel_paths import KERNEL_PATHS
from test_mlx_attention_kernels import _layer, unfused_partials


def _cfg(path):
    if path is KernelPath.GPU:  # the seed shape's attention
        return replace(SHAPES["tiny"], hidden_size=2560, n_heads=16, n_kv_heads=4, head_dim=128,
                       qk_norm=QKNorm.PER_HEAD, max_context=64)
    return replace(SHAPES["tiny"], hidden_size=96, n_heads=8, n_kv_heads=2, head_dim=32, qk_norm=QKNorm.PER_HEAD,
                   max_context=16)


@pytest.mark.parametrize("path", KERNEL_PATHS)
@pytest.mark.parametrize("chained", [False, True], ids=["unchained", "chains"])
def test_one_launch_against_the_reference_and_the_two(path, chained):
    """This launch alone: unchained, its H partials (Metal's form); where chains run, the partials
    summed in the launch (a decoded token's chain is tests/mlx_backend/test_phases.py's)."""
    cfg = _cfg(path)
    rng = np.random.default_rng(23)
    dense, w = _layer(cfg, rng)
    norm = dense[TensorNames.block(0, TensorNames.attn_norm)]
    kv_r, kv_a, kv_b = LayerKV.empty(cfg), MlxLayerKV.empty(cfg), MlxLayerKV.empty(cfg)
    with using_path(path), using_plan(KernelPlan(chained_launches=chained)):
        for t in (3, 2, 2, 3):  # more than one token: no QKV chain
            x = rng.standard_normal((t, cfg.hidden_size)).astype(np.float32)
            ref, kv_r = attention(cfg, dense, 0, kv_r, rms_norm(x, norm, cfg.rms_norm_eps))
            assert attend_project.applies(t, kv_a.length + t, w.wo)
            name, parts = ("strata_attend_project_sum", 1) if attend_project.sums_parts() else ("strata_attend_project",
                                                                                                 cfg.n_heads)
            before = LAUNCHES[name]
            one, kv_a = attention_partials(cfg, w, kv_a, mx.array(x))
            again, _ = attention_partials(cfg, w, MlxLayerKV(kv_a.keys, kv_a.values, kv_a.length - t), mx.array(x))
            assert LAUNCHES[name] - before == 2 and one.shape == (t, parts, cfg.hidden_size)
            np.testing.assert_array_equal(np.array(one), np.array(again))  # a fixed order: the same bits
            two, kv_b = unfused_partials(cfg, w, kv_b, mx.array(x))
            what = f"window of {t} ending at {kv_a.length}"
            assert_backends_agree(ref, one.sum(axis=1), "FAST", what=what)
            assert_backends_agree(np.array(two[:, 0]), one.sum(axis=1), "FAST", what=f"{what}: vs two launches")
            n = kv_a.length
            np.testing.assert_array_equal(np.array(kv_a.keys)[:, :n], np.array(kv_b.keys)[:, :n])  # the same writer code
            np.testing.assert_array_equal(np.array(kv_a.values)[:, :n], np.array(kv_b.values)[:, :n])
            assert not np.array(kv_a.keys)[:, n:].any(), "written past the window"


def test_refuses_what_it_does_not_serve():
    wo = mx.zeros((8, 8), mx.float16)
    assert attend_project.applies(1, 8, wo)
    assert not attend_project.applies(attend_project.MAX_TOKENS + 1, 8, wo)  # a prompt chunk: attend, then the GEMV
    assert not attend_project.applies(1, 10_000, wo)  # a long context: the split attend
    assert not attend_project.applies(1, 8, wo.astype(mx.int8))  # a Q8_0 matrix: the Q8_0 GEMV


def test_prefetch_depth_changes_no_bits():
    """How much of each W_o row is loaded before the attention changes when, not what, is summed."""

    cfg = replace(SHAPES["tiny"], hidden_size=64, n_heads=4, n_kv_heads=2, head_dim=128, qk_norm=QKNorm.PER_HEAD,
                  max_context=8)
    _, w = _layer(cfg, np.random.default_rng(5))
    cos, sin = rope_table_cached(cfg)
    width = (cfg.n_heads + 2 * cfg.n_kv_heads) * cfg.head_dim
    qkv = mx.array(np.random.default_rng(6).standard_normal((1, width)).astype(np.float32))  # raw q | k | v
    with using_path(KernelPath.EMULATED):
        outs = []
        for pf in (16, 8, 1):
            kv = MlxLayerKV.empty(cfg)
            outs.append(np.array(attend_project.attend_project(qkv, w.q_norm, w.k_norm, cos, sin, kv.keys, kv.values,
                                                               w.wo, 0, cfg.rms_norm_eps, cfg.n_heads, prefetch=pf)))
    np.testing.assert_array_equal(outs[0], outs[1])
    np.testing.assert_array_equal(outs[0], outs[2])


@pytest.mark.parametrize("path", KERNEL_PATHS)
def test_summed_partials_are_the_partials_added_in_head_order(path):
    """Where chains run: the last of a row chunk's blocks adds the chunk's H partials in head order; the
    one part holds, bit for bit, the H partials (the launch without the sum) added so, for tokens
    1 and 3 of a window, twice in a row (the counts left zero for the next launch)."""
    cfg = _cfg(path)
    _, w = _layer(cfg, np.random.default_rng(8))
    cos, sin = rope_table_cached(cfg)
    width = (cfg.n_heads + 2 * cfg.n_kv_heads) * cfg.head_dim
    with using_path(path):
        if not attend_project.sums_parts():
            pytest.skip("the partials are summed on CUDA and the emulator only")
        for t in (1, 3, 1):
            qkv = mx.array(np.random.default_rng(t).standard_normal((t, width)).astype(np.float32))
            got = {}
            for summed in (False, True, True):
                with using_plan(KernelPlan(chained_launches=summed)):
                    kv = MlxLayerKV.empty(cfg)
                    got.setdefault(summed, []).append(np.array(attend_project.attend_project(
                        qkv, w.q_norm, w.k_norm, cos, sin, kv.keys, kv.values, w.wo, 0, cfg.rms_norm_eps,
                        cfg.n_heads)))
            parts = got[False][0]
            assert parts.shape == (t, cfg.n_heads, cfg.hidden_size)
            want = parts[:, 0].copy()
            for h in range(1, cfg.n_heads):
                want += parts[:, h]  # float32, in head order
            for one in got[True]:
                assert one.shape == (t, 1, cfg.hidden_size)
                assert one[:, 0].tobytes() == want.tobytes()
