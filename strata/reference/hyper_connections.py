"""Hyper-connections (Qwen4-Exp's gated residual over `hc_count` streams), pure numpy.

The residual is hc streams of width D, side by side: [T, S], S = hc * D (the embedding is
copied into every stream). Before a block (the mixer, the MoE block) a hyper-connection reads
the streams into the block's one input and says how much of the block's output each stream
takes; after it, the streams add that share (`hc_write`). A last one, with no injection, reads
the streams into the head's input. For streams X [T, hc, D] (as S = hc * D):

    Xn   = grouped_rms_norm(X) * w_norm            each stream normed on its own (no pre-norm besides)
    mix  = sigmoid(W_up silu(W_down Xn / hc))      [T, S]: a per-stream, per-channel input weight
    in   = mean over streams of (mix * Xn)         [T, D]: the block's input
    inj  = 2 sigmoid(W_inject Xn / hc)             [T, hc]: each stream's share of the output
    X   <- X + inj[:, :, None] * block(in)[:, None, :]

The norm weight has transformers' zero-centred 1 + w folded in by the converter.
"""

from __future__ import annotations

import numpy as np

from strata.model_config import ModelConfig
from strata.families.qwen4_exp import Qwen4Names
from strata.reference.attention import sigmoid
from strata.reference.deltanet import silu


def expand_streams(cfg: ModelConfig, x: np.ndarray) -> np.ndarray:
    """The embedding copied into every stream. [T, D] -> [T, hc * D]"""
    return np.tile(np.asarray(x, np.float32), (1, cfg.qwen4.hc_count))


def grouped_rms_norm(x: np.ndarray, weight: np.ndarray, group: int, eps: float) -> np.ndarray:
    """RMSNorm over each consecutive `group` channels, then * weight. [..., S] -> [..., S]"""
    x = np.asarray(x, np.float32)
    g = x.reshape(*x.shape[:-1], -1, group)  # [..., S / group, group]
    inv = np.float32(1.0) / np.sqrt(np.mean(g * g, axis=-1, keepdims=True) + np.float32(eps))
    return ((g * inv).reshape(x.shape) * weight).astype(np.float32)


def hc_read(cfg: ModelConfig, dense, prefix: str, streams: np.ndarray, *,
            inject: bool = True) -> tuple[np.ndarray, np.ndarray | None]:
    """The block input and each stream's share of its output (None without injection weights:
    the hyper-connection before the head).

    Shapes: streams [T, S] -> (input [T, D], inject [T, hc] or None)"""
    q, hc, d = Qwen4Names, cfg.qwen4.hc_count, cfg.hidden_size
    w = lambda part: dense[q.hc(prefix, part)]  # noqa: E731
    normed = grouped_rms_norm(streams, w(q.hc_norm), d, cfg.rms_norm_eps)  # [T, S]
    low = silu((normed @ w(q.hc_down).T) / np.float32(hc))  # [T, r]
    mix = sigmoid((low @ w(q.hc_up).T).astype(np.float32))  # [T, S]
    t = streams.shape[0]
    block_input = (mix * normed).reshape(t, hc, d).mean(axis=1).astype(np.float32)  # [T, D]
    if not inject:
        return block_input, None
    shares = np.float32(2.0) * sigmoid(((normed @ w(q.hc_inject).T) / np.float32(hc)).astype(np.float32))
    return block_input, shares


def hc_write(streams: np.ndarray, inject: np.ndarray, out: np.ndarray) -> np.ndarray:
    """Each stream plus its share of the block's output.

    Shapes: streams [T, S], inject [T, hc], out [T, D] -> [T, S]"""
    t, hc = inject.shape
    added = inject[:, :, None] * np.asarray(out, np.float32)[:, None, :]  # [T, hc, D]
    return (streams + added.reshape(t, -1)).astype(np.float32)
