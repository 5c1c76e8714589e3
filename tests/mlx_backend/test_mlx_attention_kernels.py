"""The decode attention's three launches (QKV GEMV, attend, output GEMV) on the emulated kernel
path against the reference, on the cases the model twins reach only by chance: a prompt chunk of
T > 1 at pos0 > 0, GQA groups > 1, q/k norm on and off, bias on and off, head_dim with one and
two rotate-half pairs per lane; and the cache after each call holds the reference's keys
(normed, roped) and values. Then the dense GEMV alone: two rows per warp, a row tail, batched
loads (more 16-byte groups per lane than one batch), and the Metal / CUDA compile check of the
specialisation the tiny models never launch (two rows per warp).
"""

from __future__ import annotations

from dataclasses import replace

import mlx.core as mx
import numpy as np
import pytest

from mlx_agree import assert_backends_agree
from strata.mlx_backend.attention import AttentionWeights, MlxLayerKV, attention_partials, kernel_applies
from strata.mlx_backend.kernels import attend_project, phases
from strata.mlx_backend.kernels import dense_gemv as dense_kernel
from strata.mlx_backend.kernels import emulate
from strata.mlx_backend.kernels.launch import LAUNCHES, KernelPath, recording, using_path
from strata.mlx_backend.kernels.preludes import Dialect
from strata.model_config import QKNorm, TensorNames
from strata.reference.attention import LayerKV, attention, rms_norm
from strata.testing.models import SHAPES

pytestmark = pytest.mark.skipif(not emulate.available(), reason="no C++20 compiler")

CHUNKS = (3, 4, 1)  # a prompt chunk at 0, a chunk of 4 at pos0 = 3, then a decoded token at 7


def fp16_exact(a: np.ndarray) -> np.ndarray:
    return np.asarray(a, np.float32).astype(np.float16).astype(np.float32)


def _layer(cfg, rng) -> tuple[dict, AttentionWeights]:
    """Layer 0's attention weights (float16-exact): the reference's dict and the kernel path's."""
    n, d, hd = TensorNames, cfg.hidden_size, cfg.head_dim
    qr, kr = cfg.n_heads * hd, cfg.n_kv_heads * hd
    w = {n.attn_norm: 1.0 + 0.2 * rng.standard_normal(d), n.attn_q: rng.standard_normal((qr, d)) / np.sqrt(d),
         n.attn_k: rng.standard_normal((kr, d)) / np.sqrt(d), n.attn_v: rng.standard_normal((kr, d)) / np.sqrt(d),
         n.attn_output: rng.standard_normal((d, qr)) / np.sqrt(qr)}
    if cfg.attention_bias:
        w.update({n.attn_q_bias: rng.standard_normal(qr), n.attn_k_bias: rng.standard_normal(kr),
                  n.attn_v_bias: rng.standard_normal(kr)})
    if cfg.qk_norm is QKNorm.PER_HEAD:
        w.update({n.attn_q_norm: 1.0 + 0.2 * rng.standard_normal(hd), n.attn_k_norm: 1.0 + 0.2 * rng.standard_normal(hd)})
    gated = cfg.attention_output_gate
    if gated:
        w[n.attn_gate] = rng.standard_normal((qr, d)) / np.sqrt(d)
    w = {k: fp16_exact(v) for k, v in w.items()}
    dense = {n.block(0, k): v for k, v in w.items()}
    h16 = lambda a: mx.array(a).astype(mx.float16)  # noqa: E731
    bias = np.concatenate([w[n.attn_q_bias], w[n.attn_k_bias], w[n.attn_v_bias]]
                          + ([np.zeros(qr, np.float32)] if gated else [])) if cfg.attention_bias else None
    qkn = cfg.qk_norm is QKNorm.PER_HEAD
    rows = [w[n.attn_q], w[n.attn_k], w[n.attn_v]] + ([w[n.attn_gate]] if gated else [])
    fast = AttentionWeights(h16(w[n.attn_norm]), h16(np.concatenate(rows)),
                            None if bias is None else h16(bias), h16(w[n.attn_q_norm]) if qkn else None,
                            h16(w[n.attn_k_norm]) if qkn else None, h16(w[n.attn_output]), gated)
    return dense, fast


