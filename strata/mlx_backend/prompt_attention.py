"""Attention over a prompt on the matrix units: the prompt path's mixer for attention layers.

The decode kernels (kernels/dense_gemv.py, kernels/attention.py) are GEMVs and one block per
query head and position: right for one token, ~T times the weight reads for T. Here the QKV and
output projections are MLX matmuls (cuBLAS on CUDA) over all T positions with float16 inputs, and
attention is `mx.fast.scaled_dot_product_attention` with the causal mask (MLX's own fused
attention where the build has one). The q/k norms, RoPE (the reference's float64 angles rounded
once, `attention.rope_table`) and the KV cache (float32, written in place as the ops path
writes it) are the ops path's, in float32.

What the float16 inputs cost is the prompt path's named budget (tests/budgets.py PROMPT).
Layers the path does not serve (attention sinks, sliding windows: gpt-oss) keep the ops path:
`attention_refusal` says why.

Shapes: T positions, D hidden, H heads, KVH kv heads, HD head dim.
"""

from __future__ import annotations

import mlx.core as mx
import numpy as np

from strata.mlx_backend import kernel_plan
from strata.mlx_backend.attention import (
    AttentionWeights, MlxLayerKV, check_context, qkv_heads, rms_norm, rope_table_cached,
)
from strata.mlx_backend.lowp import as_mm, lowp_matmul
from strata.mlx_backend.prompt_rows import attention_qkv, qkv_kernel_applies
from strata.mlx_backend.shape_buckets import bucket
from strata.model_config import ModelConfig

__all__ = ["attention_refusal", "prompt_attention", "buckets_positions"]

# A prompt's attention on MLX's CUDA build is a cuDNN graph built per q/k/v shape, per process
# (scaled_dot_product_attention.cpp: build_sdpa_cache_key), so each new prompt length built one.
# A first chunk (no cached positions) pads q, k and v with zero rows to `bucket(T)` positions:
# with the causal mask real queries never see the padded keys (all after them) and the padded
# queries' rows are dropped. On MLX's CUDA build only (elsewhere nothing is built per shape: the
# padding would only cost flops), unless the kernel plan's bucket_positions says otherwise.


def buckets_positions() -> bool:
    """Whether a first prompt chunk's attention pads its positions to a bucket."""
    forced = kernel_plan.current().bucket_positions
    if forced is not None:
        return forced
    cuda = getattr(mx, "cuda", None)
    return cuda is not None and cuda.is_available() and mx.default_device() == mx.gpu


def attention_refusal(w: AttentionWeights) -> str | None:
    """Why this attention layer keeps the ops path on a prompt (None: the prompt path serves it)."""
    if w.sinks is not None:
        return "attention sinks"
    if w.window:
        return "a sliding window"
    return None


