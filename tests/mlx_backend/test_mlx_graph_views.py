"""Large kernel inputs go to MLX as views of their first elements (the kernel plan's graph_views: MLX's CUDA
encoder counts whole input arrays toward its graph-commit limit). The view must keep the data
pointer, so the kernels read the same bytes: the decoded token's logits and KV cache with views
on and off, bit for bit (GPU); on the CPU, what the view holds.
"""

from __future__ import annotations

import mlx.core as mx
import numpy as np
import pytest

from strata.mlx_backend.kernel_plan import KernelPlan, using_plan
from strata.mlx_backend import model as mlx_model
from strata.mlx_backend.kernels import launch
from strata.mlx_backend.kernels.launch import KernelPath, gpu_dialect, using_path
from strata.mlx_backend.kernels.source import MIN_INPUT_SIZE


def test_graph_view_keeps_the_first_elements_and_leaves_small_arrays():
    small = mx.arange(16, dtype=mx.float32)
    assert launch._graph_view(small) is small
    big = mx.arange(launch.GRAPH_VIEW_ABOVE, dtype=mx.int32).reshape(-1, 64)  # 4 MB
    v = launch._graph_view(big)
    assert v.shape == (MIN_INPUT_SIZE,) and v.dtype == big.dtype
    np.testing.assert_array_equal(np.array(v), np.arange(MIN_INPUT_SIZE))
    # a transposed array: its row-major copy's first elements (the kernel reads the copy)
    t = launch._graph_view(big.T)
    np.testing.assert_array_equal(np.array(t), np.array(big.T).reshape(-1)[:MIN_INPUT_SIZE])
    # past int32 elements (an arena of 3 GB, never evaluated here): its first row, not a flat view
    arena = mx.zeros((3, 2**30), mx.uint8)
    assert launch._graph_view(arena).shape == (1, 2**30)


@pytest.mark.gpu
@pytest.mark.skipif(gpu_dialect() is None, reason="no MLX GPU here")
def test_views_change_no_bit_of_a_decode(monkeypatch):
    from test_mlx_compiled import SMALL, greedy_steps
    from strata.testing.mlx_params import random_params

    monkeypatch.setattr(launch, "GRAPH_VIEW_ABOVE", 0)  # every input a view: the arena, weights, caches
    out = []
    with using_path(KernelPath.GPU):
        p = random_params(SMALL, seed=21, pred_q8=False)
        for views in (False, True):
            with using_plan(KernelPlan(graph_views=views)):
                out.append(greedy_steps(p))
    for a, b in zip(*out):
        assert a.tobytes() == b.tobytes()


def test_constant_views_are_made_once_and_given_only_for_the_same_array(monkeypatch):
    """The compiled step's constants' views, made and evaluated before its trace: `_graph_view`
    gives the very view made for that array (a leaf of the graph), and a traced one for any other
    array, even one equal to it."""
    from strata.mlx_backend.kernels.preludes import Dialect

    monkeypatch.setattr(launch, "gpu_dialect", lambda: Dialect.CUDA)
    big = mx.arange(launch.GRAPH_VIEW_ABOVE, dtype=mx.int32).reshape(-1, 64)  # 4 MB
    small = mx.arange(16, dtype=mx.float32)
    mx.eval(big, small)
    views = launch.constant_views([big, small, big])
    assert list(views) == [id(big)]  # small arrays are given whole; one view per array
    held, view = views[id(big)]
    assert held is big
    np.testing.assert_array_equal(np.array(view), np.arange(MIN_INPUT_SIZE))
    twin = mx.array(np.array(big))  # equal values, another array
    before = dict(launch.VIEW_COUNTS)
    with launch.using_constant_views(views):
        assert launch._graph_view(big) is view
        other = launch._graph_view(twin)
        assert other is not view
        np.testing.assert_array_equal(np.array(other), np.arange(MIN_INPUT_SIZE))
    assert launch._graph_view(big) is not view  # outside: traced as before
    assert launch.VIEW_COUNTS["constant"] - before.get("constant", 0) == 1
    assert launch.VIEW_COUNTS["traced"] - before.get("traced", 0) == 2
    with using_plan(KernelPlan(graph_views=False)):
        assert launch.constant_views([big]) == {}


def test_constant_arrays_are_the_weights_arena_and_buffers():
    from strata.mlx_backend.compiled import _constant_arrays
    from strata.testing.mlx_params import random_params
    from test_mlx_compiled import SMALL

    p = random_params(SMALL, seed=5, pred_q8=False)
    state = mlx_model.MlxModelState.empty(p.cfg)
    got = {id(a) for a in _constant_arrays(p, state)}
    assert id(p.output) in got and id(p.embed) in got and id(p.arena.array) in got
    assert id(p.layers[0].attn.wqkv) in got and id(p.layers[-1].attn.wo) in got
    assert id(state.layers[0].keys) in got and id(state.layers[1].values) in got


@pytest.mark.gpu
@pytest.mark.skipif(gpu_dialect() is None, reason="no MLX GPU here")
def test_constant_views_change_no_bit_of_a_compiled_decode(monkeypatch):
    """Every input a view (GRAPH_VIEW_ABOVE 0), made before the trace: the compiled step's logits
    and KV cache equal the uncompiled forward's bit for bit, and the trace took its views from
    the constants."""
    from test_mlx_compiled import _assert_same_decode, _decode_both, SMALL
    from strata.mlx_backend import compiled
    from strata.testing.mlx_params import random_params

    monkeypatch.setattr(launch, "GRAPH_VIEW_ABOVE", 0)
    with using_path(KernelPath.GPU):
        p = random_params(SMALL, seed=22, pred_q8=False)
        before = launch.VIEW_COUNTS["constant"]
        ref, got, ref_state, got_state, _ = _decode_both(p, traced=True)
        assert launch.VIEW_COUNTS["constant"] > before
        _assert_same_decode(ref, got, ref_state, got_state)
