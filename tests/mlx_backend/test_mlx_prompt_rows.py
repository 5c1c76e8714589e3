"""The prompt path's row kernels (strata/mlx_backend/kernels/row_norm.py, qkv_rope.py, wired in
prompt_rows.py) against the MLX ops they replace, on the emulator and the GPU where MLX has one:
float32 results within FAST (the sums' order), float16 ones within KV16 (a reordered float32
value may round to the neighbouring binary16); the attention's output with the kernels against
without; the o-projection's single term; the Metal and CUDA sources compile-checked."""

from __future__ import annotations

from dataclasses import replace

import mlx.core as mx
import numpy as np
import pytest

from kernel_paths import KERNEL_PATHS
from mlx_agree import assert_backends_agree
from strata.mlx_backend import lowp
from strata.mlx_backend.attention import rms_norm
from strata.mlx_backend.kernels import emulate
from strata.mlx_backend.kernels.launch import KernelPath, recording, using_path
from strata.mlx_backend.kernels.preludes import Dialect
from strata.mlx_backend.kernels.qkv_rope import qkv_rope
from strata.mlx_backend.kernels.row_norm import row_norm
from strata.mlx_backend.model import MlxModelState, from_reference
from strata.mlx_backend.prompt_attention import _device_tables, _rope, prompt_attention
from strata.testing.models import SHAPES

EPS = 1e-6


def _rows(t: int, d: int, seed: int, scale: float = 1.0) -> np.ndarray:
    return (np.random.default_rng(seed).standard_normal((t, d)) * scale).astype(np.float32)


@pytest.mark.parametrize("path", KERNEL_PATHS)
@pytest.mark.parametrize("parts_dtype,p,w_dtype", [(None, 0, "float16"), ("float16", 1, "float32"),
                                                   ("float32", 2, "float16")])
def test_row_norm_is_the_residual_and_rms_norm(path, parts_dtype, p, w_dtype):
    """v = x + parts.sum(axis=1) (one part: bit for bit; float16 parts only one, as the ops
    would sum several in float16), then rms_norm(v) as float32 rows
    (FAST), as hi and lo float16 terms (hi + lo within FAST of the norm; hi rounded once) and
    as hi alone (KV16 against the ops' rounding)."""
    t, d = 9, 300  # 300: a thread's values past D masked
    x = mx.array(_rows(t, d, 0))
    w = mx.array(_rows(1, d, 1)[0] + 1.0).astype(getattr(mx, w_dtype))
    parts = None if p == 0 else mx.array(_rows(t * p, d, 2, 0.5).reshape(t, p, d)).astype(getattr(mx, parts_dtype))
    v_ops = x if parts is None else x + parts.sum(axis=1)
    h_ops = np.array(rms_norm(v_ops, w, EPS))
    with using_path(path):
        v, h = row_norm(x, w, EPS, parts=parts)
        _, two = row_norm(x, w, EPS, parts=parts, terms=2)
        _, one = row_norm(x, w, EPS, parts=parts, terms=1)
        v, h, two, one = (np.array(a) for a in (v, h, two, one))
    if p == 1:
        np.testing.assert_array_equal(v, np.array(v_ops))
    else:
        assert_backends_agree(np.array(v_ops), v, "FAST", what="residual")
    assert_backends_agree(h_ops, h, "FAST", what="rms_norm rows")
    assert two.dtype == np.float16 and two.shape == (2 * t, d)
    hi, lo = two[:t].astype(np.float32), two[t:].astype(np.float32)
    assert_backends_agree(h_ops, hi + lo, "FAST", what="hi + lo terms")
    np.testing.assert_array_equal(two[:t], one)  # hi is the rounding of the same value either way
    assert (np.abs(lo) <= np.spacing(np.abs(two[:t])).astype(np.float32) / 2).all()  # lo within hi's half ulp
    assert_backends_agree(h_ops.astype(np.float16).astype(np.float32), one.astype(np.float32), "KV16",
                          what="hi term")


