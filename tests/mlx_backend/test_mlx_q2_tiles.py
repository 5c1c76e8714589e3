"""The Q2_0 tile kernel (strata/mlx_backend/kernels/q2_tiles.py) and its expert step
(strata/mlx_backend/grouped_tiles.py, GroupedGemm.Q2_TILES): the tile table's invariants (ops),
the step against the reference's per-token experts and bit for bit against the padded kernel
form (the emulator, the GPU where MLX has one), and the Metal / CUDA sources compile-checked."""

from __future__ import annotations

import mlx.core as mx
import numpy as np
import pytest

from kernel_paths import KERNEL_PATHS
from mlx_agree import assert_backends_agree
from q2_records import CFG, q2_records
from strata.mlx_backend.grouped import GroupedGemm, grouped_experts
from strata.mlx_backend.grouped_tiles import tile_bound, tile_table
from strata.mlx_backend.kernel_plan import KernelPlan, using_plan
from strata.mlx_backend.kernels import emulate
from strata.mlx_backend.kernels.launch import KernelPath, recording, using_path
from strata.mlx_backend.kernels.preludes import Dialect
from strata.reference.experts import routed_experts

def _routing(t: int, k: int, seed: int, *, skewed: bool = False):
    """h [t, D], experts [t, k] (distinct per token; skewed: every token the same k experts), weights [t, k]."""
    rng = np.random.default_rng(seed)
    h = rng.standard_normal((t, CFG.hidden_size)).astype(np.float32)
    if skewed:
        ids = np.tile(np.array([3, 0, 4][:k], np.int32), (t, 1))
    else:
        ids = np.stack([rng.choice(CFG.n_experts, k, replace=False) for _ in range(t)]).astype(np.int32)
    return h, ids, rng.uniform(0.1, 1.0, (t, k)).astype(np.float32)


