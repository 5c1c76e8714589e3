"""A PLE (per-layer n-gram embedding) module of Qwen4-Exp, pure numpy: state in, state out.

It adds, before the layer's hyper-connection, a term built from the hashed n-grams ending at
each token (reference/ngram_hash.py gives the row ids; the rows come from a row source,
reference/ngram_rows.py, never from the table directly, so they may be streamed from disk).
For a token's concatenated rows e [E] and the streams X [hc, D]:

    k = grouped_rms_norm(W_key e) [hc, D],  v = W_value e [D],  q = grouped_rms_norm(X) [hc, D]
    g = <k_s, q_s> / sqrt(D) per stream;  g = sign(g) sqrt(max(|g|, 1e-6))
    y = sigmoid(g)[:, None] * v                                   [hc, D]: the gated value
    out = y + silu(dilated depthwise conv(grouped_rms_norm(y)))   taps K, dilation ngram_size

State: the n-gram context (the last ngram_size - 1 tokens) and the conv's last (K - 1) * ngram_size
inputs, with snapshots kept at the positions its DeltaNet layer keeps them (reference/deltanet.py),
so the layer's composite state (`PleLayerState`) restores exactly where its mixer does.
"""

from __future__ import annotations

from dataclasses import dataclass

import numpy as np

from strata.errors import ConfigError
from strata.model_config import ModelConfig, TensorNames
from strata.families.qwen4_exp import Qwen4Names, ple_layers
from strata.reference.attention import sigmoid
from strata.reference.deltanet import KEPT_SNAPSHOTS, DeltaNetState, silu
from strata.reference.hyper_connections import grouped_rms_norm
from strata.reference.ngram_hash import NgramHash, initial_ngram_context, ngram_context_after, ngram_row_ids
from strata.reference.ngram_rows import NgramRows, ResidentNgramRows

GATE_FLOOR = 1e-6  # transformers' clamp under the signed square root of the gate


def conv_state_len(cfg: ModelConfig) -> int:
    """How many past conv inputs the dilated conv reads: (K - 1) * dilation."""
    return (cfg.qwen4.ple_conv_kernel - 1) * cfg.qwen4.ngram_size


@dataclass(frozen=True)
class PleSnapshot:
    position: int
    context: np.ndarray  # int64 [ngram_size - 1]
    conv: np.ndarray  # [(K - 1) * ngram_size, S]


@dataclass(frozen=True)
class PleState:
    """A PLE module's state after `length` positions. Shapes: context int64 [ngram_size - 1]
    (the tokens before the next one, EOS before the first), conv [(K - 1) * ngram_size, S] (the
    normed gated values the conv still reads, oldest first; zeros before the first position)."""

    context: np.ndarray
    conv: np.ndarray
    length: int = 0
    kept: tuple[PleSnapshot, ...] = ()
    eos_token: int = 0  # the empty state's context (trim(0))

    @staticmethod
    def empty(cfg: ModelConfig, ple_index: int) -> "PleState":
        conv = np.zeros((conv_state_len(cfg), cfg.qwen4.hc_count * cfg.hidden_size), np.float32)
        return PleState(initial_ngram_context(NgramHash.of(cfg, ple_index)), conv, eos_token=cfg.qwen4.ngram_eos_token)

    def trim(self, n: int) -> "PleState":
        """The state after n positions: the current one, a kept snapshot, or empty (n = 0)."""
        if n == self.length:
            return self
        if n == 0:
            return PleState(np.full_like(self.context, self.eos_token), self.conv * 0, eos_token=self.eos_token)
        kept = tuple(s for s in self.kept if s.position <= n)
        if not kept or kept[-1].position != n:
            raise ValueError(f"trim: a PLE module keeps no snapshot at position {n}")
        return PleState(kept[-1].context, kept[-1].conv, n, kept, self.eos_token)


@dataclass(frozen=True)
class PleLayerState:
    """A DeltaNet layer with a PLE module: both states, restored together."""

    mixer: DeltaNetState
    ple: PleState

    @property
    def length(self) -> int:
        return self.mixer.length

    def trim(self, n: int) -> "PleLayerState":
        return PleLayerState(self.mixer.trim(n), self.ple.trim(n))


def empty_ple_layer_state(cfg: ModelConfig, layer: int) -> PleLayerState:
    return PleLayerState(DeltaNetState.empty(cfg), PleState.empty(cfg, ple_layers(cfg).index(layer)))