def _ops_qkv(cfg, y: mx.array, t: int, start: int, bias, qn, kn):
    """The ops path's epilogue (prompt_attention): join, bias, per-head norms, RoPE."""
    hd, h, kvh = cfg.head_dim, cfg.n_heads, cfg.n_kv_heads
    qkv = lowp.join_rows(y, t)
    if bias is not None:
        qkv = qkv + bias.astype(mx.float32)
    q, k, v = (qkv[:, a:b].reshape(t, -1, hd).transpose(1, 0, 2)
               for a, b in ((0, h * hd), (h * hd, (h + kvh) * hd), ((h + kvh) * hd, (h + 2 * kvh) * hd)))
    if qn is not None:
        q, k = rms_norm(q, qn, EPS), rms_norm(k, kn, EPS)
    return _rope(cfg, q, start), _rope(cfg, k, start), v


@pytest.mark.parametrize("path", KERNEL_PATHS)
@pytest.mark.parametrize("shape,terms,bias,norms,start", [  # sigmoid: partial RoPE (8 of 16); demo: HD 32
    ("tiny", 2, False, True, 0), ("sigmoid", 1, True, True, 5), ("sigmoid", 2, False, True, 0),
    ("demo", 2, True, False, 3)])
def test_qkv_rope_is_the_ops_epilogue(path, shape, terms, bias, norms, start):
    """q, k, v of the kernel against the ops path's (join, bias, q / k norms, RoPE at start..):
    the float32 k and v within FAST, the float16 q, k, v within KV16, the extra gate-like columns
    past v not read."""
    cfg = replace(SHAPES[shape], max_context=64)
    t, hd = 11, cfg.head_dim
    cols = (cfg.n_heads + 2 * cfg.n_kv_heads) * hd
    rng = np.random.default_rng(3)
    y = mx.array(rng.standard_normal((terms * t, cols + 8)).astype(np.float16))  # 8 columns past v
    if terms == 2:
        y = mx.concatenate([y[:t], (y[t:].astype(mx.float32) * 1e-3).astype(mx.float16)])
    b = mx.array(rng.standard_normal(cols + 8).astype(np.float16)) if bias else None
    qn = mx.array((rng.standard_normal(hd) * 0.1 + 1).astype(np.float32)) if norms else None
    kn = mx.array((rng.standard_normal(hd) * 0.1 + 1).astype(np.float32)) if norms else None
    q_ops, k_ops, v_ops = (np.array(a) for a in _ops_qkv(cfg, y, t, start, b, qn, kn))
    cos_t, sin_t = _device_tables(cfg)
    with using_path(path):
        q, k, v, k32, v32 = (np.array(a) for a in qkv_rope(
            y, t, n_heads=cfg.n_heads, n_kv=cfg.n_kv_heads, head_dim=hd, rope_dim=cfg.rope_dim, cos_t=cos_t,
            sin_t=sin_t, start=start, bias=b, q_norm=qn, k_norm=kn, eps=EPS))
    assert_backends_agree(k_ops, k32, "FAST", what="k float32")
    assert_backends_agree(v_ops, v32, "FAST", what="v float32")
    for name, got, ref in (("q", q, q_ops), ("k", k, k_ops), ("v", v, v_ops)):
        assert got.dtype == np.float16
        assert_backends_agree(ref.astype(np.float16).astype(np.float32), got.astype(np.float32), "KV16",
                              what=f"{name} float16")