def unfused_partials(cfg, w: AttentionWeights, kv: MlxLayerKV, x: mx.array) -> tuple[mx.array, MlxLayerKV]:
    """The QKV GEMV, attend (split by chunks where `split_applies`), then the output projection's
    GEMV: what attention_partials runs where W_o takes no fused launch (a Q8_0 W_o, a window past
    attend_project.MAX_TOKENS) -> (partials [T, 1, D], the cache one window on)."""
    from strata.mlx_backend.attention import rope_table_cached
    from strata.mlx_backend.kernels import attention as attn_kernels

    t = x.shape[0]
    cos, sin = rope_table_cached(cfg)
    qkv = dense_kernel.dense_gemv(w.wqkv, x, w.norm, cfg.rms_norm_eps, bias=w.bqkv)
    o = attn_kernels.attend(qkv, w.q_norm, w.k_norm, cos, sin, kv.keys, kv.values, kv.length, cfg.rms_norm_eps,
                            cfg.n_heads, rotary_dim=cfg.rope_dim, gated=w.gated,
                            split=attn_kernels.split_applies(kv.length + t, t))
    return dense_kernel.dense_gemv(w.wo, o)[:, None, :], MlxLayerKV(kv.keys, kv.values, kv.length + t)


def _launches(fused: bool, t: int, pos0: int, w: AttentionWeights) -> int:
    """An attention step's launches: QKV, attend, W_o apart (3), attend with W_o (2), or all three chained (1)."""
    return 3 if not fused else 1 if attend_project.chains_qkv(t, pos0 + t, w.wo) else 2


@pytest.mark.parametrize("fused", [True, False], ids=["attend_project", "attend_then_gemv"])
@pytest.mark.parametrize("qkn", [QKNorm.PER_HEAD, QKNorm.NONE], ids=["qknorm", "no_qknorm"])
@pytest.mark.parametrize("bias", [True, False], ids=["bias", "no_bias"])
@pytest.mark.parametrize("heads", [(8, 2, 32), (4, 1, 128), (6, 3, 16)], ids=["group4_hd32", "group4_hd128", "group2_hd16"])
def test_attention_chunks_and_cache_against_reference(qkn, bias, heads, fused):
    h, kvh, hd = heads
    cfg = replace(SHAPES["tiny"], hidden_size=96, n_heads=h, n_kv_heads=kvh, head_dim=hd, qk_norm=qkn,
                  attention_bias=bias, max_context=16)
    rng = np.random.default_rng([h, kvh, hd, int(bias), int(qkn is QKNorm.NONE)])
    dense, w = _layer(cfg, rng)
    kv_r, kv_f = LayerKV.empty(cfg), MlxLayerKV.empty(cfg)
    with using_path(KernelPath.EMULATED):
        for t in CHUNKS:
            x = rng.standard_normal((t, cfg.hidden_size)).astype(np.float32)
            pos0 = kv_f.length
            ref, kv_r = attention(cfg, dense, 0, kv_r, rms_norm(x, dense[TensorNames.block(0, TensorNames.attn_norm)],
                                                                  cfg.rms_norm_eps))
            before = sum(LAUNCHES.values())
            parts, kv_f = (attention_partials if fused else unfused_partials)(cfg, w, kv_f, mx.array(x))
            mx.eval(parts)
            # QKV GEMV, attend, output GEMV; fused: attend and the output projection in one launch, a partial a head;
            # one token: the QKV GEMV chained into that launch too
            assert sum(LAUNCHES.values()) - before == _launches(fused, t, pos0, w)
            assert parts.shape == (t, cfg.n_heads if fused and not attend_project.sums_parts() else 1, cfg.hidden_size)
            what = f"chunk of {t} at {pos0}"
            assert_backends_agree(ref, parts.sum(axis=1), "FAST", what=what)
            assert kv_f.length == kv_r.length
            keys, values = np.array(kv_f.keys), np.array(kv_f.values)
            assert_backends_agree(kv_r.keys, keys[:, :kv_f.length], "FAST", what=f"{what}: cached keys")
            assert_backends_agree(kv_r.values, values[:, :kv_f.length], "FAST", what=f"{what}: cached values")
            assert not keys[:, kv_f.length:].any() and not values[:, kv_f.length:].any(), "written past the chunk"


