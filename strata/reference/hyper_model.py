"""The forward pass of a hyper-connection model (Qwen4-Exp), pure numpy: `reference.model.forward`
hands a model with `hc_count > 0` here.

Per layer, on the residual streams X [T, hc * D] (reference/hyper_connections.py):

    X += ple(X, tokens)                        PLE layers only (reference/ple.py; rows from a row source)
    a, inj = hc_read(hc_attn, X);  X = hc_write(X, inj, mixer(a))     DeltaNet or indexed attention
    h, inj = hc_read(hc_ffn, X);   X = hc_write(X, inj, moe(h))       h is what the router sees
    logits = hc_read(hc_output, X) W_head^T    (no final norm: the last hyper-connection norms)

It differs from the other families' loop in the residual (streams instead of x += block(norm(x)))
and the PLE term; the mixers (the hybrid families' gated DeltaNet, unchanged), the router rule,
the routed experts and the gated shared expert are the reference's own pieces.
"""

from __future__ import annotations

import numpy as np

from strata.errors import ConfigError
from strata.families.qwen4_exp import HC_FINAL, Qwen4Names, ple_layers
from strata.model_config import ModelConfig, TensorNames
from strata.reference.hyper_connections import expand_streams, hc_read, hc_write
from strata.reference.layers import ForwardTrace, embed, layer_router_logits, layer_selections
from strata.reference.layers import moe_output as reference_moe_output
from strata.reference.mixers import MixerState, mixer_for
from strata.reference.model_state import ModelState
from strata.reference.ngram_rows import NgramRows, ResidentNgramRows
from strata.reference.ple import PleLayerState, ple

# a hyper-connection model's per-layer state: its mixer's (DeltaNet or indexed attention), or on
# a PLE layer the DeltaNet's and its PLE module's
HyperLayerState = MixerState | PleLayerState


def resident_rows(cfg: ModelConfig, dense) -> ResidentNgramRows:
    """The row source over the n-gram tables held with the dense weights, by PLE index."""
    name = lambda layer: TensorNames.block(layer, Qwen4Names.ple_ngram)  # noqa: E731
    if cfg.ple_row_store:
        raise ConfigError("ple_row_store: this model's n-gram tables are in its row store, not among the dense "
                          "weights; pass the row source (strata.runtime.ngram_source.ple_rows_for)")
    return ResidentNgramRows({i: dense[name(layer)] for i, layer in enumerate(ple_layers(cfg))})


def ple_table_items(cfg: ModelConfig, dense):
    """(PLE index, table [rows, width]) for each PLE layer, in order: what a row store is written from."""
    for i, layer in enumerate(ple_layers(cfg)):
        yield i, dense[TensorNames.block(layer, Qwen4Names.ple_ngram)]


def hyper_mixer(params, layer: int, state: HyperLayerState, streams: np.ndarray, tokens: np.ndarray,
                rows: NgramRows, *, window: bool) -> tuple[np.ndarray, HyperLayerState]:
    """The PLE term (on PLE layers) and the mixer with its hyper-connection. [T, S] -> ([T, S], state)"""
    cfg, dense = params.cfg, params.dense
    prefix = TensorNames.block(layer, "hc_attn")
    mixer = mixer_for(cfg.kinds[layer].mixer)
    if isinstance(state, PleLayerState):
        extra, ple_state = ple(cfg, dense, layer, rows, state.ple, streams, tokens, window=window)
        streams = streams + extra
        a, inject = hc_read(cfg, dense, prefix, streams)
        out, mixer_state = mixer.compute(cfg, dense, layer, state.mixer, a, window=window)
        return hc_write(streams, inject, out), PleLayerState(mixer_state, ple_state)
    a, inject = hc_read(cfg, dense, prefix, streams)
    out, state = mixer.compute(cfg, dense, layer, state, a, window=window)
    return hc_write(streams, inject, out), state


def hyper_head(params, streams: np.ndarray) -> np.ndarray:
    """The last hyper-connection and the LM head. [T, S] -> [T, vocab]"""
    x, _ = hc_read(params.cfg, params.dense, HC_FINAL, streams, inject=False)
    n = TensorNames
    out_w = params.dense[n.token_embd] if params.cfg.tie_embeddings else params.dense[n.output]
    return (x @ out_w.T).astype(np.float32)


def hyper_forward(params, state, tokens: np.ndarray, *, select, trace: bool = False, window: bool = False,
                  layers=None, rows: NgramRows | None = None, moe_output=None):
    """`reference.model.forward` for a hyper-connection model (same arguments and results).

    rows: where the PLE layers' n-gram rows come from (default: `params.rows`, else the tables held
    with the dense weights). moe_output: how an MoE block's output is computed from (params, layer, h,
    selections) (default: the reference's per token; the prompt path passes its grouped one).

    Shapes:
        tokens: [T] -> logits [T, vocab] float32
    """
    cfg = params.cfg
    if layers is not None and (layers.start, layers.stop) != (0, cfg.n_layers):
        raise ConfigError("hc_count: pipeline stages of a hyper-connection model are not supported")
    if rows is None:
        rows = params.rows if params.rows is not None else resident_rows(cfg, params.dense)
    moe_output = moe_output or reference_moe_output
    tokens = np.asarray(tokens, np.int64)
    streams = expand_streams(cfg, embed(params, tokens))  # [T, hc * D]
    new_layers, inputs, all_sel = list(state.layers), [], []
    for layer in range(cfg.n_layers):
        streams, new_layers[layer] = hyper_mixer(params, layer, state.layers[layer], streams, tokens, rows,
                                                 window=window)
        h, inject = hc_read(cfg, params.dense, TensorNames.block(layer, "hc_ffn"), streams)
        selections = layer_selections(cfg, select, layer, layer_router_logits(params, layer, h))
        streams = hc_write(streams, inject, moe_output(params, layer, h, selections))
        if trace:
            inputs.append(h)
            all_sel.append(tuple(selections))
    logits, new_state = hyper_head(params, streams), ModelState(tuple(new_layers))
    if trace:
        return logits, new_state, ForwardTrace(np.stack(inputs), tuple(all_sel))
    return logits, new_state
