"""The float16 KV cache on MLX (MlxLayerKV with float16 buffers) against the reference's
KVPrecision.F16 on the emulated kernel path (one block per head and split over the context) and
the ops path: the outputs and the cached keys / values (KV16: both round to binary16 once, to
nearest even, float32 values that agree to FAST); the emulator's float-to-half conversion against numpy's; Metal / CUDA
compile checks of the float16-cache attend (Metal: compile-checked, not run)."""

from __future__ import annotations

from dataclasses import replace

import mlx.core as mx
import numpy as np
import pytest

from mlx_agree import assert_backends_agree
from strata.mlx_backend.attention import MlxLayerKV, attention_partials
from strata.mlx_backend.kernels import phases
from strata.mlx_backend.kernels import attention as attn_kernels
from strata.mlx_backend.kernels import emulate
from strata.mlx_backend.kernels.launch import KernelPath, launch, recording, using_path
from strata.mlx_backend.kernels.preludes import Dialect
from strata.mlx_backend.kernels.source import KernelSource
from strata.model_config import QKNorm, TensorNames
from strata.reference.attention import KVPrecision, LayerKV, attention, rms_norm
from strata.testing.models import SHAPES
from test_mlx_attention_kernels import _layer

needs_cxx = pytest.mark.skipif(not emulate.available(), reason="no C++20 compiler")

ROUND = KernelSource("strata_test_to_half", ("x",), ("out",), """
  for (uint32_t i = tid; i < 4096u; i += NT) out[i] = F32(to_half(x[i]));
""")


@needs_cxx
def test_emulator_to_half_matches_numpy():
    rng = np.random.default_rng(0)
    x = np.concatenate([rng.standard_normal(1024) * 10.0 ** rng.integers(-9, 6, 1024),
                        np.array([0.0, -0.0, 65504.0, 65520.0, 1e9, -1e9, np.inf, -np.inf, 2.0 ** -24, 2.0 ** -25,
                                  3 * 2.0 ** -26, 1.0 + 2.0 ** -11, 1.0 + 3 * 2.0 ** -11]),
                        rng.standard_normal(4096 - 1037) * 1e-6]).astype(np.float32)
    with using_path(KernelPath.EMULATED):
        got = np.array(launch(ROUND, [mx.array(x)], [(4096,)], [mx.float32], blocks=(1, 1, 1), threads=256,
                              template=(("NT", 256),))[0])
    with np.errstate(over="ignore"):  # past 65504: inf, as the kernels' conversions give
        want = x.astype(np.float16).astype(np.float32)
    np.testing.assert_array_equal(got, want)


def _steps(cfg, path, steps, monkeypatch, split: bool):
    if split:
        monkeypatch.setattr(attn_kernels, "SPLIT_CHUNK", 4)
        monkeypatch.setattr(attn_kernels, "SPLIT_FROM", 4)
    rng = np.random.default_rng([cfg.head_dim, int(split)])
    dense, w = _layer(cfg, rng)
    if path is KernelPath.OPS:
        w = replace(w, wqkv=w.wqkv.astype(mx.float32))  # the ops path takes float32 weights
    kv_r, kv_f = LayerKV.empty(cfg, KVPrecision.F16), MlxLayerKV.empty(cfg, KVPrecision.F16)
    assert kv_f.keys.dtype == mx.float16 and kv_f.precision is KVPrecision.F16
    norm = dense[TensorNames.block(0, TensorNames.attn_norm)]
    with using_path(path):
        for t in steps:
            x = rng.standard_normal((t, cfg.hidden_size)).astype(np.float32)
            ref, kv_r = attention(cfg, dense, 0, kv_r, rms_norm(x, norm, cfg.rms_norm_eps))
            parts, kv_f = attention_partials(cfg, w, kv_f, mx.array(x))
            mx.eval(parts)
            n = kv_f.length
            what = f"{path.value} split={split}: window of {t} ending at {n}"
            assert_backends_agree(ref, parts.sum(axis=1), "KV16", what=what)
            keys = np.array(kv_f.keys.astype(mx.float32))[:, :n]
            values = np.array(kv_f.values.astype(mx.float32))[:, :n]
            assert_backends_agree(kv_r.keys, keys, "KV16", what=f"{what}: cached keys")
            assert_backends_agree(kv_r.values, values, "KV16", what=f"{what}: cached values")
            np.testing.assert_array_equal(keys, KVPrecision.F16.store(keys))  # half-exact, as stored


CFG = replace(SHAPES["tiny"], hidden_size=64, n_heads=4, n_kv_heads=2, head_dim=32, qk_norm=QKNorm.PER_HEAD,
              max_context=24)


@needs_cxx
@pytest.mark.parametrize("split", [False, True], ids=["one_block", "split"])
def test_f16_cache_on_the_kernel_path_against_the_reference(monkeypatch, split):
    _steps(CFG, KernelPath.EMULATED, (5, 1, 2, 1), monkeypatch, split)


def test_f16_cache_on_the_ops_path_against_the_reference(monkeypatch):
    _steps(CFG, KernelPath.OPS, (5, 1, 2), monkeypatch, False)


@needs_cxx
@pytest.mark.parametrize("dialect", [Dialect.METAL, Dialect.CUDA], ids=["metal", "cuda"])
def test_f16_cache_attend_compiles(tmp_path, dialect, monkeypatch):
    from test_metal_compile import _check

    # Metal's form keeps the partials (no chains there: none summed in the launch)
    monkeypatch.setattr(phases, "available", lambda: dialect is Dialect.CUDA)

    _, w = _layer(CFG, np.random.default_rng(1))
    with using_path(KernelPath.EMULATED), recording() as rec:
        parts, _ = attention_partials(CFG, w, MlxLayerKV.empty(CFG, KVPrecision.F16), mx.ones((2, CFG.hidden_size)))
        mx.eval(parts)
    attend = [r for r in rec if r[0].name.startswith(("strata_attend", "strata_attend_project"))]  # a short window: fused
    assert len(attend) == 1 and dict(attend[0][3])["KV16"] == 1
    assert _check(tmp_path, dialect, attend[0]) is None


@pytest.mark.gpu
@pytest.mark.parametrize("split", [False, True], ids=["one_block", "split"])
def test_f16_cache_on_the_gpu_against_the_reference(monkeypatch, split):
    from strata.mlx_backend.kernels.launch import gpu_dialect

    if gpu_dialect() is None:
        pytest.skip("no MLX GPU here")
    _steps(CFG, KernelPath.GPU, (5, 1, 2, 1), monkeypatch, split)
