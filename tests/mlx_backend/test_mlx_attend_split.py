"""Decode attention split over the context on the emulated kernel path, in both forms: the split
attend merged inside the output projection's blocks (kernels/attend_split.py, the default: two
launches) and the form a Q8_0 W_o takes (attend with CH > 0, kernels/attend_merge.py, the W_o GEMV:
three). Against the reference over contexts of several splits (empty ones past the last position
included), decode windows of T > 1, GQA, the output gate and partial rotary; every step shape
(splits, rows a step); the cache it writes; determinism; when it applies; and the Metal / CUDA
compile check of every kernel (Metal: compile-checked, not run).
"""

from __future__ import annotations

from dataclasses import replace

import mlx.core as mx
import numpy as np
import pytest

from mlx_agree import assert_backends_agree
from strata.mlx_backend.attention import MlxLayerKV, attention_partials
from strata.mlx_backend.kernel_plan import KernelPlan, using_plan
from strata.mlx_backend.kernels import attend_project, attend_split
from strata.mlx_backend.kernels import attention as attn_kernels
from strata.mlx_backend.kernels import emulate
from strata.mlx_backend.kernels.launch import LAUNCHES, KernelPath, recording, using_path
from strata.mlx_backend.kernels.preludes import Dialect
from strata.model_config import QKNorm, TensorNames
from strata.reference.attention import LayerKV, attention, rms_norm
from strata.testing.models import SHAPES
from test_mlx_attention_kernels import _layer, unfused_partials

pytestmark = pytest.mark.skipif(not emulate.available(), reason="no C++20 compiler")

CHUNK = 4  # positions per block in these tests: contexts of a few chunks stay small
SPLITS = 3  # attend_split's splits in these tests: several positions a split, a part-filled step
STEPS = (9, 1, 3, 1, 2)  # a prompt of 9 (not split: T > SPLIT_MAX_T below), then decode windows


@pytest.fixture
def small_chunks(monkeypatch):
    monkeypatch.setattr(attn_kernels, "SPLIT_CHUNK", CHUNK)
    monkeypatch.setattr(attn_kernels, "SPLIT_FROM", CHUNK)
    monkeypatch.setattr(attn_kernels, "SPLIT_MAX_T", 4)
    monkeypatch.setattr(attend_split, "SPLITS", SPLITS)


def _run(cfg, w, dense, rng, steps, partials=attention_partials):
    """Each step's window, (reference, kernel path) outputs, the kernel path's launches, the
    reference's cache and copies of the kernel path's cache buffers (written in place). partials:
    attention_partials, or unfused_partials (attend split by chunks, the merge, the W_o GEMV: a
    Q8_0 W_o's form)."""
    kv_r, kv_f = LayerKV.empty(cfg), MlxLayerKV.empty(cfg)
    norm = dense[TensorNames.block(0, TensorNames.attn_norm)]
    out = []
    for t in steps:
        x = rng.standard_normal((t, cfg.hidden_size)).astype(np.float32)
        ref, kv_r = attention(cfg, dense, 0, kv_r, rms_norm(x, norm, cfg.rms_norm_eps))
        before = sum(LAUNCHES.values())
        parts, kv_f = partials(cfg, w, kv_f, mx.array(x))
        mx.eval(parts)
        out.append((t, ref, parts.sum(axis=1), sum(LAUNCHES.values()) - before, kv_r,
                    (np.array(kv_f.keys), np.array(kv_f.values))))
    return out


def _launches(split: bool, t: int, n: int, wo, merged: bool = True) -> int:
    """A window's launches: QKV GEMV, then the split's two (merged) or three (attend, merge, GEMV),
    else attend and the projection in one (a short window) or two."""
    if split:
        return 3 if merged else 4
    return 2 if merged and attend_project.applies(t, n, wo) else 3


@pytest.mark.parametrize("heads,merged", [((8, 2, 32), True), ((4, 1, 128), True), ((6, 3, 16), False)],
                         ids=["group4_hd32", "group4_hd128", "group2_hd16_chunks"])
