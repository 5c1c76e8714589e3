"""The residual stream as a strategy (pure numpy): what carries the hidden state between blocks.

The forward pass (model.py) and its twins on the runtime's seam run one layer loop; how a block
reads the residual and writes its output back is the strategy's, chosen from the config by
`residual_for` (by `ModelConfig.residual`, a table like the mixers'):

- `PlainResidual` (every family but Qwen4-Exp): one stream x [T, D] with pre-norms,
  x += mixer(rms_norm(x)); h = rms_norm(x); x += ffn(h); logits = head(rms_norm(x)).
- `HyperConnections` (Qwen4-Exp): hc streams side by side, X [T, S], S = hc * D
  (reference/hyper_connections.py), each block between a read and a write of its own
  hyper-connection, and on PLE layers the PLE term first (reference/ple.py):

      X += ple(X, tokens)                        PLE layers only (rows from a row source)
      a, inj = hc_read(hc_attn, X);  X = hc_write(X, inj, mixer(a))
      h, inj = hc_read(hc_ffn, X);   X = hc_write(X, inj, ffn(h))      h is what the router sees
      logits = hc_read(hc_output, X) W_head^T    (no final norm: the last hyper-connection norms)

A strategy's static parts: `for_params` (built for a model's params, its PLE row source and a
pipeline stage's layers) and `empty_layer_state` (what a layer keeps: its mixer's state, and
under hyper-connections a PLE layer's PLE module state beside it). Its methods: `expand` (the embedding -> the residual), `mixer_block` (the layer's
mixer applied to the residual), `ffn_read` (the FFN input h and what `ffn_write` needs to put
the FFN's output back), `ffn_write`, `head` (last_only: a prefill's logits, the last position's). The mixers, the router, the experts are the
reference's own pieces, whatever the residual.
"""

from __future__ import annotations

from typing import Protocol

import numpy as np

from strata.errors import ConfigError
from strata.families.qwen4_exp import HC_FINAL, ple_layers
from strata.model_config import LayerRange, ModelConfig, ResidualKind, TensorNames
from strata.reference.hyper_connections import expand_streams, hc_read, hc_write
from strata.reference.layers import head, mixer_block, router_input
from strata.reference.mixers import MixerState, mixer_for
from strata.reference.ngram_rows import NgramRows
from strata.reference.ple import PleLayerState, empty_ple_layer_state, ple, resident_rows

__all__ = ["Residual", "PlainResidual", "HyperConnections", "RESIDUALS", "residual_for"]


class Residual(Protocol):
    """How a layer's blocks read and write the residual (module doc). `r` is the residual: [T, D]
    for the plain stream, [T, S] for hyper-connection streams; h and block outputs are [T, D]."""

    def expand(self, params, x: np.ndarray, tokens: np.ndarray) -> np.ndarray: ...

    def mixer_block(self, params, layer: int, state, r: np.ndarray, tokens: np.ndarray, *,
                    window: bool) -> tuple[np.ndarray, object]: ...

    def ffn_read(self, params, layer: int, r: np.ndarray) -> tuple[np.ndarray, object]: ...

    def ffn_write(self, r: np.ndarray, carry, out: np.ndarray) -> np.ndarray: ...

    def head(self, params, r: np.ndarray, *, last_only: bool = False) -> np.ndarray: ...


class PlainResidual:
    """One stream with pre-norms (layers.py's pieces); takes pipeline stages."""

    @staticmethod
    def for_params(params, rows: NgramRows | None, layers: LayerRange | None) -> "PlainResidual":
        return PLAIN

    @staticmethod
    def empty_layer_state(cfg: ModelConfig, layer: int) -> MixerState:
        return mixer_for(cfg.kinds[layer].mixer).empty_state(cfg)

    def expand(self, params, x: np.ndarray, tokens: np.ndarray) -> np.ndarray:
        return x

    def mixer_block(self, params, layer: int, state, r: np.ndarray, tokens: np.ndarray, *, window: bool):
        return mixer_block(params, layer, state, r, window=window)

    def ffn_read(self, params, layer: int, r: np.ndarray) -> tuple[np.ndarray, None]:
        return router_input(params, layer, r), None

    def ffn_write(self, r: np.ndarray, carry, out: np.ndarray) -> np.ndarray:
        return r + out

    def head(self, params, r: np.ndarray, *, last_only: bool = False) -> np.ndarray:
        return head(params, r[-1:] if last_only else r)


