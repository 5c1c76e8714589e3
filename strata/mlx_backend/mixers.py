"""The MLX twins of the reference's token mixers, one table keyed by the mixer kind (`Mixer`).

The twin of reference/mixers.py for the plain-residual model (model.py, the streaming compute,
the prompt path): each entry builds a layer's mixer weights from the dense weights (as stored:
mlx_backend/dense.py), gives its empty state, and computes its output as partials
(their sum over axis 1 is the output; the router kernel adds x + sum_p parts). A new mixer is
its reference file, its twin here and one entry in each table. Indexed attention is Qwen4-Exp's,
whose hyper-connection norms each block's input (residual.py): its partials take that input,
as a DeltaNet layer without an attn_norm does.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Callable, Mapping

import mlx.core as mx
import numpy as np

from strata.errors import ConfigError
from strata.formats.dense_weights import as_dense_weights
from strata.mlx_backend.attention import AttentionWeights, MlxLayerKV, attention_partials
from strata.mlx_backend.deltanet import DeltaNetWeights, deltanet_partials
from strata.mlx_backend.deltanet import empty_state as empty_deltanet_state
from strata.mlx_backend.dense import held as held_weight
from strata.mlx_backend.dense import held_rows_of
from strata.mlx_backend.indexed_attention import IndexedWeights, empty_indexed_state, indexed_attention
from strata.mlx_backend.mla import MlxLatentKV, mla_partials, mla_weights
from strata.families.qwen4_exp import Qwen4Names
from strata.model_config import Mixer, ModelConfig, QKNorm, TensorNames
from strata.reference.attention import KVPrecision, window_of


@dataclass(frozen=True)
class MlxMixer:
    """weights(cfg, dense, layer, dtype) -> the layer's mixer weights (LayerWeights.attn);
    empty_state(cfg, kv_precision) -> the state a layer starts from;
    partials(cfg, weights, state, x, *, pos, window) -> (parts [T, P, D], new state): x is the
    residual (the norm is the mixer's), pos its cache length on the device (kernel paths), window
    a decode window (a recurrent mixer keeps a snapshot per position).
    softmax_attention: grouped-query softmax attention (AttentionWeights), which the router
    kernel's fused launch and the prompt path's matrix-unit attention serve."""

    weights: Callable
    empty_state: Callable
    partials: Callable
    softmax_attention: bool = False


def attention_weights(cfg: ModelConfig, dense: Mapping[str, np.ndarray], layer: int,
                      dtype: mx.Dtype) -> AttentionWeights:
    """An attention layer's weights: q, k, v (and the output gate's rows) as one projection."""
    n = TensorNames
    get = lambda s: np.asarray(dense[n.block(layer, s)], np.float32)  # noqa: E731
    arr = lambda a: mx.array(a).astype(dtype)  # noqa: E731
    stored = lambda s: as_dense_weights(dense).stored(n.block(layer, s))  # noqa: E731
    gated = cfg.attention_output_gate  # the gate's rows under q, k, v: one projection (attention.py)
    names = [n.block(layer, s) for s in (n.attn_q, n.attn_k, n.attn_v) + ((n.attn_gate,) if gated else ())]
    wqkv = held_rows_of(dense, names, dtype)  # as stored (mlx_backend/dense.py)
    bqkv = None
    if cfg.attention_bias:  # the gate's rows carry no bias
        bqkv = np.concatenate([get(n.attn_q_bias), get(n.attn_k_bias), get(n.attn_v_bias)]
                              + ([np.zeros(cfg.n_heads * cfg.head_dim, np.float32)] if gated else []))
    qk = cfg.qk_norm is not QKNorm.NONE
    return AttentionWeights(arr(get(n.attn_norm)), wqkv, None if bqkv is None else arr(bqkv),
                            arr(get(n.attn_q_norm)) if qk else None, arr(get(n.attn_k_norm)) if qk else None,
                            held_weight(stored(n.attn_output), dtype), gated,
                            sinks=mx.array(get(n.attn_sinks)) if cfg.gpt_oss.attention_sinks else None,
                            bo=arr(get(n.attn_output_bias)) if cfg.gpt_oss.attention_output_bias else None,
                            window=window_of(cfg, layer))


def deltanet_weights(cfg: ModelConfig, dense: Mapping[str, np.ndarray], layer: int,
                     dtype: mx.Dtype) -> DeltaNetWeights:
    n = TensorNames
    get = lambda s: np.asarray(dense[n.block(layer, s)], np.float32)  # noqa: E731
    arr = lambda a: mx.array(a).astype(dtype)  # noqa: E731
    w_in = held_rows_of(dense, [n.block(layer, s) for s in (n.ssm_qkv, n.ssm_z, n.ssm_beta, n.ssm_alpha)], dtype)
    wo = held_weight(as_dense_weights(dense).stored(n.block(layer, n.ssm_out)), dtype)  # as stored (dense.py)
    # no attn_norm where a hyper-connection norms the input (Qwen4-Exp)
    norm = arr(get(n.attn_norm)) if n.block(layer, n.attn_norm) in dense else None
    # the decay parameters stay float32: exp(a * softplus(...)) compounds over every position
    conv = held_weight(as_dense_weights(dense).stored(n.block(layer, n.ssm_conv)), dtype)  # widened per op
    return DeltaNetWeights(norm, w_in, conv, mx.array(get(n.ssm_a)),
                           mx.array(get(n.ssm_dt_bias)), arr(get(n.ssm_norm)), wo)


def indexed_weights(cfg: ModelConfig, dense: Mapping[str, np.ndarray], layer: int,
                    dtype: mx.Dtype) -> IndexedWeights:
    """An indexed-attention layer's weights: matrices as stored (dense.py), norms float32."""
    n, q = TensorNames, Qwen4Names
    stored = lambda s: held_weight(as_dense_weights(dense).stored(n.block(layer, s)), dtype)  # noqa: E731
    vec = lambda s: mx.array(np.asarray(dense[n.block(layer, s)], np.float32))  # noqa: E731
    return IndexedWeights(stored(n.attn_q), stored(n.attn_gate), stored(n.attn_k), stored(n.attn_v),
                          stored(n.attn_output), vec(n.attn_q_norm), vec(n.attn_k_norm), stored(q.idx_qk),
                          vec(q.idx_q_norm), vec(q.idx_k_norm))