def test_split_attention_against_reference(small_chunks, heads, merged):
    h, kvh, hd = heads
    cfg = replace(SHAPES["tiny"], hidden_size=96, n_heads=h, n_kv_heads=kvh, head_dim=hd, qk_norm=QKNorm.PER_HEAD,
                  max_context=40)  # 10 chunks of 4: most are empty at these lengths
    rng = np.random.default_rng([h, kvh, hd, 19])
    dense, w = _layer(cfg, rng)
    with using_path(KernelPath.EMULATED):
        n = 0
        for t, ref, got, launches, kv_r, (keys, values) in _run(cfg, w, dense, rng, STEPS,
                                                                 attention_partials if merged else unfused_partials):
            n += t
            split = attn_kernels.split_applies(n, t)
            assert split == (t <= 4 and n > CHUNK)
            assert launches == _launches(split, t, n, w.wo, merged)
            what = f"window of {t} ending at {n} (split {split})"
            assert_backends_agree(ref, got, "FAST", what=what)
            assert_backends_agree(kv_r.keys, keys[:, :n], "FAST", what=f"{what}: cached keys")
            assert_backends_agree(kv_r.values, values[:, :n], "FAST", what=f"{what}: cached values")
            assert not keys[:, n:].any() and not values[:, n:].any(), "written past the window"


@pytest.mark.parametrize("gated", [True, False], ids=["gated", "ungated"])
def test_split_gated_partial_rotary_against_reference(small_chunks, gated):
    cfg = replace(SHAPES["hybrid"], hidden_size=64, n_heads=4, n_kv_heads=1, head_dim=96, rotary_dim=24,
                  attention_output_gate=gated, max_context=24)
    rng = np.random.default_rng([96, 24, int(gated)])
    dense, w = _layer(cfg, rng)
    with using_path(KernelPath.EMULATED):
        for t, ref, got, launches, _, _ in _run(cfg, w, dense, rng, (5, 1, 2, 1)):
            assert launches == (2 if t > 4 else 3)  # the prompt of 5: one block per head, fused with the projection
            assert_backends_agree(ref, got, "FAST", what=f"gated={gated}: window of {t}")


def test_split_is_deterministic_and_agrees_with_one_block_per_head(small_chunks, monkeypatch):
    """The same token twice: the same bits (a fixed merge order); and the split output equals the
    one-block-per-head output to float32 reordering."""
    cfg = replace(SHAPES["tiny"], hidden_size=64, n_heads=4, n_kv_heads=2, head_dim=32, max_context=32)
    rng = np.random.default_rng(11)
    _, w = _layer(cfg, rng)
    prefix = mx.array(rng.standard_normal((3, 64)).astype(np.float32))
    xs = [mx.array(rng.standard_normal((1, 64)).astype(np.float32)) for _ in range(14)]
    with using_path(KernelPath.EMULATED):
        _, kv = attention_partials(cfg, w, MlxLayerKV.empty(cfg), prefix)
        for x in xs[:-1]:  # 16 positions: 4 chunks
            _, kv = attention_partials(cfg, w, kv, x)
        a, _ = attention_partials(cfg, w, kv, xs[-1])
        b, _ = attention_partials(cfg, w, kv, xs[-1])
        np.testing.assert_array_equal(np.array(a), np.array(b))
        chunks, _ = unfused_partials(cfg, w, kv, xs[-1])
        monkeypatch.setattr(attn_kernels, "SPLIT_FROM", 1 << 30)
        one, _ = attention_partials(cfg, w, kv, xs[-1])
    assert a.shape == (1, cfg.n_heads, cfg.hidden_size) and chunks.shape == (1, 1, cfg.hidden_size)
    assert_backends_agree(np.array(one.sum(axis=1)), a.sum(axis=1), "FAST", what="split vs one block per head")
    assert_backends_agree(np.array(chunks[:, 0]), a.sum(axis=1), "FAST", what="merged in W_o's blocks vs chunks")


@pytest.mark.parametrize("splits,rows,per_round", [(1, 4, 4), (7, 3, 2), (40, 4, 4), (3, 5, 4)],
                         ids=["one_split", "ragged", "mostly_empty", "five_rows"])
def test_every_step_shape_against_reference(small_chunks, monkeypatch, splits, rows, per_round):
    """attend_split's step shapes: one split (a warp takes two steps of rows, the second's loads
    issued after the first's update), splits that do not divide the context with 3 rows a step
    and the window's own positions made 2 a round (a window of 3: two rounds), more splits than
    positions (empty splits, weight 0 in the merge)."""
    monkeypatch.setattr(attend_split, "SPLITS", splits)
    monkeypatch.setattr(attend_split, "POSITIONS_PER_STEP", rows)
    monkeypatch.setattr(attend_split, "NEW_PER_ROUND", per_round)
    cfg = replace(SHAPES["tiny"], hidden_size=64, n_heads=4, n_kv_heads=2, head_dim=32, qk_norm=QKNorm.PER_HEAD,
                  max_context=40)
    rng = np.random.default_rng([splits, rows])
    dense, w = _layer(cfg, rng)
    with using_path(KernelPath.EMULATED):
        n = 0
        for t, ref, got, launches, kv_r, (keys, _) in _run(cfg, w, dense, rng, (33, 1, 3)):
            n += t
            assert launches == _launches(attn_kernels.split_applies(n, t), t, n, w.wo)
            assert_backends_agree(ref, got, "FAST", what=f"{splits} splits, {rows} rows a step: window of {t} at {n}")
            assert_backends_agree(kv_r.keys, keys[:, :n], "FAST", what="cached keys")