@pytest.mark.parametrize("gated", [True, False], ids=["gated", "ungated"])
@pytest.mark.parametrize("heads", [(4, 2, 32, 8), (4, 1, 256, 64), (2, 1, 96, 24), (4, 2, 32, 32)],
                         ids=["hybrid_hd32_rd8", "qwen35_hd256_rd64", "ragged_hd96_rd24", "full_rotary"])
@pytest.mark.parametrize("fused", [True, False], ids=["attend_project", "attend_then_gemv"])
def test_gated_and_partial_rotary_chunks_against_reference(gated, heads, fused):
    """Qwen3-Next / Qwen3.5 attention on the kernel path: the output gate (its rows under W_qkv,
    applied in attend's merge) and RoPE on the first rotary_dim dims of each head only (the rest
    normed, not rotated: also in the cached keys); rd = 24 leaves a partial lane group past it."""
    h, kvh, hd, rd = heads
    cfg = replace(SHAPES["hybrid"], hidden_size=64, n_heads=h, n_kv_heads=kvh, head_dim=hd,
                  rotary_dim=0 if rd == hd else rd, attention_output_gate=gated, max_context=16)
    rng = np.random.default_rng([h, kvh, hd, rd, int(gated)])
    dense, w = _layer(cfg, rng)
    kv_r, kv_f = LayerKV.empty(cfg), MlxLayerKV.empty(cfg)
    norm = dense[TensorNames.block(0, TensorNames.attn_norm)]
    with using_path(KernelPath.EMULATED):
        assert kernel_applies(cfg, w)
        for t in CHUNKS:
            x = rng.standard_normal((t, cfg.hidden_size)).astype(np.float32)
            pos0 = kv_f.length
            ref, kv_r = attention(cfg, dense, 0, kv_r, rms_norm(x, norm, cfg.rms_norm_eps))
            before = sum(LAUNCHES.values())
            parts, kv_f = (attention_partials if fused else unfused_partials)(cfg, w, kv_f, mx.array(x))
            mx.eval(parts)
            assert sum(LAUNCHES.values()) - before == _launches(fused, t, pos0, w)  # the gate rides in the QKV GEMV and attend
            what = f"gated={gated} rd={rd}/{hd}: chunk of {t} at {pos0}"
            assert_backends_agree(ref, parts.sum(axis=1), "FAST", what=what)
            keys = np.array(kv_f.keys)[:, :kv_f.length]
            assert_backends_agree(kv_r.keys, keys, "FAST", what=f"{what}: cached keys")


def test_attention_is_deterministic():
    """The same chunk over the same cache twice: the same bits (no atomics, a fixed merge order)."""
    cfg = replace(SHAPES["tiny"], hidden_size=64, n_heads=4, n_kv_heads=2, head_dim=32, max_context=16)
    rng = np.random.default_rng(7)
    _, w = _layer(cfg, rng)
    prefix, x = rng.standard_normal((5, 64)).astype(np.float32), mx.array(rng.standard_normal((2, 64)).astype(np.float32))
    with using_path(KernelPath.EMULATED):
        _, kv = attention_partials(cfg, w, MlxLayerKV.empty(cfg), mx.array(prefix))
        a, _ = attention_partials(cfg, w, kv, x)
        b, _ = attention_partials(cfg, w, kv, x)
        np.testing.assert_array_equal(np.array(a), np.array(b))