PLAIN = PlainResidual()


class HyperConnections:
    """hc streams, a hyper-connection around each block (module doc). rows: the PLE layers' n-gram
    row source. A whole model only: a pipeline stage would hand on [T, S] streams."""

    def __init__(self, rows: NgramRows) -> None:
        self.rows = rows

    @staticmethod
    def for_params(params, rows: NgramRows | None, layers: LayerRange | None) -> "HyperConnections":
        """rows: default `params.rows`, else the tables held with the dense weights."""
        cfg = params.cfg
        if layers is not None and (layers.start, layers.stop) != (0, cfg.n_layers):
            raise ConfigError("hc_count: pipeline stages of a hyper-connection model are not supported")
        if rows is None:
            rows = params.rows if params.rows is not None else resident_rows(cfg, params.dense)
        return HyperConnections(rows)

    @staticmethod
    def empty_layer_state(cfg: ModelConfig, layer: int) -> MixerState | PleLayerState:
        """The mixer's state, and on a PLE layer its PLE module's beside it (a DeltaNet layer's)."""
        if layer in ple_layers(cfg):
            return empty_ple_layer_state(cfg, layer)
        return mixer_for(cfg.kinds[layer].mixer).empty_state(cfg)

    def expand(self, params, x: np.ndarray, tokens: np.ndarray) -> np.ndarray:
        return expand_streams(params.cfg, x)  # [T, hc * D]

    def mixer_block(self, params, layer: int, state, r: np.ndarray, tokens: np.ndarray, *, window: bool):
        """The PLE term (on PLE layers) and the mixer with its hyper-connection. [T, S] -> ([T, S], state)"""
        cfg, dense = params.cfg, params.dense
        prefix = TensorNames.block(layer, "hc_attn")
        mixer = mixer_for(cfg.kinds[layer].mixer)
        if isinstance(state, PleLayerState):
            extra, ple_state = ple(cfg, dense, layer, self.rows, state.ple, r, tokens, window=window)
            r = r + extra
            a, inject = hc_read(cfg, dense, prefix, r)
            out, mixer_state = mixer.compute(cfg, dense, layer, state.mixer, a, window=window)
            return hc_write(r, inject, out), PleLayerState(mixer_state, ple_state)
        a, inject = hc_read(cfg, dense, prefix, r)
        out, state = mixer.compute(cfg, dense, layer, state, a, window=window)
        return hc_write(r, inject, out), state

    def ffn_read(self, params, layer: int, r: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
        """h [T, D] and each stream's share of the FFN output, inject [T, hc]."""
        return hc_read(params.cfg, params.dense, TensorNames.block(layer, "hc_ffn"), r)

    def ffn_write(self, r: np.ndarray, carry: np.ndarray, out: np.ndarray) -> np.ndarray:
        return hc_write(r, carry, out)

    def head(self, params, r: np.ndarray, *, last_only: bool = False) -> np.ndarray:
        """The last hyper-connection and the LM head. [T, S] -> [T, vocab] ([1, vocab] with last_only)

        last_only slices the logits, not the streams: a one-row product sums in another order
        than the window's (BLAS), and these prefill logits have been the window's, bit for bit."""
        x, _ = hc_read(params.cfg, params.dense, HC_FINAL, r, inject=False)
        n = TensorNames
        out_w = params.dense[n.token_embd] if params.cfg.tie_embeddings else params.dense[n.output]
        logits = (x @ out_w.T).astype(np.float32)
        return logits[-1:] if last_only else logits


# each residual kind's strategy; `for_params(params, rows, layers)` builds it
RESIDUALS: dict[ResidualKind, type] = {
    ResidualKind.PLAIN: PlainResidual,
    ResidualKind.HYPER_CONNECTIONS: HyperConnections,
}


def residual_for(params, rows: NgramRows | None = None, layers: LayerRange | None = None) -> Residual:
    """The model's residual strategy, by its kind (`ModelConfig.residual`). rows: the PLE row
    source of hyper-connections (default `params.rows`, else the tables held with the dense
    weights). layers: a pipeline stage's range, refused (one line) by a residual that cannot be split."""
    return RESIDUALS[params.cfg.residual].for_params(params, rows, layers)
