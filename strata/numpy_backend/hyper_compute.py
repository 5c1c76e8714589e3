"""`HyperNumpyCompute`: the streaming runtime's LayerCompute for a hyper-connection model
(Qwen4-Exp) on the numpy reference pieces; routed experts come from arena slots.

The runtime's loop (strata.runtime.decode, strata.runtime.prompt) is unchanged: what it calls
the hidden state `x` is here the residual streams [T, hc * D]. `mixer` adds the PLE term on PLE
layers and runs the mixer inside its hyper-connection (reference/hyper_model.py); `router_input`
reads the MoE block's input h [T, D] through the layer's second hyper-connection and keeps its
injection weights for `combine`, which writes routed + shared back into the streams. `embed`
keeps the tokens the PLE layers hash; `head` is the last hyper-connection and the LM head.
The PLE rows come from a row source (resident tables by default). At λ = 0 the logits are the
reference forward's (same pieces, same order).
"""

from __future__ import annotations

from typing import Sequence

import numpy as np

from strata.errors import ConfigError
from strata.model_config import TensorNames
from strata.numpy_backend.compute import NumpyCompute, RoutedPart
from strata.reference import model as ref
from strata.reference.hyper_connections import expand_streams, hc_read, hc_write
from strata.reference.hyper_model import hyper_head, hyper_mixer, resident_rows
from strata.reference.ngram_rows import NgramRows

__all__ = ["HyperNumpyCompute"]


class HyperNumpyCompute(NumpyCompute):
    """NumpyCompute whose `x` is the residual streams (module doc). rows: the PLE row source."""

    def __init__(self, params: ref.ModelParams, arena, layouts, *, pred_q8: bool = True, layers=None,
                 rows: NgramRows | None = None) -> None:
        if layers is not None and (layers.start, layers.stop) != (0, params.cfg.n_layers):
            raise ConfigError("hc_count: pipeline stages of a hyper-connection model are not supported")
        super().__init__(params, arena, layouts, pred_q8=pred_q8)
        if rows is None:
            rows = params.rows if params.rows is not None else resident_rows(params.cfg, params.dense)
        self.rows = rows
        self._tokens = np.zeros(0, np.int64)  # the positions being computed (embed to head)
        self._inject: np.ndarray | None = None  # router_input's injection weights, until combine

    def embed(self, tokens: np.ndarray) -> np.ndarray:
        self._tokens = np.asarray(tokens, np.int64)
        return expand_streams(self.params.cfg, ref.embed(self.params, tokens))

    def mixer(self, layer: int, x: np.ndarray, *, window: bool = False) -> np.ndarray:
        layers = list(self.state.layers)
        x, layers[layer] = hyper_mixer(self.params, layer, layers[layer], x, self._tokens, self.rows, window=window)
        self.state = ref.ModelState(tuple(layers))
        return x

    def dense_ffn(self, layer: int, x: np.ndarray) -> np.ndarray:
        raise ConfigError("hc_count: a hyper-connection model has no dense FFN layers")

    def router_input(self, layer: int, x: np.ndarray) -> np.ndarray:
        h, self._inject = hc_read(self.params.cfg, self.params.dense, TensorNames.block(layer, "hc_ffn"), x)
        return h

    def combine(self, x: np.ndarray, parts: Sequence[RoutedPart], shared: np.ndarray) -> np.ndarray:
        d = self.params.cfg.hidden_size
        out = super().combine(np.zeros((x.shape[0], d), np.float32), parts, shared)  # routed + shared, [T, D]
        inject, self._inject = self._inject, None
        return hc_write(x, inject, out)

    def head(self, x: np.ndarray) -> np.ndarray:
        return hyper_head(self.params, x)
