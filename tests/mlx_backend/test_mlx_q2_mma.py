"""The Q2_0 grouped GEMM kernel (strata/mlx_backend/kernels/q2_mma.py) on the emulator (and the
GPU where MLX has one) against the dequantized records, and its Metal / CUDA sources compile-checked
(tests/mlx_backend/test_metal_compile.py's check)."""

from __future__ import annotations

import mlx.core as mx
import numpy as np
import pytest

from kernel_paths import KERNEL_PATHS
from mlx_agree import assert_backends_agree
from q2_records import CFG, q2_records
from strata.mlx_backend.grouped import GroupedGemm, dequantized_experts, grouped_experts
from strata.mlx_backend.kernels import emulate
from strata.mlx_backend.kernels.launch import KernelPath, recording, using_path
from strata.mlx_backend.kernels.preludes import Dialect
from strata.mlx_backend.kernels.q2_mma import q2_mma
from strata.reference.experts import routed_experts

@pytest.mark.parametrize("path", KERNEL_PATHS)
@pytest.mark.parametrize("planes", [("gate", "up"), ("down",)])
def test_q2_mma_is_the_dequantized_product(path, planes):
    """Y[e] = X[e] W_e^T with W_e the records' planes (gate | up stacked, or down), slots in any
    order, M and R not multiples of the tile: float32 sums of exact float16 products (FAST)."""
    rec, _, records = q2_records()
    cols = CFG.hidden_size if planes[0] == "gate" else CFG.expert_ffn_size
    rng = np.random.default_rng(0)
    x = rng.standard_normal((3, 70, cols)).astype(np.float16)
    slots = np.array([4, 0, 2], np.int32)
    with using_path(KernelPath.OPS):
        gu, dn = dequantized_experts(records, rec, mx.float32)
    w = np.array(gu if planes[0] == "gate" else dn)[slots]  # [3, R, C]
    ref = np.einsum("emc,erc->emr", x.astype(np.float32), w)
    with using_path(path):
        got = q2_mma(mx.array(x), records, mx.array(slots), rec, planes)
    assert_backends_agree(ref, np.array(got), "FAST", what=f"q2_mma {planes}")


@pytest.mark.parametrize("path", KERNEL_PATHS)
def test_grouped_experts_through_the_kernel(path):
    """GroupedGemm.Q2_MMA in the prompt path's expert step: the reference's per-token experts."""
    rec, experts, records = q2_records()
    t, k = 30, 3
    rng = np.random.default_rng(1)
    h = rng.standard_normal((t, CFG.hidden_size)).astype(np.float32)
    ids = np.stack([rng.choice(CFG.n_experts, k, replace=False) for _ in range(t)]).astype(np.int32)
    wts = rng.uniform(0.1, 1.0, (t, k)).astype(np.float32)
    ref = np.stack([routed_experts([experts[int(e)] for e in ids[i]], wts[i], h[i]) for i in range(t)])
    with using_path(path):
        got = grouped_experts(records, rec, mx.array(h), mx.array(ids), mx.array(wts), dtype=mx.float16,
                              gemm=GroupedGemm.Q2_MMA)
    assert_backends_agree(ref, np.array(got), "FAST", what="grouped experts through q2_mma")


@pytest.mark.skipif(not emulate.available(), reason="no C++ compiler")
@pytest.mark.parametrize("dialect", [Dialect.METAL, Dialect.CUDA], ids=["metal", "cuda"])
def test_q2_mma_sources_compile(tmp_path, dialect):
    """The specialisations that ran, as the full Metal and CUDA sources (Metal: compile-checked, not run)."""
    from test_metal_compile import _check

    rec, _, records = q2_records()
    with using_path(KernelPath.EMULATED), recording() as specs:
        for planes, cols in ((("gate", "up"), CFG.hidden_size), (("down",), CFG.expert_ffn_size)):
            mx.eval(q2_mma(mx.zeros((2, 8, cols), mx.float16), records, mx.array(np.arange(2, dtype=np.int32)),
                           rec, planes))
    assert len(specs) == 2
    errors = [e for e in (_check(tmp_path, dialect, s) for s in specs) if e]
    assert not errors, "\n\n".join(errors)
