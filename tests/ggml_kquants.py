"""Simple quantizers to ggml's Q4_K, Q6_K and IQ4_NL block formats, for writing test GGUFs (the gguf
package dequantizes these types but does not quantize them). Not llama.cpp's search for the
best scales: a plain absmax/min-max rule, which is enough to make valid blocks whose values
gguf's dequantizer defines. Layouts as ggml-common.h's block_q4_K / block_q6_K (QK_K = 256)."""

from __future__ import annotations

import numpy as np

QK_K = 256


def _superblocks(x: np.ndarray) -> np.ndarray:
    x = np.asarray(x, np.float32)
    if x.shape[-1] % QK_K:
        raise ValueError(f"K-quant rows must be a multiple of {QK_K}, got {x.shape}")
    return x.reshape(-1, QK_K)  # [N, 256]


def quantize_q6_k(x: np.ndarray) -> np.ndarray:
    """[..., C] -> uint8 [..., C / 256 * 210]: ql[128], qh[64], scales[16] int8, d f16."""
    b = _superblocks(x)
    n = b.shape[0]
    sub = b.reshape(n, 16, 16)
    amax = np.abs(sub).max(-1)  # [N, 16]
    s = amax / 31.0
    d = (s.max(-1) / 127.0).astype(np.float16)  # [N]
    d32 = d.astype(np.float32)
    sc = np.where(d32[:, None] > 0, np.round(s / np.where(d32[:, None] > 0, d32[:, None], 1)), 0)
    sc = np.clip(sc, -128, 127).astype(np.int8)
    step = d32[:, None] * sc.astype(np.float32)  # [N, 16]
    q = np.where(step[..., None] != 0, np.round(sub / np.where(step[..., None] != 0, step[..., None], 1)), 0)
    q = (np.clip(q, -32, 31) + 32).astype(np.uint8).reshape(n, 2, 4, 32)  # [N, half, quarter, l]
    ql = np.empty((n, 2, 64), np.uint8)
    ql[:, :, :32] = (q[:, :, 0] & 0xF) | ((q[:, :, 2] & 0xF) << 4)
    ql[:, :, 32:] = (q[:, :, 1] & 0xF) | ((q[:, :, 3] & 0xF) << 4)
    qh = ((q[:, :, 0] >> 4) | ((q[:, :, 1] >> 4) << 2) | ((q[:, :, 2] >> 4) << 4) | ((q[:, :, 3] >> 4) << 6))
    out = np.concatenate([ql.reshape(n, 128), qh.astype(np.uint8).reshape(n, 64), sc.view(np.uint8),
                          d.reshape(n, 1).view(np.uint8)], axis=1)
    return out.reshape(*np.shape(x)[:-1], -1)


def quantize_q4_k(x: np.ndarray) -> np.ndarray:
    """[..., C] -> uint8 [..., C / 256 * 144]: d f16, dmin f16, scales[12] (6-bit), qs[128]."""
    b = _superblocks(x)
    n = b.shape[0]
    sub = b.reshape(n, 8, 32)
    lo = np.minimum(sub.min(-1), 0)  # value = d*sc*q - dmin*m, m >= 0
    step = (sub.max(-1) - lo) / 15.0
    d = (step.max(-1) / 63.0).astype(np.float16)
    dmin = (-lo.min(-1) / 63.0).astype(np.float16)
    d32, m32 = d.astype(np.float32)[:, None], dmin.astype(np.float32)[:, None]
    sc = np.clip(np.where(d32 > 0, np.ceil(step / np.where(d32 > 0, d32, 1)), 0), 0, 63).astype(np.uint8)
    m = np.clip(np.where(m32 > 0, np.round(-lo / np.where(m32 > 0, m32, 1)), 0), 0, 63).astype(np.uint8)
    scale, offset = d32 * sc, m32 * m  # [N, 8]
    q = np.where(scale[..., None] > 0, np.round((sub + offset[..., None]) / np.where(scale[..., None] > 0,
                                                                                      scale[..., None], 1)), 0)
    q = np.clip(q, 0, 15).astype(np.uint8)  # [N, 8, 32]
    packed = np.zeros((n, 12), np.uint8)
    packed[:, 0:4] = sc[:, 0:4] | ((sc[:, 4:8] >> 4) << 6)
    packed[:, 4:8] = m[:, 0:4] | ((m[:, 4:8] >> 4) << 6)
    packed[:, 8:12] = (sc[:, 4:8] & 0xF) | ((m[:, 4:8] & 0xF) << 4)
    qs = (q[:, 0::2] | (q[:, 1::2] << 4)).reshape(n, 128)  # sub-blocks 2j (low) and 2j+1 (high)
    out = np.concatenate([d.reshape(n, 1).view(np.uint8), dmin.reshape(n, 1).view(np.uint8), packed, qs], axis=1)
    return out.reshape(*np.shape(x)[:-1], -1)


KVALUES_IQ4NL = np.array([-127, -104, -83, -65, -49, -35, -22, -10, 1, 13, 25, 38, 53, 69, 89, 113], np.float32)


def quantize_iq4_nl(x: np.ndarray) -> np.ndarray:
    """[..., C] -> uint8 [..., C / 32 * 18]: d f16, qs[16] (weight j < 16 low nibble of byte j,
    j >= 16 high nibble of byte j - 16); value d * KVALUES_IQ4NL[q]. d maps the block's value of
    largest magnitude onto -127 (ggml's starting point), each weight to its nearest level."""
    x = np.asarray(x, np.float32)
    if x.shape[-1] % 32:
        raise ValueError(f"IQ4_NL rows must be a multiple of 32, got {x.shape}")
    b = x.reshape(-1, 32)
    n = b.shape[0]
    first = np.abs(b).argmax(-1)
    d = (b[np.arange(n), first] / -127.0).astype(np.float16)
    d32 = d.astype(np.float32)[:, None]
    levels = d32[..., None] * KVALUES_IQ4NL  # [N, 1, 16]
    q = np.abs(b[..., None] - levels).argmin(-1).astype(np.uint8)  # [N, 32]
    qs = q[:, :16] | (q[:, 16:] << 4)
    out = np.concatenate([d.reshape(n, 1).view(np.uint8), qs], axis=1)
    return out.reshape(*x.shape[:-1], -1)
