"""`HyperMlxCompute`: the runtime's LayerCompute seam for a hyper-connection model (Qwen4-Exp) on
MLX, routed experts from a streaming MlxArena (twin of NumpyCompute over reference/residual.py's
`HyperConnections`).

The runtime's loop is unchanged; what it calls `x` is the residual streams [T, hc * D], wrapped
after `mixer` in a `_Streams` that `router_input` fills with the MoE block's input h and its
injection weights, which `combine` uses to write routed + shared back into the streams. The
pieces are the ops twin's (mlx_backend/hyper_model.py); the read-ahead guess applies a Q8_0 copy
of the next MoE layer's router (`pred_q8`, as MlxCompute; it only chooses what to read ahead).
`router_logits` computes that guess beside z and brings both to the host in one sync, so
`guess_logits` (called after `routed` was handed to the device) is a lookup: a second sync there
waited for the layer's routed experts, once per layer and per prompt chunk (on the H200 the
streaming prefill of the 8-layer synthetic did not finish in 111 s). PLE rows come from the row
source.
"""

from __future__ import annotations

from typing import Sequence

import mlx.core as mx
import numpy as np

from strata.errors import ConfigError
from strata.formats.expert_record import RecordLayout
from strata.mlx_backend.arena import MlxArena, layer_record
from strata.mlx_backend.compute import hand_off
from strata.mlx_backend.experts import combine, routed_partials, shared_partials
from strata.formats.quant_types import QuantType
from strata.mlx_backend.hyper_model import HyperConnections, HyperMlxParams, empty_hyper_state
from strata.mlx_backend.quants import gemv, to_mlx
from strata.reference.quants import quantize
from strata.reference.experts import expert_act
from strata.runtime.compute import StatefulCompute
from strata.reference.ngram_rows import NgramRows

__all__ = ["HyperMlxCompute"]


class _Streams:
    """The streams after a layer's mixer; after `router_input`, also h [T, D] and inject [T, hc];
    after `router_logits`, the next MoE layer's guess logits on the host (guess_layer, guess [T, E])."""

    __slots__ = ("layer", "streams", "h", "inject", "guess_layer", "guess")

    def __init__(self, layer: int, streams: mx.array) -> None:
        self.layer, self.streams = layer, streams
        self.h = self.inject = self.guess_layer = self.guess = None


class HyperMlxCompute(StatefulCompute):
    """LayerCompute over HyperMlxParams (dense, resident) and an MlxArena (experts by slot)."""

    synchronous = False  # `routed` hands the experts to the device (async_eval): hand-off after it

    def __init__(self, params: HyperMlxParams, arena: MlxArena, layout: RecordLayout, rows: NgramRows, *,
                 pred_q8: bool = True, layer_layouts: tuple[RecordLayout, ...] | None = None) -> None:
        """layer_layouts: each MoE layer's record layout, where they differ (arena.record_layouts)."""
        self.params, self.arena, self.layout, self.rows = params, arena, layout, rows
        self.layer_layouts = layer_layouts
        self.residual = HyperConnections(rows)
        self.state = empty_hyper_state(params.cfg)
        self._tokens = np.zeros(0, np.int64)
        self._guess = ({l: to_mlx(quantize(QuantType.Q8_0, np.array(lw.router))) for l, lw in enumerate(params.layers)}
                       if pred_q8 else {})
        moe = params.cfg.moe_layers
        self._next_moe = {l: (moe[i + 1] if i + 1 < len(moe) else None) for i, l in enumerate(moe)}

    def embed(self, tokens: np.ndarray) -> mx.array:
        self._tokens = np.asarray(tokens, np.int64).reshape(-1)
        x = self.params.embed[mx.array(self._tokens.astype(np.int32))]
        return self.residual.expand(self.params, x, self._tokens)

    def mixer(self, layer: int, x: mx.array, *, window: bool = False) -> _Streams:
        layers = list(self.state.layers)
        streams, layers[layer] = self.residual.mixer_block(self.params, layer, layers[layer], x, self._tokens,
                                                           window=window)
        self.state = type(self.state)(tuple(layers))
        return _Streams(layer, streams)

    def dense_ffn(self, layer: int, x: _Streams) -> mx.array:
        raise ConfigError("hc_count: a hyper-connection model has no dense FFN layers")

    def router_input(self, layer: int, x: _Streams) -> _Streams:
        x.h, x.inject = self.residual.ffn_read(self.params, layer, x.streams)
        return x

    def router_logits(self, layer: int, h: _Streams) -> np.ndarray:
        z = h.h @ self.params.layers[layer].router.T
        nxt = self._next_moe.get(layer)
        if nxt is None:
            return np.array(z, dtype=np.float32)  # the host round trip
        g = self._guess_device(nxt, h)
        mx.eval(z, g)  # the layer's one host round trip, for both
        h.guess_layer, h.guess = nxt, np.array(g, dtype=np.float32)
        return np.array(z, dtype=np.float32)

    def guess_logits(self, layer: int, h: _Streams) -> np.ndarray:
        if h.guess is not None and h.guess_layer == layer:
            return h.guess  # brought over with z (module doc)
        return np.array(self._guess_device(layer, h), dtype=np.float32)  # another layer's (prefetch2): a sync

    def _guess_device(self, layer: int, h: _Streams) -> mx.array:
        """MoE layer `layer`'s guess logits on this layer's router input: [T, D] -> [T, E]"""
        return gemv(self._guess[layer], h.h) if layer in self._guess else h.h @ self.params.layers[layer].router.T

    def shared(self, layer: int, h: _Streams):
        out = shared_partials(h.h, self.params.layers[layer].shared)
        mx.async_eval(out)  # runs on the GPU while the host takes its turn
        return out

    def routed(self, layer: int, h: _Streams, slots: np.ndarray, weights: np.ndarray) -> mx.array:
        rec = layer_record(self.layout, self.layer_layouts, self.params.cfg.moe_index(layer))
        out = routed_partials(self.arena.array, rec, h.h, np.asarray(slots, np.int32),
                              np.asarray(weights, np.float32), act=expert_act(self.params.cfg))
        return hand_off(out, slots)

    def combine(self, x: _Streams, parts: Sequence[mx.array], shared) -> mx.array:
        routed = parts[0] if len(parts) == 1 else mx.concatenate(list(parts), axis=1)
        gate_inp = self.params.layers[x.layer].shared.gate_inp
        moe = combine(mx.zeros_like(x.h), routed, shared, x.h, gate_inp)
        return self.residual.ffn_write(x.streams, x.inject, moe)

    def head(self, x: mx.array) -> np.ndarray:
        return np.array(self.residual.head(self.params, x), dtype=np.float32)
