"""The prompt path's row-wise steps as one kernel each on a kernel path (kernels/row_norm.py,
kernels/qkv_rope.py), where the ops path takes 5-15 elementwise launches a step: the attention's
norm and the QKV GEMM's float16 terms, the QKV epilogue (join, bias, q / k norms, RoPE, the
float16 and float32 layouts), and the residual with the FFN norm. Why (ncu, a 2048-token layer):
the residual with the FFN norm ~90 us over 12 launches, the attention's norm with its terms ~100
us over 15, the QKV epilogue ~400 us over ~45. Each kernel is held to the ops it replaces within
FAST (tests/mlx_backend/test_mlx_prompt_rows.py) and the whole prompt to the reference within PROMPT.

Shapes: T positions, D hidden, H / KVH heads of HD.
"""

from __future__ import annotations

import mlx.core as mx

from strata.mlx_backend.attention import AttentionWeights, rms_norm
from strata.mlx_backend.kernels.launch import KernelPath, current_path
from strata.mlx_backend.kernels.qkv_rope import qkv_rope, qkv_rope_refusal
from strata.mlx_backend.kernels.row_norm import row_norm
from strata.mlx_backend.lowp import as_mm, mm_dtype
from strata.model_config import ModelConfig, QKNorm

__all__ = ["qkv_kernel_applies", "residual_norm", "attention_qkv"]


def _kernels() -> bool:
    return current_path() is not KernelPath.OPS


def residual_norm(x: mx.array, parts: mx.array, w: mx.array, eps: float) -> tuple[mx.array, mx.array]:
    """(x + parts.sum(axis=1), rms_norm of it): one launch on a kernel path.
    x float32 [T, D], parts [T, P, D], w [D] -> (float32 [T, D], float32 [T, D])"""
    if _kernels():
        return row_norm(x, w, eps, parts=parts)
    x = x + parts.sum(axis=1)
    return x, rms_norm(x, w, eps)


def qkv_kernel_applies(cfg: ModelConfig, w: AttentionWeights, dtype: mx.Dtype) -> bool:
    """Whether `attention_qkv` serves this layer: a kernel path, float16 products, per-head or no
    q / k norms, no output gate (its columns stay with the ops), a row that fits the kernel."""
    return (_kernels() and dtype == mx.float16 and not w.gated
            and cfg.qk_norm in (QKNorm.NONE, QKNorm.PER_HEAD)
            and qkv_rope_refusal(cfg.n_heads, cfg.n_kv_heads, cfg.head_dim, cfg.rope_dim) is None)


def attention_qkv(cfg: ModelConfig, w: AttentionWeights, x: mx.array, start: int, cos_t: mx.array, sin_t: mx.array,
                  dtype: mx.Dtype) -> tuple[mx.array, ...]:
    """The attention's q, k, v of T positions at start.. from the residual (`qkv_kernel_applies`):
    the norm and its two float16 terms (one launch), the QKV GEMM, its epilogue (one launch).

    Shapes:
        x float32 [T, D] -> q [H, T, HD], k, v [KVH, T, HD] in mm_dtype(dtype) (float16 values);
        k, v float32 [KVH, T, HD] (the cache's)
    """
    t = x.shape[0]
    _, xt = row_norm(x, w.norm, cfg.rms_norm_eps, terms=2)  # float16 [2 T, D]
    xt = as_mm(xt, dtype)
    y = xt @ as_mm(w.wqkv, dtype).T  # [2 T, QKV (+ gate columns)]
    qk = cfg.qk_norm is QKNorm.PER_HEAD
    q, k, v, k32, v32 = qkv_rope(y, t, n_heads=cfg.n_heads, n_kv=cfg.n_kv_heads, head_dim=cfg.head_dim,
                                 rope_dim=cfg.rope_dim, cos_t=cos_t, sin_t=sin_t, start=start, bias=w.bqkv,
                                 q_norm=w.q_norm if qk else None, k_norm=w.k_norm if qk else None,
                                 eps=cfg.rms_norm_eps)
    m = mm_dtype(dtype)
    return (q, k, v, k32, v32) if m == mx.float16 else (q.astype(m), k.astype(m), v.astype(m), k32, v32)
