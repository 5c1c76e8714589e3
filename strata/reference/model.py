"""The decoder forward pass (pure numpy): `forward(params, state, tokens) -> (logits, state)`.

Each layer is a mixer and an FFN of the kinds `ModelConfig.kinds` names, in one loop over the
residual stream, whose strategy (residual.py) says how a block reads and writes it. For the
plain stream: x += mixer(rms_norm(x)) (the mixer looked up by kind, mixers.py); h = rms_norm(x);
then for an MoE layer the router picks k experts per token (design §3, through `select`) and
x += sum_i w_i expert_i(h) + shared(h), for a dense layer x += ffn(h). Hyper-connections
(Qwen4-Exp) read h and write the block's output through a hyper-connection instead.
The pieces are layers.py's and the state model_state.py's; this module re-exports them, so that
`reference.model` stays the one name the runtime and the tools import the reference through.
"""

from __future__ import annotations

from typing import Callable

import numpy as np

from strata.model_config import Ffn, LayerRange
from strata.reference.layers import (  # noqa: F401  (re-exported)
    ExpertSource, ForwardTrace, ModelParams, SelectFn, attention_block, check_token_ids, dense_ffn_output, embed,
    head, layer_router_logits, layer_selections, mixer_block, moe_output, plain_select, router_input, router_rule,
    router_rules, shared_output,
)
from strata.reference.model_state import LayerState, ModelState, empty_layer_state  # noqa: F401  (re-exported)
from strata.reference.layers import moe_output as reference_moe_output
from strata.reference.ngram_rows import NgramRows
from strata.reference.residual import residual_for

# (params, model layer, h [T, D], T selections) -> the MoE block's output [T, D]
MoeOutputFn = Callable[[ModelParams, int, np.ndarray, list], np.ndarray]


__all__ = ["ExpertSource", "ForwardTrace", "LayerState", "ModelParams", "ModelState", "SelectFn", "attention_block",
           "check_token_ids", "dense_ffn_output", "embed", "empty_layer_state", "forward", "head",
           "layer_router_logits", "layer_selections", "mixer_block", "moe_output", "plain_select", "router_input",
           "router_rule", "router_rules", "shared_output"]


def forward(
    params: ModelParams,
    state: ModelState,
    tokens: np.ndarray,
    *,
    select: SelectFn | None = None,
    trace: bool = False,
    window: bool = False,
    layers: LayerRange | None = None,
    rows: NgramRows | None = None,
    moe_output: MoeOutputFn | None = None,
    last_only: bool = False,
    hidden: bool = False,
) -> tuple[np.ndarray, ModelState] | tuple[np.ndarray, ModelState, ForwardTrace]:
    """Process `tokens` after the `state.length` cached positions.

    `select(moe_layer, z)` turns one token's router logits into its selection (default: the
    model's own rule); its layer argument is the MoE index. Tokens are routed one at a time in
    order, so a residency-dependent `select` sees the same sequence of calls as decoding would.
    `window`: the tokens are a decode window (recurrent layers keep a snapshot at each position).
    `layers`: compute only that range (a pipeline stage; default every layer): a range that does
    not embed takes the hidden state [T, D] as `tokens`, one that does not head returns it, and
    the state returned holds that range's layers only (the others: None, another stage's).
    `rows`: the PLE layers' n-gram row source (Qwen4-Exp; default the tables among the dense weights).
    `moe_output(params, layer, h, selections)`: how an MoE block's output is computed (default the
    reference's, per token; the numpy prompt path passes its grouped one). `last_only`: the head
    on the last position only (a prefill's logits). `hidden`: return the last layer's output
    [T, D] (before the final norm) instead of logits (the MTP drafter's input).

    Shapes:
        tokens: [T] (or float32 [T, D]) -> logits [T, vocab] float32 ([1, vocab] with last_only;
        or the hidden state [T, D])
    """
    cfg = params.cfg
    select = select or plain_select(cfg, params.dense)
    moe_output = moe_output or reference_moe_output
    residual = residual_for(params, rows, layers)  # plain, or hyper-connection streams (residual.py)
    layers = layers or LayerRange.whole(cfg)
    if layers.embeds:
        tokens = np.asarray(tokens, np.int64)
        x = residual.expand(params, embed(params, tokens), tokens)
    else:
        x = np.asarray(tokens, dtype=np.float32)
    held = layers.layers
    new_layers = [s if l in held else None for l, s in enumerate(state.layers)]
    inputs, all_sel = [], []
    for layer in held:
        kind = cfg.kinds[layer]
        if state.layers[layer] is None:
            raise ValueError(f"forward: the state does not hold layer {layer} (another stage's)")
        x, new_layers[layer] = residual.mixer_block(params, layer, state.layers[layer], x, tokens, window=window)
        h, carry = residual.ffn_read(params, layer, x)
        if kind.ffn is Ffn.DENSE:
            x = residual.ffn_write(x, carry, dense_ffn_output(params, layer, h))
            continue
        selections = layer_selections(cfg, select, layer, layer_router_logits(params, layer, h))
        x = residual.ffn_write(x, carry, moe_output(params, layer, h, selections))
        if trace:
            inputs.append(h)
            all_sel.append(tuple(selections))
    logits = residual.head(params, x, last_only=last_only) if layers.heads and not hidden else x
    new_state = ModelState(tuple(new_layers))
    if trace:
        return logits, new_state, ForwardTrace(np.stack(inputs), tuple(all_sel))
    return logits, new_state