@pytest.mark.parametrize("path", KERNEL_PATHS)
@pytest.mark.parametrize("shape", ["tiny", "sigmoid"])
def test_prompt_attention_with_row_kernels_is_without(path, shape):
    """prompt_attention (float16 products) with the row kernels against the ops path (their twins:
    the same float16 products): the output within KV16 (attention reads float16 q, k, v either way, each within one
    rounding), the float32 cache within FAST, a first chunk and a continuation after it."""
    from test_mlx_prompt import made_params

    rp = made_params(shape)
    cfg = rp.cfg
    x = mx.array(_rows(13, cfg.hidden_size, 4))
    more = mx.array(_rows(6, cfg.hidden_size, 5))
    outs = {}
    for on in (True, False):
        with using_path(path if on else KernelPath.OPS):
            p = from_reference(rp, dtype=mx.float16)
            w = p.layers[0].attn
            kv = MlxModelState.empty(cfg).layers[0]
            a, kv = prompt_attention(cfg, w, kv, x, dtype=mx.float16)
            b, kv = prompt_attention(cfg, w, kv, more, dtype=mx.float16)
            outs[on] = [np.array(v) for v in (a, b, kv.keys[:, :19], kv.values[:, :19])]
    for name, got, ref in zip(("first chunk", "continuation"), outs[True][:2], outs[False][:2]):
        assert_backends_agree(ref, got, "KV16", what=f"{shape}: attention output, {name}")
    assert_backends_agree(outs[False][2], outs[True][2], "FAST", what="keys")
    assert_backends_agree(outs[False][3], outs[True][3], "FAST", what="values")


def test_split_rows_takes_float16_rows_as_one_term():
    """An activation already float16 (the attention's output on a GPU) has a zero lo term: one
    term, the product unchanged."""
    x16 = mx.array(_rows(5, 8, 6)).astype(mx.float16)
    assert lowp.split_rows(x16, mx.float16).shape == (5, 8)
    assert lowp.split_rows(x16.astype(mx.float32), mx.float16).shape == (10, 8)
    w = mx.array(_rows(3, 8, 7)).astype(mx.float16)
    np.testing.assert_array_equal(np.array(lowp.lowp_matmul(x16, w, mx.float16)),
                                  np.array(lowp.lowp_matmul(x16.astype(mx.float32), w, mx.float16)))


@pytest.mark.skipif(not emulate.available(), reason="no C++ compiler")
@pytest.mark.parametrize("dialect", [Dialect.METAL, Dialect.CUDA], ids=["metal", "cuda"])
def test_row_kernel_sources_compile(tmp_path, dialect):
    """The specialisations the prompt attention and the residual ran (float32 and float16 parts,
    one and two terms, with and without bias and norms), as the full Metal and CUDA sources
    (Metal: compile-checked, not run)."""
    from test_metal_compile import _check

    cfg = SHAPES["tiny"]
    x = mx.array(_rows(4, cfg.hidden_size, 0))
    w16 = mx.ones((cfg.hidden_size,), mx.float16)
    cos_t, sin_t = _device_tables(cfg)
    cols = (cfg.n_heads + 2 * cfg.n_kv_heads) * cfg.head_dim
    y = mx.zeros((8, cols), mx.float16)
    with using_path(KernelPath.EMULATED), recording() as specs:
        for terms in (0, 1, 2):
            mx.eval(*row_norm(x, w16, EPS, terms=terms))
        mx.eval(*row_norm(x, w16, EPS, parts=x[:, None, :].astype(mx.float16)))
        mx.eval(*qkv_rope(y, 4, n_heads=cfg.n_heads, n_kv=cfg.n_kv_heads, head_dim=cfg.head_dim,
                          rope_dim=cfg.rope_dim, cos_t=cos_t, sin_t=sin_t, start=0, bias=mx.zeros((cols,), mx.float16),
                          q_norm=mx.ones((cfg.head_dim,)), k_norm=mx.ones((cfg.head_dim,)), eps=EPS))
        mx.eval(*qkv_rope(y[:4], 4, n_heads=cfg.n_heads, n_kv=cfg.n_kv_heads, head_dim=cfg.head_dim,
                          rope_dim=cfg.rope_dim, cos_t=cos_t, sin_t=sin_t, start=2))
    assert {s[0].name for s in specs} == {"strata_row_norm", "strata_qkv_rope"}
    errors = [e for e in (_check(tmp_path, dialect, s) for s in specs) if e]
    assert not errors, "\n\n".join(errors)