@pytest.mark.parametrize("splits,rows,per_round,heads",
                         [(1, 4, 4, 4), (7, 3, 2, 4), (3, 5, 4, 4), (2, 4, 4, 8), (2, 5, 4, 8)],
                         ids=["two_steps", "ragged", "five_rows", "32_scores", "40_scores"])
def test_scores_summed_at_once_give_the_same_bits(small_chunks, monkeypatch, splits, rows, per_round, heads):
    """The plan's spread_scores (a step's scores summed at once, each divided and exponentiated by one
    lane, the values read from their lanes): the same outputs and cache, bit for bit, as each
    score summed by its own warp_sum, on the emulator (whose warp_sum order the spread sum keeps;
    CUDA's is its xor levels, which it keeps too). 8 heads a block: 32 scores a step with 4 rows
    (every lane one), 40 with 5 (past a warp's 32: the other form)."""
    monkeypatch.setattr(attend_split, "SPLITS", splits)
    monkeypatch.setattr(attend_split, "POSITIONS_PER_STEP", rows)
    monkeypatch.setattr(attend_split, "NEW_PER_ROUND", per_round)
    cfg = replace(SHAPES["tiny"], hidden_size=64, n_heads=heads, n_kv_heads=1 if heads == 8 else 2, head_dim=32,
                  qk_norm=QKNorm.PER_HEAD, max_context=40)
    got = {}
    for spread in (False, True):
        rng = np.random.default_rng([splits, rows, heads])
        dense, w = _layer(cfg, rng)
        with using_path(KernelPath.EMULATED), using_plan(KernelPlan(spread_scores=spread)):
            got[spread] = [(np.array(out), np.array(keys)) for _, _, out, _, _, (keys, _) in
                           _run(cfg, w, dense, rng, (33, 1, 3))]
    assert len(got[True]) == 3
    for (a, ka), (b, kb) in zip(got[False], got[True]):
        assert a.tobytes() == b.tobytes() and ka.tobytes() == kb.tobytes()


@pytest.mark.gpu
@pytest.mark.parametrize("rows", [4, 5])
def test_scores_summed_at_once_give_the_same_bits_on_the_gpu(monkeypatch, rows):
    """spread_scores against each score's own warp_sum on the GPU at the seed shape's heads (16 q / 4 KV
    of 128: 16 or 20 scores a step), bit for bit: warp_sum's xor levels kept."""
    from strata.mlx_backend.kernels.launch import gpu_dialect

    if gpu_dialect() is None:
        pytest.skip("no MLX GPU here")
    monkeypatch.setattr(attend_split, "POSITIONS_PER_STEP", rows)
    cfg = replace(SHAPES["tiny"], hidden_size=2560, n_heads=16, n_kv_heads=4, head_dim=128, qk_norm=QKNorm.PER_HEAD,
                  max_context=512)
    got = {}
    for spread in (False, True):
        rng = np.random.default_rng(rows)
        dense, w = _layer(cfg, rng)
        with using_path(KernelPath.GPU), using_plan(KernelPlan(spread_scores=spread)):
            got[spread] = [(np.array(out), np.array(keys)) for _, _, out, _, _, (keys, _) in
                           _run(cfg, w, dense, rng, (300, 1, 1, 3))]
    for (a, ka), (b, kb) in zip(got[False], got[True]):
        assert a.tobytes() == b.tobytes() and ka.tobytes() == kb.tobytes()


def test_heads_per_block():
    assert attend_split.heads_per_block(16, 4, 128) == 4  # the seed shape: a KV head's 4 q heads in one block
    assert attend_split.heads_per_block(16, 4, 256) == 2  # HPB x HD <= MAX_HEAD_ROWS
    assert attend_split.heads_per_block(6, 3, 16) == 2 and attend_split.heads_per_block(12, 4, 64) == 1
    assert attend_split.heads_per_block(64, 1, 32) == 8  # at most a warp a head: warps 0 .. HPB - 1 make q