def resident_rows(cfg: ModelConfig, dense) -> ResidentNgramRows:
    """The row source over the n-gram tables held with the dense weights, by PLE index."""
    if cfg.qwen4.ple_row_store:
        raise ConfigError("ple_row_store: this model's n-gram tables are in its row store, not among the dense "
                          "weights; pass the row source (strata.runtime.ngram_source.ple_rows_for)")
    return ResidentNgramRows(dict(ple_table_items(cfg, dense)))


def ple_table_items(cfg: ModelConfig, dense):
    """(PLE index, table [rows, width]) for each PLE layer, in order: what a row store is written from."""
    for i, layer in enumerate(ple_layers(cfg)):
        yield i, dense[TensorNames.block(layer, Qwen4Names.ple_ngram)]


def ple_embeddings(cfg: ModelConfig, ple_index: int, rows: NgramRows, context: np.ndarray,
                   tokens: np.ndarray) -> np.ndarray:
    """Each token's n-gram rows, concatenated head by head. tokens [T] -> [T, E]"""
    ids = ngram_row_ids(NgramHash.of(cfg, ple_index), context, tokens)  # [T, N]
    return rows.rows(ple_index, ids).reshape(len(ids), -1).astype(np.float32)


def dilated_conv(cfg: ModelConfig, weight: np.ndarray, state: np.ndarray, x: np.ndarray):
    """The depthwise conv of x after the state's inputs, then SiLU.

    Shapes: weight [S, K], state [L, S], x [T, S] -> (out [T, S], padded [L + T, S])"""
    padded = np.concatenate([state, x], axis=0)
    t, dil = x.shape[0], cfg.qwen4.ngram_size
    out = np.zeros_like(x)
    for j in range(weight.shape[1]):  # out[t] = sum_j w[:, j] * padded[t + j * dilation]
        out += weight[:, j] * padded[j * dil:j * dil + t]
    return silu(out), padded


def ple(cfg: ModelConfig, dense, layer: int, rows: NgramRows, state: PleState, streams: np.ndarray,
        tokens: np.ndarray, *, window: bool = False) -> tuple[np.ndarray, PleState]:
    """The PLE term for T new positions (module doc); window: keep a snapshot after each.

    Shapes:
        streams [T, S], tokens [T] -> (out [T, S], PleState with T more positions)
    """
    q, d, hc = Qwen4Names, cfg.hidden_size, cfg.qwen4.hc_count
    w = lambda name: dense[TensorNames.block(layer, name)]  # noqa: E731
    eps, t = cfg.rms_norm_eps, streams.shape[0]
    emb = ple_embeddings(cfg, ple_layers(cfg).index(layer), rows, state.context, tokens)  # [T, E]
    key = grouped_rms_norm(emb @ w(q.ple_key).T, w(q.ple_key_norm), d, eps).reshape(t, hc, d)
    value = (emb @ w(q.ple_value).T).astype(np.float32)  # [T, D]
    query = grouped_rms_norm(streams, w(q.ple_query_norm), d, eps).reshape(t, hc, d)
    gate = (key * query).sum(axis=-1) / np.float32(np.sqrt(d))  # [T, hc]
    gate = (np.sqrt(np.maximum(np.abs(gate), np.float32(GATE_FLOOR))) * np.sign(gate)).astype(np.float32)
    gated = (sigmoid(gate)[:, :, None] * value[:, None, :]).reshape(t, hc * d)  # [T, S]
    normed = grouped_rms_norm(gated, w(q.ple_conv_norm), d, eps)
    conv, padded = dilated_conv(cfg, w(q.ple_conv), state.conv, normed)
    keep, snaps = conv_state_len(cfg), []
    tokens = np.asarray(tokens, np.int64)
    h = NgramHash.of(cfg, ple_layers(cfg).index(layer))
    for i in range(t):
        if window or i == t - 1:
            snaps.append(PleSnapshot(state.length + i + 1, ngram_context_after(h, state.context, tokens[:i + 1]),
                                     padded[i + 1:i + 1 + keep].copy()))
    kept = (tuple(s for s in state.kept if s.position < snaps[0].position) + tuple(snaps))[-KEPT_SNAPSHOTS:]
    last = snaps[-1]
    return (gated + conv).astype(np.float32), PleState(last.context, last.conv, state.length + t, kept,
                                                      state.eos_token)