def _gemv_ref(w, x, norm_w, eps, bias):
    xn = rms_norm(x, norm_w, eps) if norm_w is not None else x
    y = xn.astype(np.float64) @ w.astype(np.float64).T
    return (y + bias if bias is not None else y).astype(np.float32)


@pytest.mark.parametrize("rpw", [1, 2])
@pytest.mark.parametrize("shape", [(37, 2600), (21, 72)], ids=["batched_loads", "narrow"])
@pytest.mark.parametrize("norm,bias", [(True, True), (False, False)], ids=["norm_bias", "plain"])
def test_dense_gemv_against_reference(monkeypatch, rpw, shape, norm, bias):
    """Rows past R in the last block, C/8 groups not a multiple of 32, more groups per lane than
    a batch of loads (C = 2600: 11 per lane, 8 per batch at two rows per warp)."""
    if rpw == 2:
        monkeypatch.setattr(dense_kernel, "MIN_BLOCKS_FOR_TWO_ROWS", 1)
    r, c = shape
    assert dense_kernel.rows_per_warp(r) == rpw
    rng = np.random.default_rng([r, c, rpw])
    w = fp16_exact(rng.standard_normal((r, c)) / np.sqrt(c))
    x = rng.standard_normal((3, c)).astype(np.float32)
    nw = fp16_exact(1.0 + 0.2 * rng.standard_normal(c)) if norm else None
    b = fp16_exact(rng.standard_normal(r)) if bias else None
    h16 = lambda a: None if a is None else mx.array(a).astype(mx.float16)  # noqa: E731
    with using_path(KernelPath.EMULATED):
        y = dense_kernel.dense_gemv(h16(w), mx.array(x), h16(nw), 1e-6, bias=h16(b))
    assert_backends_agree(_gemv_ref(w, x, nw, 1e-6, b), y, "FAST", what=f"dense GEMV {r}x{c} rpw {rpw}")


@pytest.mark.parametrize("dialect", [Dialect.METAL, Dialect.CUDA], ids=["metal", "cuda"])
def test_two_rows_per_warp_compiles(tmp_path, monkeypatch, dialect):
    """The LM head's specialisation (two rows per warp, batched loads) as Metal and CUDA."""
    from test_metal_compile import _check

    monkeypatch.setattr(dense_kernel, "MIN_BLOCKS_FOR_TWO_ROWS", 1)
    with using_path(KernelPath.EMULATED), recording() as rec:
        mx.eval(dense_kernel.dense_gemv(mx.ones((20, 2600), mx.float16), mx.ones((1, 2600)), mx.ones((2600,), mx.float16), 1e-6))
    assert len(rec) == 1 and dict(rec[0][3])["RPW"] == 2
    assert _check(tmp_path, dialect, rec[0]) is None


@pytest.mark.parametrize("dialect", [Dialect.METAL, Dialect.CUDA], ids=["metal", "cuda"])
def test_gated_partial_rotary_attend_compiles(tmp_path, dialect, monkeypatch):
    """attend with the output gate and partial rotary (Qwen3.5's heads: 256 dims, 64 rotary), as
    Metal (compile-checked, not run) and CUDA."""
    from test_metal_compile import _check

    # Metal's form keeps the partials (no chains there: none summed in the launch)
    monkeypatch.setattr(phases, "available", lambda: dialect is Dialect.CUDA)

    cfg = replace(SHAPES["hybrid"], hidden_size=64, n_heads=4, n_kv_heads=1, head_dim=256, rotary_dim=64,
                  attention_output_gate=True, max_context=16)
    _, w = _layer(cfg, np.random.default_rng(0))
    with using_path(KernelPath.EMULATED), recording() as rec:
        parts, _ = attention_partials(cfg, w, MlxLayerKV.empty(cfg), mx.ones((2, cfg.hidden_size)))
        mx.eval(parts)
    attend = [r for r in rec if dict(r[3]).get("GATE") == 1]
    assert len(attend) == 1 and dict(attend[0][3])["RD"] == 64
    assert _check(tmp_path, dialect, attend[0]) is None