def test_split_applies_to_long_decode_only():
    s = attn_kernels
    assert not s.split_applies(s.SPLIT_FROM, 1) and s.split_applies(s.SPLIT_FROM + 1, 1)
    assert not s.split_applies(10 * s.SPLIT_FROM, s.SPLIT_MAX_T + 1)  # a prompt chunk


@pytest.mark.parametrize("dialect", [Dialect.METAL, Dialect.CUDA], ids=["metal", "cuda"])
def test_split_kernels_compile(tmp_path, small_chunks, monkeypatch, dialect):
    """Both split forms' kernels (gated): attend_split and merge_project; attend with CH > 0 and
    the merge; as Metal (compile-checked, not run) and CUDA."""
    from test_metal_compile import _check

    cfg = replace(SHAPES["hybrid"], hidden_size=64, n_heads=4, n_kv_heads=1, head_dim=128, rotary_dim=32,
                  attention_output_gate=True, max_context=16)
    _, w = _layer(cfg, np.random.default_rng(0))
    with using_path(KernelPath.EMULATED), recording() as rec:
        _, kv = attention_partials(cfg, w, MlxLayerKV.empty(cfg), mx.ones((5, cfg.hidden_size)))
        parts, _ = attention_partials(cfg, w, kv, mx.ones((1, cfg.hidden_size)))
        chunks, _ = unfused_partials(cfg, w, kv, mx.ones((1, cfg.hidden_size)))
        mx.eval(parts, chunks)
    split = [r for r in rec if dict(r[3]).get("CH") == CHUNK or "NS" in dict(r[3])]
    assert sorted(r[0].name for r in split) == ["strata_attend", "strata_attend_merge", "strata_attend_split",
                                                "strata_merge_project"]
    for r in split:
        assert _check(tmp_path, dialect, r) is None


@pytest.fixture
def split_midway(monkeypatch):
    """The split starts in the middle of test_mlx_compiled's decode (3 prompt positions, 6 steps)."""
    monkeypatch.setattr(attn_kernels, "SPLIT_CHUNK", CHUNK)
    monkeypatch.setattr(attn_kernels, "SPLIT_FROM", 5)


def test_device_scalar_step_crosses_into_the_split(split_midway):
    """The step the GPU traces (untraced here, on the emulator) against `forward` while the
    context grows past SPLIT_FROM: bit for bit (both take the same form at each length)."""
    from test_mlx_compiled import SMALL, _assert_same_decode, _decode_both
    from strata.testing.mlx_params import random_params

    with using_path(KernelPath.EMULATED):
        p = random_params(SMALL, seed=19, pred_q8=False)
        ref, got, ref_state, got_state, step = _decode_both(p, traced=False)
    _assert_same_decode(ref, got, ref_state, got_state)
    assert sorted(step._fns) == [False, True]


@pytest.mark.gpu
def test_compiled_decode_crosses_into_the_split(split_midway):
    """Compiled (two traces: one block per head, then split) against uncompiled, bit for bit."""
    from strata.mlx_backend.kernels.launch import gpu_dialect
    from test_mlx_compiled import SMALL, _assert_same_decode, _decode_both
    from strata.testing.mlx_params import random_params

    if gpu_dialect() is None:
        pytest.skip("no MLX GPU here")
    with using_path(KernelPath.GPU):
        p = random_params(SMALL, seed=20, pred_q8=False)
        ref, got, ref_state, got_state, step = _decode_both(p, traced=True)
    _assert_same_decode(ref, got, ref_state, got_state)
    assert sorted(step._fns) == [False, True]


@pytest.mark.gpu
@pytest.mark.parametrize("merged", [True, False], ids=["merged", "chunks"])
def test_split_on_the_gpu_at_the_seed_heads(merged):
    """The seed shape's heads (16 q / 4 KV of 128, D 2560) past SPLIT_FROM with the module's own
    split shape (64 splits, 4 rows a step; chunks of 128): a prompt of 300, then decode windows."""
    from strata.mlx_backend.kernels.launch import gpu_dialect

    if gpu_dialect() is None:
        pytest.skip("no MLX GPU here")
    cfg = replace(SHAPES["tiny"], hidden_size=2560, n_heads=16, n_kv_heads=4, head_dim=128, qk_norm=QKNorm.PER_HEAD,
                  max_context=512)
    rng = np.random.default_rng(2048)
    dense, w = _layer(cfg, rng)
    with using_path(KernelPath.GPU):
        n = 0
        for t, ref, got, launches, kv_r, (keys, _) in _run(cfg, w, dense, rng, (300, 1, 3, 1),
                                                           attention_partials if merged else unfused_partials):
            n += t
            split = attn_kernels.split_applies(n, t)
            assert split == (t < 300) and launches == _launches(split, t, n, w.wo, merged)
            assert_backends_agree(ref, got, "FAST", what=f"window of {t} ending at {n} (split {split})")
            assert_backends_agree(kv_r.keys, keys[:, :n], "FAST", what="cached keys")


