"""Twin of strata.reference.indexed_attention on MLX ops: gated attention over the key blocks
the QSA indexer selects. The state is the reference's `IndexedKV` holding MLX arrays (keys and
values [KVH, T, hd], the indexer's raw keys [T, di]); the selection runs on the device (scores,
a stable descending sort, a scatter into the key mask), the rotary angles are the reference's
(float64 on the host, rounded once).
"""

from __future__ import annotations

from dataclasses import dataclass

import mlx.core as mx
import numpy as np

from strata.mlx_backend.attention import rms_norm
from strata.mlx_backend.dense import Weight, project
from strata.model_config import ModelConfig
from strata.reference.attention import LayerKV
from strata.reference.indexed_attention import IndexedKV

__all__ = ["IndexedWeights", "empty_indexed_state", "indexed_attention"]


@dataclass(frozen=True, eq=False)
class IndexedWeights:
    """Matrices as stored (mlx_backend/dense.py), norms float32. Shapes: wq, wgate [H hd, D];
    wk, wv [KVH hd, D]; wo [D, H hd]; q_norm, k_norm [hd]; idx_qk [(Hi + 1) di, D]; idx_q_norm, idx_k_norm [di]"""

    wq: Weight
    wgate: Weight
    wk: Weight
    wv: Weight
    wo: Weight
    q_norm: mx.array
    k_norm: mx.array
    idx_qk: Weight
    idx_q_norm: mx.array
    idx_k_norm: mx.array

    def arrays(self) -> list:
        return [self.wq, self.wgate, self.wk, self.wv, self.wo, self.q_norm, self.k_norm, self.idx_qk,
                self.idx_q_norm, self.idx_k_norm]


def empty_indexed_state(cfg: ModelConfig) -> IndexedKV:
    z = mx.zeros((cfg.n_kv_heads, 0, cfg.head_dim), mx.float32)
    return IndexedKV(LayerKV(z, z), mx.zeros((0, cfg.qwen4.indexer_head_dim), mx.float32))


def rope(cfg: ModelConfig, x: mx.array, positions: np.ndarray) -> mx.array:
    """Twin of reference `partial_rope` (rotate-half form, the first rope_dim dims). x [H, T, hd] -> same"""
    rd = cfg.rope_dim
    inv_freq = 1.0 / (cfg.rope_theta ** (np.arange(0, rd, 2, dtype=np.float64) / rd))
    angles = np.asarray(positions, np.float64)[:, None] * inv_freq[None, :]
    cos = mx.array(np.cos(np.concatenate([angles, angles], -1)).astype(np.float32))  # [T, rd]
    sin = mx.array(np.sin(np.concatenate([angles, angles], -1)).astype(np.float32))
    a = x[..., :rd]
    rotated = mx.concatenate([-a[..., rd // 2:], a[..., :rd // 2]], axis=-1)
    return mx.concatenate([a * cos + rotated * sin, x[..., rd:]], axis=-1)


def _keep(cfg: ModelConfig, w: IndexedWeights, q_idx: mx.array, raw_keys: mx.array, start: int) -> mx.array:
    """Which keys each new query sees (twin of reference `selected_keys` over `block_keys`).

    Shapes: q_idx [T, Hi, di], raw_keys [S, di] -> bool [T, S]"""
    c, s, t = cfg.qwen4.indexer_block, raw_keys.shape[0], q_idx.shape[0]
    n_blocks = s // c
    top = cfg.qwen4.indexer_budget // c
    positions = np.arange(start, start + t)
    key_pos = mx.arange(s)[None, :]
    query_pos = mx.array(positions)[:, None]
    complete = (query_pos + 1) // c  # [T, 1]: complete blocks before (and including) each query
    tail = (key_pos >= complete * c) & (key_pos <= query_pos)  # [T, S]
    if n_blocks == 0:
        return tail
    pooled = raw_keys[:n_blocks * c].reshape(n_blocks, c, -1).mean(axis=1)
    blocks = rope(cfg, rms_norm(pooled, w.idx_k_norm, cfg.rms_norm_eps)[None], np.arange(n_blocks) * c)[0]
    scores = mx.maximum(q_idx @ blocks.T, 0).sum(axis=1) / np.float32(np.sqrt(cfg.qwen4.indexer_head_dim))  # [T, B]
    eligible = mx.arange(n_blocks)[None, :] < complete  # [T, B]
    # a block's rank: the eligible blocks scoring more, or as much and earlier (the reference's
    # stable descending order). O(T B^2) comparisons: an ops twin, not a long-context path.
    sc, other = scores[:, :, None], scores[:, None, :]  # [T, B (this), B (other)]
    idx = mx.arange(n_blocks)
    ahead = (other > sc) | ((other == sc) & (idx[None, None, :] < idx[None, :, None]))
    rank = (ahead & eligible[:, None, :]).sum(axis=-1)  # [T, B]
    chosen = eligible & (rank < top)  # [T, B]
    block_of_key = mx.minimum(mx.arange(s) // c, n_blocks - 1)
    in_chosen = mx.take_along_axis(chosen, mx.broadcast_to(block_of_key[None, :], (t, s)), axis=1)
    in_chosen = in_chosen & (key_pos < n_blocks * c)
    return tail | in_chosen


def indexed_attention(cfg: ModelConfig, w: IndexedWeights, state: IndexedKV, x: mx.array
                      ) -> tuple[mx.array, IndexedKV]:
    """Twin of reference `indexed_attention`. x [T, D] (the block input) -> ([T, D], IndexedKV)"""
    t, start = x.shape[0], state.length
    h, kvh, hd = cfg.n_heads, cfg.n_kv_heads, cfg.head_dim
    hi, di = cfg.qwen4.indexer_heads, cfg.qwen4.indexer_head_dim
    positions = np.arange(start, start + t)
    qk = project(x, w.idx_qk)  # [T, (Hi + 1) di]
    q_idx = rms_norm(qk[:, :hi * di].reshape(t, hi, di), w.idx_q_norm, cfg.rms_norm_eps)
    q_idx = rope(cfg, q_idx.transpose(1, 0, 2), positions).transpose(1, 0, 2)
    raw_keys = mx.concatenate([state.index_keys, qk[:, hi * di:]], axis=0)
    keep = _keep(cfg, w, q_idx, raw_keys, start)  # [T, S]
    q = rms_norm(project(x, w.wq).reshape(t, h, hd).transpose(1, 0, 2), w.q_norm, cfg.rms_norm_eps)
    k = rms_norm(project(x, w.wk).reshape(t, kvh, hd).transpose(1, 0, 2), w.k_norm, cfg.rms_norm_eps)
    v = project(x, w.wv).reshape(t, kvh, hd).transpose(1, 0, 2)
    q, k = rope(cfg, q, positions), rope(cfg, k, positions)
    keys = mx.concatenate([state.kv.keys, k], axis=1)  # [KVH, S, hd]
    values = mx.concatenate([state.kv.values, v], axis=1)
    group = h // kvh
    scores = (q @ mx.repeat(keys, group, axis=0).transpose(0, 2, 1)) / np.float32(np.sqrt(hd))  # [H, T, S]
    scores = mx.where(keep[None], scores, -np.inf)
    probs = mx.softmax(scores, axis=-1, precise=True)
    out = (probs @ mx.repeat(values, group, axis=0)).transpose(1, 0, 2).reshape(t, h * hd)
    out = project(out * mx.sigmoid(project(x, w.wgate)), w.wo)  # weights as stored (dense.py)
    return out, IndexedKV(LayerKV(keys, values), raw_keys)