@pytest.mark.parametrize("n,e,per_tile,seed", [(1, 3, 32, 0), (70, 5, 32, 1), (200, 4, 64, 2), (96, 256, 32, 3)])
def test_tile_table_covers_every_pair_once(n, e, per_tile, seed):
    """Each sorted pair is in exactly one tile, a tile holds one expert's pairs (at most per_tile,
    consecutive), the real tiles come first and fit the host's bound; experts without pairs
    (most of them at e = 256) get no tile."""
    rng = np.random.default_rng(seed)
    by_expert = np.sort(rng.integers(0, max(1, e // 2), n)).astype(np.int32)  # half the experts unused
    tab = np.array(tile_table(mx.array(by_expert), e, per_tile))
    assert tab.shape == (tile_bound(n, e, per_tile), 4)
    covered = np.zeros(n, np.int64)
    real = tab[:, 2] > 0
    assert (tab[:, 2] >= 0).all() and (tab[:, 2] <= per_tile).all()
    assert not real[np.argmin(real):].any() or real.all()  # the used tiles first, then only empty ones
    for ex, first, pairs, _ in tab[real]:
        covered[first:first + pairs] += 1
        assert (by_expert[first:first + pairs] == ex).all()
    assert (covered == 1).all()
    counts = np.bincount(by_expert, minlength=e)
    assert real.sum() == sum(-(-c // per_tile) for c in counts)


@pytest.mark.parametrize("path", KERNEL_PATHS)
@pytest.mark.parametrize("skewed", [False, True], ids=["random", "every_token_same_experts"])
def test_q2_tiles_is_the_padded_kernel_and_the_reference(path, skewed):
    """Q2_TILES: the reference's per-token experts within FAST, and within FAST of the padded
    kernel form Q2_MMA (the same k loop per row; silu(g) u in the kernel, whose exp is the
    dialect's: expf on CUDA as MLX's own, std::exp on the emulator against MLX's CPU exp, a few
    ulps apart). Skewed routing puts every token on the same experts: groups of T pairs, several
    tiles each."""
    rec, experts, records = q2_records()
    t, k = 70, 3
    h, ids, wts = _routing(t, k, 1, skewed=skewed)
    with using_path(path):
        got = np.array(grouped_experts(records, rec, mx.array(h), mx.array(ids), mx.array(wts), dtype=mx.float16,
                                       gemm=GroupedGemm.Q2_TILES))
        padded = np.array(grouped_experts(records, rec, mx.array(h), mx.array(ids), mx.array(wts),
                                          dtype=mx.float16, gemm=GroupedGemm.Q2_MMA))
    assert_backends_agree(padded, got, "FAST", what="q2_tiles (silu in the kernel) vs q2_mma")
    ref = np.stack([routed_experts([experts[int(e)] for e in ids[i]], wts[i], h[i]) for i in range(t)])
    assert_backends_agree(ref, got, "FAST", what="grouped experts through q2_tiles")


def test_q2_tiles_refuses_the_ops_path():
    rec, _, records = q2_records()
    h, ids, wts = _routing(4, 2, 0)
    with using_path(KernelPath.OPS), pytest.raises(ValueError, match="Q2_TILES is a kernel"):
        grouped_experts(records, rec, mx.array(h), mx.array(ids), mx.array(wts), gemm=GroupedGemm.Q2_TILES)


@pytest.mark.skipif(not emulate.available(), reason="no C++ compiler")
@pytest.mark.parametrize("dialect", [Dialect.METAL, Dialect.CUDA], ids=["metal", "cuda"])
def test_q2_tiles_sources_compile(tmp_path, dialect):
    """The specialisations that ran (gate | up gathered with silu(g) u in the kernel; down
    scattered and weighted), as the full Metal and CUDA sources (Metal: compile-checked, not run)."""
    from test_metal_compile import _check

    rec, _, records = q2_records()
    h, ids, wts = _routing(6, 2, 0)
    with using_path(KernelPath.EMULATED), recording() as specs:
        mx.eval(grouped_experts(records, rec, mx.array(h), mx.array(ids), mx.array(wts), dtype=mx.float16,
                                gemm=GroupedGemm.Q2_TILES))
    assert len([s for s in specs if not s[0].name.startswith("strata_pair_")]) == 2  # the pair sort's: test_mlx_pair_sort.py
    errors = [e for e in (_check(tmp_path, dialect, s) for s in specs) if e]
    assert not errors, "\n\n".join(errors)


@pytest.mark.parametrize("path", KERNEL_PATHS)
def test_q2_tiles_reads_experts_at_their_slots(path):
    """slots: expert e's record at arena row slots[e] (a streaming pass's used slots, no copy of
    them), bit for bit the same step over those records taken out (and the padded form's within FAST)."""
    rec, _, records = q2_records()
    arena = mx.concatenate([mx.zeros((3, records.shape[1]), mx.uint8), records[::-1]])  # expert e at row 7 - e
    slots = mx.array(np.array([7 - e for e in range(CFG.n_experts)], np.int32))
    h, ids, wts = _routing(40, 3, 2)
    with using_path(path):
        got = grouped_experts(arena, rec, mx.array(h), mx.array(ids), mx.array(wts), gemm=GroupedGemm.Q2_TILES,
                              slots=slots)
        want = grouped_experts(records, rec, mx.array(h), mx.array(ids), mx.array(wts), gemm=GroupedGemm.Q2_TILES)
        padded = grouped_experts(arena, rec, mx.array(h), mx.array(ids), mx.array(wts), gemm=GroupedGemm.Q2_MMA,
                                 slots=slots)
    np.testing.assert_array_equal(np.array(got), np.array(want))
    assert_backends_agree(np.array(padded), np.array(got), "FAST", what="q2_tiles at slots vs q2_mma")


def test_the_crossing_is_the_forms():
    """grouped_pays asks the form that would run: PADDED never (measured slower than the fused
    kernel at every length), Q2_TILES from MIN_PAIRS pairs an expert; the plan's grouped_min_pairs
    overrides."""
    from strata.mlx_backend import grouped

    with using_plan(KernelPlan(grouped_gemm=GroupedGemm.PADDED)):
        assert not grouped.grouped_pays(10**6, 256)
    with using_plan(KernelPlan(grouped_gemm=GroupedGemm.Q2_TILES)):
        least = grouped.MIN_PAIRS[GroupedGemm.Q2_TILES]
        assert grouped.grouped_pays(least * 256, 256) and not grouped.grouped_pays(least * 256 - 1, 256)
    with using_plan(KernelPlan(grouped_gemm=GroupedGemm.PADDED, grouped_min_pairs=0)):
        assert grouped.grouped_pays(1, 256)


@pytest.mark.skipif(not emulate.available(), reason="no C++ compiler")
def test_q2_tiles_columns_a_block_do_not_change_the_product():
    """64 or 128 output columns a block: each output's k loop is the same, so the same bits."""
    from strata.mlx_backend.kernels.q2_tiles import BM, q2_tiles

    rec, _, records = q2_records()
    h, ids, wts = _routing(50, 3, 5)
    flat = mx.array(ids.reshape(-1))
    order = mx.argsort(flat).astype(mx.int32)
    tiles = tile_table(flat[order], CFG.n_experts, BM // 2)
    x, w = mx.array(h), mx.array(wts.reshape(-1))
    with using_path(KernelPath.EMULATED):
        got = [np.array(q2_tiles(x, order // 3, order, w, tiles, flat.size, records, rec, ("gate", "up"),
                                 gather=True, scatter=False, bn=bn)) for bn in (64, 128)]
    np.testing.assert_array_equal(got[0], got[1])


@pytest.mark.skipif(not emulate.available(), reason="no C++ compiler")
@pytest.mark.parametrize("shape", ["tiny", "sigmoid"])
def test_prompt_forward_through_q2_tiles(shape, monkeypatch):
    """The prompt path with every MoE layer's experts through Q2_TILES (emulated kernels, float16
    dense weights): the reference's logits at every position within PROMPT, a prompt far from
    routing ties."""
    from strata.mlx_backend import grouped
    from strata.mlx_backend.model import MlxModelState, from_reference
    from strata.mlx_backend.prompt import prompt_forward
    from strata.reference import model as ref_model
    from test_mlx_prompt import made_params, min_gap

    rp = made_params(shape, seed=3)
    rng = np.random.default_rng(5)
    for _ in range(20):
        tokens = rng.integers(0, rp.cfg.vocab_size, 24)
        ref, _, trace = ref_model.forward(rp, ref_model.ModelState.empty(rp.cfg), tokens, trace=True)
        if min_gap(trace, rp.cfg.n_experts_per_token) > 2e-2:
            break
    else:
        pytest.skip("no prompt without a near-tie in 20 draws")
    calls = []
    real = grouped.q2_tile_experts
    monkeypatch.setattr(grouped, "q2_tile_experts", lambda *a, **kw: calls.append(1) or real(*a, **kw))
    with using_path(KernelPath.EMULATED), using_plan(KernelPlan(grouped_gemm=GroupedGemm.Q2_TILES, grouped_min_pairs=0)):
        got, _ = prompt_forward(from_reference(rp), MlxModelState.empty(rp.cfg), tokens, all_logits=True)
    assert len(calls) == rp.cfg.n_moe_layers
    assert_backends_agree(ref, np.array(got), "PROMPT", what=f"{shape}: prompt path through q2_tiles")
