"""The prompt's routing kernels: the counting sort of the (token, expert) pairs into the tile table
(strata/mlx_backend/kernels/pair_sort.py) and the top-k ranking (kernels/prompt_topk.py), each
equal to the ops it replaces (a stable argsort, `order // k`, `grouped_tiles.tile_table`; the
uint64-key `top_k`), on the emulator and the GPU where MLX has one; their Metal and CUDA sources
compile-checked (Metal: not run)."""

from __future__ import annotations

import mlx.core as mx
import numpy as np
import pytest

from kernel_paths import KERNEL_PATHS
from mlx_agree import assert_backends_agree
from strata.mlx_backend import grouped
from strata.mlx_backend.grouped import top_k
from strata.mlx_backend.grouped_tiles import tile_bound, tile_table
from strata.mlx_backend.kernels import emulate
from strata.mlx_backend.kernels.launch import KernelPath, recording, using_path
from strata.mlx_backend.kernels.pair_sort import sort_pairs
from strata.mlx_backend.kernels.preludes import Dialect
from strata.mlx_backend.kernels.prompt_topk import topk_kernel
from strata.model_config import RoutingOrder
from strata.reference.routing import RouterRule


def _experts(t: int, k: int, e: int, seed: int, kind: str) -> np.ndarray:
    rng = np.random.default_rng(seed)
    if kind == "skewed":  # every token the same k experts: groups of t pairs, several tiles each
        return np.tile(rng.choice(e, k, replace=False).astype(np.int32), (t, 1))
    if kind == "few":  # a few experts of many used (most blocks count nothing), the last one unused
        return np.stack([rng.choice(max(k, e // 8), k, replace=False) for _ in range(t)]).astype(np.int32)
    return np.stack([rng.choice(e, k, replace=False) for _ in range(t)]).astype(np.int32)


@pytest.mark.parametrize("path", KERNEL_PATHS)
@pytest.mark.parametrize("t,k,e,per_tile,kind,seed,with_slots", [
    (1, 1, 8, 32, "random", 0, False), (70, 3, 8, 32, "random", 1, True), (70, 3, 8, 32, "skewed", 2, False),
    (300, 4, 16, 64, "random", 3, True), (33, 6, 64, 32, "few", 4, False), (1000, 2, 9, 32, "random", 5, True)])
def test_sort_pairs_is_the_stable_argsort_and_the_tile_table(path, t, k, e, per_tile, kind, seed, with_slots):
    """order: every pair once, grouped by expert, ascending inside a group (numpy's stable
    argsort); src: each sorted pair's token; tiles: `tile_table` of the sorted ids, row for row,
    the empty tiles past the real ones included (slots: the record column holds expert e's slot)."""
    ids = _experts(t, k, e, seed, kind)
    flat = ids.reshape(-1)
    slots = np.random.default_rng(seed).permutation(e + 3)[:e].astype(np.int32) if with_slots else None
    bound = tile_bound(flat.size, e, per_tile)
    with using_path(path):
        order, src, tiles = sort_pairs(mx.array(ids), e, per_tile, bound, None if slots is None else mx.array(slots))
        order, src, tiles = np.array(order), np.array(src), np.array(tiles)
    want = np.argsort(flat, kind="stable").astype(np.int32)
    np.testing.assert_array_equal(order, want)
    np.testing.assert_array_equal(src, want // k)
    want_tiles = np.array(tile_table(mx.array(flat[want]), e, per_tile, None if slots is None else mx.array(slots)))
    np.testing.assert_array_equal(tiles, want_tiles)


RANK_ROWS = [
    [1.0, -2.0, 1.0, 0.0, -0.0, 3.0, -7.0, 1.0],
    [-0.0, 0.0, -0.0, 0.0, 5.0, 5.0, -1.0, -1.0],
    [-1.0, -1.0, 2.0, -1.0, 2.0, 2.0, -3.0, 0.5],
    [-np.inf, 0.5, -np.inf, -2.0, -np.inf, -np.inf, 1.0, -np.inf],  # a sigmoid rule's masked groups
]


@pytest.mark.parametrize("path", KERNEL_PATHS)
@pytest.mark.parametrize("e,k", [(8, 5), (256, 10), (300, 8)])
def test_topk_kernel_is_the_key_sort(path, e, k):
    """The kernel's selection is the uint64 key sort's, rank for rank: ties to the lower id,
    -0.0 equal to 0.0, -inf below every finite score; many ties (scores rounded to 0.1)."""
    rng = np.random.default_rng(e + k)
    rows = [np.resize(np.asarray(r, np.float32), e) for r in RANK_ROWS]
    rows += [rng.standard_normal(e).astype(np.float32) for _ in range(20)]
    rows += [np.round(rng.standard_normal(e), 1).astype(np.float32) for _ in range(20)]
    z = mx.array(np.asarray(rows, np.float32))
    with using_path(KernelPath.OPS):
        want = np.array(top_k(z, k))  # the key sort (this process's default device)
    with using_path(path):
        got = np.array(topk_kernel(z, k))
    np.testing.assert_array_equal(got, want)


@pytest.mark.parametrize("path", KERNEL_PATHS)
@pytest.mark.parametrize("order,norm", [(RoutingOrder.SOFTMAX_TOPK, True), (RoutingOrder.SOFTMAX_TOPK, False),
                                        (RoutingOrder.TOPK_SOFTMAX, False), (RoutingOrder.SIGMOID_TOPK, True)])
def test_route_prompt_kernel_is_the_rule(path, order, norm):
    """route_prompt on a kernel path (the top-k kernel, with the softmax rules' weights in its
    launch; the sigmoid rule's scores and weights from ops) against the ops path: the same
    experts in rank order, the weights within ROUTING."""
    rule = RouterRule(10, order, norm_topk_prob=norm)
    z = mx.array(np.random.default_rng(7).standard_normal((40, 256)).astype(np.float32) * 2)
    with using_path(KernelPath.OPS):
        want_e, want_w = (np.array(a) for a in grouped.route_prompt(z, rule))
    with using_path(path):
        got_e, got_w = (np.array(a) for a in grouped.route_prompt(z, rule))
    np.testing.assert_array_equal(got_e, want_e)
    assert_backends_agree(want_w, got_w, "ROUTING", what=f"{order.name} weights")


def test_top_k_takes_the_kernel_on_kernel_paths_only(monkeypatch):
    """The kernel on the emulated and GPU paths, the key sort on the ops path."""
    calls = []
    monkeypatch.setattr(grouped, "topk_kernel", lambda s, k: calls.append(1) or mx.zeros((s.shape[0], k), mx.int32))
    z = mx.array(np.random.default_rng(0).standard_normal((4, 8)).astype(np.float32))
    with using_path(KernelPath.OPS):
        top_k(z, 2)
    assert calls == []
    if emulate.available():
        with using_path(KernelPath.EMULATED):
            top_k(z, 2)
        assert calls == [1]


def test_the_uint64_question_is_asked_once():
    """`_sorts_uint64` is cached by the device's name: mx.default_device() makes a new Device per
    call that hashes apart, and a miss ran a host-synchronising probe sort at every layer."""
    grouped._sorts_uint64.cache_clear()
    z = mx.array(np.random.default_rng(0).standard_normal((4, 8)).astype(np.float32))
    with using_path(KernelPath.OPS):
        for _ in range(3):
            top_k(z, 2)
    assert grouped._sorts_uint64.cache_info().misses == 1


@pytest.mark.skipif(not emulate.available(), reason="no C++ compiler")
@pytest.mark.parametrize("dialect", [Dialect.METAL, Dialect.CUDA], ids=["metal", "cuda"])
def test_routing_kernel_sources_compile(tmp_path, dialect):
    """The specialisations that ran (the counts, the scatter with and without slots, the top-k),
    as the full Metal and CUDA sources (Metal: compile-checked, not run)."""
    from test_metal_compile import _check

    ids = mx.array(_experts(20, 3, 8, 0, "random"))
    with using_path(KernelPath.EMULATED), recording() as specs:
        mx.eval(*sort_pairs(ids, 8, 32, tile_bound(60, 8, 32)))
        mx.eval(*sort_pairs(ids, 8, 32, tile_bound(60, 8, 32), mx.arange(8, dtype=mx.int32)))
        mx.eval(topk_kernel(mx.random.normal((5, 8)), 3))
        for order in (RoutingOrder.SOFTMAX_TOPK, RoutingOrder.TOPK_SOFTMAX):
            mx.eval(*topk_kernel(mx.random.normal((5, 8)), 3, order=order, norm=True))
    assert {s[0].name for s in specs} == {"strata_pair_counts", "strata_pair_scatter", "strata_prompt_topk"}
    errors = [e for e in (_check(tmp_path, dialect, s) for s in specs) if e]
    assert not errors, "\n\n".join(errors)
