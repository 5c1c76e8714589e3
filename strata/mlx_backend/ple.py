"""Twin of strata.reference.ple on MLX ops: the PLE term of a Qwen4-Exp layer.

The n-gram ids are the reference's (`ngram_row_ids`: host integers, known from the tokens) and
the rows come from the same row source (reference/ngram_rows.py), copied to the device; the
projections, the gate and the dilated conv are MLX ops. The state is the reference's `PleState`
with its conv inputs as an MLX array (the n-gram context stays host int64).
"""

from __future__ import annotations

from dataclasses import dataclass

import mlx.core as mx
import numpy as np

from strata.mlx_backend.dense import Weight, project
from strata.model_config import ModelConfig
from strata.families.qwen4_exp import ple_layers
from strata.reference.deltanet import KEPT_SNAPSHOTS
from strata.reference.ngram_hash import NgramHash, initial_ngram_context, ngram_context_after
from strata.reference.ngram_rows import NgramRows
from strata.reference.ple import GATE_FLOOR, PleSnapshot, PleState, conv_state_len, ple_embeddings

__all__ = ["PleWeights", "empty_ple_state", "grouped_rms_norm", "ple"]


@dataclass(frozen=True, eq=False)
class PleWeights:
    """key, value and conv as stored (mlx_backend/dense.py), the norms float32. Shapes: key [S, E],
    value [D, E], key_norm / query_norm / conv_norm [S], conv [S, K]"""

    key: Weight
    value: Weight
    key_norm: mx.array
    query_norm: mx.array
    conv_norm: mx.array
    conv: Weight  # [S, K]: never Q8_0 (K is not a multiple of its block)

    def arrays(self) -> list:
        return [self.key, self.value, self.key_norm, self.query_norm, self.conv_norm, self.conv]


def grouped_rms_norm(x: mx.array, weight: mx.array, group: int, eps: float) -> mx.array:
    """Twin of reference `grouped_rms_norm`. [..., S] -> [..., S]"""
    g = x.reshape(*x.shape[:-1], -1, group)
    g = g * mx.rsqrt(mx.mean(g * g, axis=-1, keepdims=True) + eps)
    return g.reshape(x.shape) * weight


def empty_ple_state(cfg: ModelConfig, layer: int) -> PleState:
    h = NgramHash.of(cfg, ple_layers(cfg).index(layer))
    conv = mx.zeros((conv_state_len(cfg), cfg.qwen4.hc_count * cfg.hidden_size), mx.float32)
    return PleState(initial_ngram_context(h), conv, eos_token=cfg.qwen4.ngram_eos_token)


def ple(cfg: ModelConfig, w: PleWeights, layer: int, rows: NgramRows, state: PleState, streams: mx.array,
        tokens: np.ndarray, *, window: bool = False) -> tuple[mx.array, PleState]:
    """Twin of reference `ple`. streams [T, S], tokens [T] -> ([T, S], PleState with T more positions)"""
    d, hc, eps, t = cfg.hidden_size, cfg.qwen4.hc_count, cfg.rms_norm_eps, streams.shape[0]
    index = ple_layers(cfg).index(layer)
    emb = mx.array(ple_embeddings(cfg, index, rows, state.context, tokens))  # [T, E]
    key = grouped_rms_norm(project(emb, w.key), w.key_norm, d, eps).reshape(t, hc, d)
    value = project(emb, w.value)  # [T, D]; weights as stored (dense.py)
    query = grouped_rms_norm(streams, w.query_norm, d, eps).reshape(t, hc, d)
    gate = (key * query).sum(axis=-1) / np.float32(np.sqrt(d))  # [T, hc]
    gate = mx.sqrt(mx.maximum(mx.abs(gate), GATE_FLOOR)) * mx.sign(gate)
    gated = (mx.sigmoid(gate)[:, :, None] * value[:, None, :]).reshape(t, hc * d)
    normed = grouped_rms_norm(gated, w.conv_norm, d, eps)
    padded = mx.concatenate([state.conv, normed], axis=0)  # [L + T, S]
    dil = cfg.qwen4.ngram_size
    wc = w.conv.astype(mx.float32)  # widened per op (exact)
    conv = sum(wc[:, j] * padded[j * dil:j * dil + t] for j in range(cfg.qwen4.ple_conv_kernel))
    conv = conv * mx.sigmoid(conv)
    keep, snaps = conv_state_len(cfg), []
    h = NgramHash.of(cfg, index)
    tokens = np.asarray(tokens, np.int64)
    for i in range(t):
        if window or i == t - 1:
            snaps.append(PleSnapshot(state.length + i + 1, ngram_context_after(h, state.context, tokens[:i + 1]),
                                     padded[i + 1:i + 1 + keep]))
    kept = (tuple(s for s in state.kept if s.position < snaps[0].position) + tuple(snaps))[-KEPT_SNAPSHOTS:]
    last = snaps[-1]
    return gated + conv, PleState(last.context, last.conv, state.length + t, kept, state.eos_token)