def _attention_partials(cfg, w, kv, x, *, pos=None, window=False):
    return attention_partials(cfg, w, kv, x, pos=pos)  # a sliding window is in the layer's AttentionWeights


def _deltanet_partials(cfg, w, state, x, *, pos=None, window=False):
    return deltanet_partials(cfg, w, state, x, window=window)


def _indexed_partials(cfg, w, state, x, *, pos=None, window=False):
    out, state = indexed_attention(cfg, w, state, x)  # x: the hyper-connection's block input
    return out[:, None, :], state


def _mla_partials(cfg, w, kv, x, *, pos=None, window=False):
    return mla_partials(cfg, w, kv, x, pos=pos)  # a decoded position on a kernel path: the absorbed kernels


_ATTENTION = MlxMixer(attention_weights, MlxLayerKV.empty, _attention_partials, softmax_attention=True)

MIXERS: dict[Mixer, MlxMixer] = {
    Mixer.ATTENTION: _ATTENTION,
    Mixer.SLIDING_ATTENTION: _ATTENTION,  # every position kept, as the reference keeps them
    Mixer.DELTANET: MlxMixer(deltanet_weights, lambda cfg, kv_precision=KVPrecision.F32: empty_deltanet_state(cfg),
                             _deltanet_partials),
    Mixer.MLA: MlxMixer(mla_weights, lambda cfg, kv_precision=KVPrecision.F32: MlxLatentKV.empty(cfg),
                        _mla_partials),
    Mixer.INDEXED_ATTENTION: MlxMixer(indexed_weights,
                                      lambda cfg, kv_precision=KVPrecision.F32: empty_indexed_state(cfg),
                                      _indexed_partials),
}

# kinds this table refuses, each with the one line that says where they run
REFUSED: dict[Mixer, str] = {}


def mixer_for(kind: Mixer, layer: int | None = None) -> MlxMixer:
    """The table's entry, or a ConfigError naming the kind (and the layer) and what to use."""
    if kind in MIXERS:
        return MIXERS[kind]
    where = f" (layer {layer})" if layer is not None else ""
    why = REFUSED.get(kind, "no MLX twin yet; use the numpy backend")
    raise ConfigError(f"MLX backend: mixer {kind.value}{where}: {why}")