# the split chain's launch (kernels/attend_split.py), its QKV GEMV walked by KV group
SPLIT_CHAIN = "strata_chain_qkv_groups_attend_split_chained_merge_project_router"


def _split_decode(p, monkeypatch, chained: bool, compiled: bool = False):
    """test_mlx_compiled.greedy_steps (a prompt of 3, then 4 tokens) with the split from 4
    positions on, the split chain on (the default) or its launches apart -> (its three arrays, the
    split chain's launches). The router runs at the chain's 256 threads either way (its norm's
    partial sums are per thread)."""
    from strata.mlx_backend.kernels import router as router_kernel
    from test_mlx_compiled import greedy_steps

    monkeypatch.setattr(attn_kernels, "SPLIT_CHUNK", CHUNK)
    monkeypatch.setattr(attn_kernels, "SPLIT_FROM", 4)
    monkeypatch.setattr(router_kernel, "THREADS", attend_project.THREADS)
    before = LAUNCHES[SPLIT_CHAIN]
    with pytest.MonkeyPatch.context() as m:
        if not chained:
            m.setattr(attend_split, "chains_router", lambda *a: False)
        out = greedy_steps(p, steps=4, compiled=compiled)
    return (*out, LAUNCHES[SPLIT_CHAIN] - before)


@pytest.mark.parametrize("model", ["small", "hybrid_gated"])
def test_the_split_chain_decodes_bit_for_bit(monkeypatch, model):
    """The QKV GEMV, the split attention, its merge in W_o's blocks and the router as one launch
    a layer against their launches apart, past SPLIT_FROM, on the emulator: the same logits and
    cache bits (the hybrid: gated attention with partial rotary, one attention layer)."""
    from strata.testing.mlx_params import random_params
    from test_mlx_compiled import SMALL, SMALL_HYBRID

    cfg = SMALL if model == "small" else SMALL_HYBRID
    attention_layers = sum(k.mixer.name.endswith("ATTENTION") for k in cfg.kinds)
    with using_path(KernelPath.EMULATED):
        p = random_params(cfg, seed=31, pred_q8=False)
        *apart, n_apart = _split_decode(p, monkeypatch, False)
        *chain, n_chained = _split_decode(p, monkeypatch, True)
    assert n_apart == 0 and n_chained == 3 * attention_layers  # positions 5, 6 and 7 split
    for a, b in zip(apart, chain):
        assert a.tobytes() == b.tobytes()


def test_the_split_chain_cuda_source_compiles(tmp_path, monkeypatch):
    """The split chain as MLX's CUDA build would compile it (g++ against the CUDA stub header),
    at the seed shape's heads."""
    from strata.mlx_backend.kernels import phases
    from test_metal_compile import _check
    from test_phases import capturing, zero_route_args

    seen = []
    h = 16
    with using_path(KernelPath.EMULATED):
        monkeypatch.setattr(phases, "launch", capturing(seen))
        attend_split.qkv_split_route(*zero_route_args(h, 4, 128, 512, 512, 16), 300, 1e-6, h)
    assert len(seen) == 1 and seen[0][0].name == SPLIT_CHAIN
    assert _check(tmp_path, Dialect.CUDA, seen[0]) is None


@pytest.mark.gpu
def test_the_split_chain_decodes_bit_for_bit_on_the_gpu(monkeypatch):
    """The compiled step with the split chain against the uncompiled forward without it."""
    from strata.mlx_backend.kernels.launch import gpu_dialect
    from strata.testing.mlx_params import random_params
    from test_mlx_compiled import SMALL

    if gpu_dialect() is not Dialect.CUDA:
        pytest.skip("no MLX CUDA GPU here")
    with using_path(KernelPath.GPU):
        p = random_params(SMALL, seed=32, pred_q8=False)
        *apart, _ = _split_decode(p, monkeypatch, False)
        *chain, n_chained = _split_decode(p, monkeypatch, True, compiled=True)
    assert n_chained > 0
    for a, b in zip(apart, chain):
        assert a.tobytes() == b.tobytes()