def prompt_attention(cfg: ModelConfig, w: AttentionWeights, kv: MlxLayerKV, x: mx.array, *,
                     dtype: mx.Dtype = mx.float16) -> tuple[mx.array, MlxLayerKV]:
    """The attention output of T new positions after kv.length cached ones, and the cache with
    them (float32, in place).

    Shapes:
        x float32 [T, D] (the residual, not yet normed) -> (float32 [T, D], MlxLayerKV with T more positions)
    """
    t = x.shape[0]
    check_context(cfg, kv.length, t)
    hd, h = cfg.head_dim, cfg.n_heads
    qr = h * hd
    start = kv.length
    s = start + t
    if qkv_kernel_applies(cfg, w, dtype):  # norm + terms, the GEMM, its epilogue: 3 launches (prompt_rows.py)
        q, k16, v16, k, v = attention_qkv(cfg, w, x, start, *_device_tables(cfg), dtype)
        kv.keys[:, start:start + t, :] = k
        kv.values[:, start:start + t, :] = v
        keys, values = (k16, v16) if start == 0 else (kv.keys[:, :s], kv.values[:, :s])  # [KVH, S, HD]
        gate = None
    else:
        xn = rms_norm(x, w.norm, cfg.rms_norm_eps)
        qkv = lowp_matmul(xn, w.wqkv, dtype)  # [T, QR + 2 KR (+ QR gate columns)]
        if w.bqkv is not None:
            qkv = qkv + w.bqkv.astype(mx.float32)
        q, k, v, gate = qkv_heads(cfg, w, qkv)
        q, k = _rope(cfg, q, start), _rope(cfg, k, start)
        kv.keys[:, start:start + t, :] = k  # the cache is the ops path's: float32, written in place
        kv.values[:, start:start + t, :] = v
        keys, values = (k, v) if start == 0 else (kv.keys[:, :s], kv.values[:, :s])  # [KVH, S, HD]
    pad = bucket(t) - t if start == 0 and buckets_positions() else 0
    if pad:  # zero rows after the last position: [H, T + pad, HD], [KVH, T + pad, HD]
        q, keys, values = (mx.concatenate([a, mx.zeros((a.shape[0], pad, hd), a.dtype)], axis=1)
                           for a in (q, keys, values))
    # causal with S > T: MLX aligns the mask to the last key (query i sees keys <= start + i)
    o = mx.fast.scaled_dot_product_attention(as_mm(q[None], dtype), as_mm(keys[None], dtype),
                                             as_mm(values[None], dtype), scale=float(1.0 / np.sqrt(hd)),
                                             mask="causal")  # [1, H, T (+ pad), HD]
    # [T, H HD] in the attention's dtype: float16 on a GPU, whose lo term would be zeros
    # (lowp.split_rows: one term then; the output GEMM half the rows, no float32 copy of o:
    # ~90 us a 2048-token layer, the same products)
    o = o[0, :, :t].transpose(1, 0, 2).reshape(t, qr)
    if w.gated:
        o = o.astype(mx.float32)
    if w.gated:
        o = o * mx.sigmoid(gate)
    out = lowp_matmul(o, w.wo, dtype)  # [T, D]
    if w.bo is not None:
        out = out + w.bo.astype(mx.float32)
    return out, MlxLayerKV(kv.keys, kv.values, s)


_DEVICE_TABLES: dict[int, tuple[mx.array, mx.array, mx.array]] = {}  # id(host cos table) -> (it, cos, sin)


def _device_tables(cfg: ModelConfig) -> tuple[mx.array, mx.array]:
    """`rope_table_cached`'s cos and sin as arrays made by an op: those are made from host memory,
    which MLX's CUDA build keeps as managed memory (the first reader of a page faults it over)."""
    cos_t, sin_t = rope_table_cached(cfg)
    hit = _DEVICE_TABLES.get(id(cos_t))
    if hit is None or hit[0] is not cos_t:
        hit = _DEVICE_TABLES[id(cos_t)] = (cos_t, cos_t + 0.0, sin_t + 0.0)
        mx.eval(hit[1], hit[2])
    return hit[1], hit[2]


def _rope(cfg: ModelConfig, a: mx.array, start: int) -> mx.array:
    """RoPE (partial where the model's is) at positions start.. [N, T, HD] -> [N, T, HD]: the ops
    path's rotation, the same bits (a1 c - a2 s is the ops path's a1 c + (-a2) s), in one
    concatenation instead of four (the ops path's duplicated cos / sin tables and rotated copy:
    ~12 launches a call, 8 here)."""
    cos_t, sin_t = _device_tables(cfg)
    t, rd = a.shape[1], cfg.rope_dim
    c, s = cos_t[start:start + t], sin_t[start:start + t]  # [T, rd/2]
    a1, a2 = a[..., :rd // 2], a[..., rd // 2:rd]
    parts = [a1 * c - a2 * s, a2 * c + a1 * s] + ([a[..., rd:]] if rd < a.shape[-1] else [])
    return mx.concatenate(parts, axis=-1)
