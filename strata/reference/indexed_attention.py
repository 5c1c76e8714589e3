"""Indexed ("QSA") attention (Qwen4-Exp's full-attention layers), pure numpy: state in, state out.

The layer is the hybrid families' gated attention (per-head q/k RMSNorm, partial rotary, a
sigmoid output gate: reference/attention.py), except that each query sees only the keys an
indexer selects. The indexer has its own small projection: Hi query heads and one key head of
width di. Its keys are grouped in consecutive blocks of `indexer_block` (c) positions; a
complete block is represented by the mean of its raw keys, RMS-normed and rotated at the
block's first position. Query i (position p) sees:

    the best  budget / c  complete blocks among the (p + 1) // c before it, by
        score(b) = sum over heads h of relu(q_h . K_b) / sqrt(di)      (q normed, rotated at p)
    and every position of its incomplete last block (p - (p + 1) % c + 1 .. p).

With no more complete blocks than the budget's, every block is selected: full causal attention.
Note that a query closing a block (p + 1 a multiple of c) sees itself only if its block is chosen.

State: the attention KV cache and the indexer's raw keys (every position's, so `trim(n)` works
for every n; the block keys are recomputed from them: a block's mean depends on its own c keys
only, so this is what a cache of compressed blocks would hold).
"""

from __future__ import annotations

from dataclasses import dataclass

import numpy as np

from strata.model_config import ModelConfig, TensorNames
from strata.families.qwen4_exp import Qwen4Names
from strata.reference.attention import LayerKV, attention, partial_rope, rms_norm


@dataclass(frozen=True)
class IndexedKV:
    """An indexed-attention layer's state. Shapes: kv as LayerKV; index_keys [T_cached, di] (raw,
    before the block mean and its norm)"""

    kv: LayerKV
    index_keys: np.ndarray

    @staticmethod
    def empty(cfg: ModelConfig) -> "IndexedKV":
        return IndexedKV(LayerKV.empty(cfg), np.zeros((0, cfg.qwen4.indexer_head_dim), np.float32))

    @property
    def length(self) -> int:
        return self.kv.length

    def trim(self, n: int) -> "IndexedKV":
        """The first n positions (every n restorable, as for attention)."""
        return IndexedKV(self.kv.trim(n), self.index_keys[:n])


def block_keys(cfg: ModelConfig, dense, layer: int, raw_keys: np.ndarray) -> np.ndarray:
    """Every complete block's key: the mean of its raw keys, normed, rotated at its first position.

    Shapes: raw_keys [S, di] -> [S // c, di]"""
    c = cfg.qwen4.indexer_block
    n_blocks = raw_keys.shape[0] // c
    pooled = raw_keys[:n_blocks * c].reshape(n_blocks, c, raw_keys.shape[1]).mean(axis=1, dtype=np.float32)  # [B, di]
    pooled = rms_norm(pooled, dense[TensorNames.block(layer, Qwen4Names.idx_k_norm)], cfg.rms_norm_eps)
    starts = np.arange(n_blocks) * c
    return partial_rope(pooled[None], starts, cfg.rope_theta, cfg.rope_dim)[0]


def index_queries(cfg: ModelConfig, dense, layer: int, x: np.ndarray, positions: np.ndarray):
    """The indexer's normed, rotated queries and its raw keys for x.

    Shapes: x [T, D], positions [T] -> (queries [T, Hi, di], raw keys [T, di])"""
    hi, di = cfg.qwen4.indexer_heads, cfg.qwen4.indexer_head_dim
    qk = (x @ dense[TensorNames.block(layer, Qwen4Names.idx_qk)].T).astype(np.float32)  # [T, (Hi + 1) di]
    t = x.shape[0]
    q = rms_norm(qk[:, :hi * di].reshape(t, hi, di), dense[TensorNames.block(layer, Qwen4Names.idx_q_norm)],
                 cfg.rms_norm_eps)
    q = partial_rope(q.transpose(1, 0, 2), positions, cfg.rope_theta, cfg.rope_dim).transpose(1, 0, 2)
    return q, qk[:, hi * di:]


def selected_keys(cfg: ModelConfig, queries: np.ndarray, blocks: np.ndarray, positions: np.ndarray,
                  n_keys: int) -> np.ndarray:
    """Which keys each query sees: its best complete blocks and its own incomplete block.

    Shapes: queries [T, Hi, di], blocks [B, di], positions [T] -> bool [T, n_keys]"""
    c = cfg.qwen4.indexer_block
    top = cfg.qwen4.indexer_budget // c
    keep = np.zeros((len(positions), n_keys), bool)
    scale = np.float32(np.sqrt(cfg.qwen4.indexer_head_dim))
    for t, p in enumerate(positions):
        complete = (int(p) + 1) // c
        if complete:
            scores = np.maximum(queries[t] @ blocks[:complete].T, 0).sum(axis=0) / scale  # [complete]
            # descending, the earlier block first among equals (a stable sort of the negated scores)
            chosen = np.argsort(-scores, kind="stable")[:min(top, complete)]
            for b in chosen:
                keep[t, b * c:(b + 1) * c] = True
        keep[t, complete * c:int(p) + 1] = True
    return keep


def indexed_attention(cfg: ModelConfig, dense, layer: int, state: IndexedKV,
                      x: np.ndarray) -> tuple[np.ndarray, IndexedKV]:
    """Gated attention of the new positions over the keys the indexer selects (module doc).

    Shapes:
        x: [T, D] (the hyper-connection's block input) -> ([T, D], IndexedKV with T more positions)
    """
    t = x.shape[0]
    positions = np.arange(state.length, state.length + t)
    queries, raw = index_queries(cfg, dense, layer, x, positions)
    raw_keys = np.concatenate([state.index_keys, raw], axis=0)  # [S, di]
    keep = selected_keys(cfg, queries, block_keys(cfg, dense, layer, raw_keys), positions, raw_keys.shape[0])
    out, kv = attention(cfg, dense, layer, state.kv, x, keep=keep)
    return out, IndexedKV(kv, raw_keys)
