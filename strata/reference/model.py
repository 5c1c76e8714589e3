"""The decoder forward pass (pure numpy): `forward(params, state, tokens) -> (logits, state)`.

Each layer is a mixer and an FFN of the kinds `ModelConfig.kinds` names, dispatched in one loop:
x += mixer(rms_norm(x)) (attention today: its state is the KV cache); h = rms_norm(x); then for an
MoE layer the router picks k experts per token (design §3, through `select`) and
x += sum_i w_i expert_i(h) + shared(h), for a dense layer x += ffn(h). Routed experts are
addressed by MoE index (`ModelConfig.moe_index`), as the `.experts` file stores them.
The layer pieces are public so the streaming runtime and the analysis tools compose the same
math with their own routing and residency, instead of keeping a second copy of it.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Callable, Mapping, Protocol

import numpy as np

from strata.errors import NonFiniteError
from strata.formats.dense_weights import DenseWeights, as_dense_weights
from strata.formats.expert_record import ExpertWeights
from strata.model_config import Ffn, LayerRange, Mixer, ModelConfig, TensorNames
from strata.reference.attention import LayerKV, attention, rms_norm
from strata.reference.deltanet import DeltaNetState, deltanet, kept_position
from strata.reference.experts import dense_swiglu, expert_act, routed_experts, shared_expert
from strata.reference.mla import LatentKV, mla
from strata.reference.ngram_rows import NgramRows
from strata.reference.routing import RouterRule, Selection, route, router_logits


class ExpertSource(Protocol):
    """Anything that hands out a routed expert's weights: the all-resident store, an arena.
    `layer` is the MoE index (the layer's place among the MoE layers), not the model layer."""

    def expert(self, layer: int, expert: int) -> ExpertWeights: ...


@dataclass(frozen=True, eq=False)
class ModelParams:
    """`dense` is held as stored (F16, BF16, Q8_0 or float32; a plain dict of float32 arrays is
    wrapped): `dense[name]` widens per use to the float32 values the reference computes with,
    `dense.rows(name, ids)` widens only the rows an embedding lookup reads."""

    cfg: ModelConfig
    dense: DenseWeights  # names and shapes from model_config.dense_tensor_shapes
    experts: ExpertSource
    rows: object = None  # a PLE model's n-gram row source (reference.ngram_rows.NgramRows); None: in `dense`

    def __post_init__(self) -> None:
        object.__setattr__(self, "dense", as_dense_weights(self.dense))


# per-layer state, by mixer kind: attention's is its KV cache, DeltaNet's its conv and recurrent
# state, MLA's its compressed latent + rope key cache
LayerState = LayerKV | DeltaNetState | LatentKV


def empty_layer_state(cfg: ModelConfig, layer: int) -> LayerState:
    """The state layer `layer` starts from, chosen by its mixer kind."""
    if cfg.hc_count:  # Qwen4-Exp: DeltaNet (+ its PLE module's) or indexed attention (reference/hyper_model.py)
        from strata.reference.hyper_model import hyper_layer_state

        return hyper_layer_state(cfg, layer)
    mixer = cfg.kinds[layer].mixer
    if mixer is Mixer.ATTENTION:
        return LayerKV.empty(cfg)
    if mixer is Mixer.DELTANET:
        return DeltaNetState.empty(cfg)
    if mixer is Mixer.MLA:
        return LatentKV.empty(cfg)
    if mixer is Mixer.SLIDING_ATTENTION:  # every position kept: the window is a mask (attention.py)
        return LayerKV.empty(cfg)
    raise NotImplementedError(f"no reference state for mixer {mixer.value}")


@dataclass(frozen=True)
class ModelState:
    """Every layer's state (by mixer kind); `length` positions have been processed.

    A pipeline stage holds only its own layers' states: the others are None (another stage
    holds them), and length, trim and kept_position are over the held layers only (an empty
    recurrent layer of another stage would otherwise pin kept_position to 0)."""

    layers: tuple[LayerState | None, ...]

    @staticmethod
    def empty(cfg: ModelConfig, layers: LayerRange | None = None) -> "ModelState":
        """No positions; `layers`: hold only that range's (a pipeline stage's; default all)."""
        held = range(cfg.n_layers) if layers is None else layers.layers
        return ModelState(tuple(empty_layer_state(cfg, l) if l in held else None for l in range(cfg.n_layers)))

    @property
    def held(self) -> tuple[LayerState, ...]:
        """The states this process holds (every layer's, except on a pipeline stage)."""
        return tuple(s for s in self.layers if s is not None)

    @property
    def length(self) -> int:
        held = self.held  # every held layer has processed the same positions
        return held[0].length if held else 0

    def trim(self, n: int) -> "ModelState":
        """The state after the first n positions. Attention layers truncate their KV cache, so
        every n in [0, length] is restorable; a recurrent (DeltaNet) layer restores a kept
        snapshot, and raises where it has none (trim to `kept_position(n)`)."""
        if not 0 <= n <= self.length:
            raise ValueError(f"trim: n must be in [0, {self.length}], got {n}")
        return ModelState(tuple(None if s is None else s.trim(n) for s in self.layers))

    def kept_position(self, n: int) -> int:
        """The largest m <= n every held layer can restore (n itself when none is recurrent)."""
        from strata.reference.ple import PleLayerState  # a PLE module keeps snapshots where its DeltaNet does

        held = tuple(s.mixer if isinstance(s, PleLayerState) else s for s in self.held)
        return kept_position(held, max(0, min(int(n), self.length)))


# (layer, router logits z [E] of one token) -> the selection for that token
SelectFn = Callable[[int, np.ndarray], Selection]


def router_rule(cfg: ModelConfig) -> RouterRule:
    """The model's rule without any layer's selection bias (`router_rules` adds them)."""
    return RouterRule.from_model_config(cfg)


def router_rules(cfg: ModelConfig, dense: Mapping[str, np.ndarray] | None,
                 moe_layers: tuple[int, ...] | None = None) -> tuple[RouterRule, ...]:
    """Each MoE layer's rule, by MoE index: the model's rule, with the layer's selection bias
    when the model has one (`router_bias`; then `dense` must hold it). moe_layers: the model
    layers to give rules for (default every MoE layer; a pipeline stage's own)."""
    rule = router_rule(cfg)
    layers = cfg.moe_layers if moe_layers is None else moe_layers
    if not cfg.router_bias:
        return (rule,) * len(layers)
    if dense is None:
        raise ValueError("router_rules: this model's routers have selection biases; pass the dense weights")
    return tuple(rule.for_layer(dense[TensorNames.block(l, TensorNames.exp_probs_b)]) for l in layers)


def plain_select(cfg: ModelConfig, dense: Mapping[str, np.ndarray] | None = None) -> SelectFn:
    """The model's own routing rule (λ = 0); `dense` for a model with selection biases."""
    rules = router_rules(cfg, dense)
    return lambda layer, z: route(z, rules[layer])


def check_token_ids(tokens: np.ndarray, vocab: int) -> None:
    """Every id in [0, vocab), else a ValueError naming the range (every backend's embedding)."""
    if tokens.size and (tokens.min() < 0 or tokens.max() >= vocab):
        raise ValueError(f"token ids must be in [0, {vocab}), got {tokens.min()}..{tokens.max()}")


def embed(params: ModelParams, tokens: np.ndarray) -> np.ndarray:
    """Shapes: tokens [T] int -> [T, D] float32"""
    tokens = np.asarray(tokens, dtype=np.int64)
    check_token_ids(tokens, params.cfg.vocab_size)
    return params.dense.rows(TensorNames.token_embd, tokens)


def attention_block(params: ModelParams, layer: int, kv: LayerKV, x: np.ndarray) -> tuple[np.ndarray, LayerKV]:
    """x + attention(rms_norm(x)). Shapes: x [T, D] -> ([T, D], LayerKV)"""
    n = TensorNames
    h = rms_norm(x, params.dense[n.block(layer, n.attn_norm)], params.cfg.rms_norm_eps)
    out, kv = attention(params.cfg, params.dense, layer, kv, h)
    return x + out, kv


def mixer_block(params: ModelParams, layer: int, state: LayerState, x: np.ndarray, *,
                window: bool = False) -> tuple[np.ndarray, LayerState]:
    """x + mixer(rms_norm(x)) for the layer's mixer kind. window: these positions are a decode
    window (a recurrent layer keeps a snapshot after each). Shapes: x [T, D] -> ([T, D], state)"""
    mixer = params.cfg.kinds[layer].mixer
    if mixer is Mixer.ATTENTION:
        return attention_block(params, layer, state, x)
    n = TensorNames
    if mixer is Mixer.DELTANET:
        h = rms_norm(x, params.dense[n.block(layer, n.attn_norm)], params.cfg.rms_norm_eps)
        out, state = deltanet(params.cfg, params.dense, layer, state, h, window=window)
        return x + out, state
    if mixer is Mixer.MLA:
        h = rms_norm(x, params.dense[n.block(layer, n.attn_norm)], params.cfg.rms_norm_eps)
        out, state = mla(params.cfg, params.dense, layer, state, h)
        return x + out, state
    if mixer is Mixer.SLIDING_ATTENTION:
        return attention_block(params, layer, state, x)
    raise NotImplementedError(f"no reference mixer {mixer.value}")


def dense_ffn_output(params: ModelParams, layer: int, h: np.ndarray) -> np.ndarray:
    """A dense FFN layer's output: one SwiGLU on dense weights. [T, D] -> [T, D]"""
    n = TensorNames
    b = lambda s: n.block(layer, s)  # noqa: E731
    return dense_swiglu(b(n.ffn_gate), b(n.ffn_up), b(n.ffn_down), h, product=params.dense.linear)


def router_input(params: ModelParams, layer: int, x: np.ndarray) -> np.ndarray:
    """The FFN input h = rms_norm(x): what the router and the experts see. [T, D] -> [T, D]"""
    n = TensorNames
    return rms_norm(x, params.dense[n.block(layer, n.ffn_norm)], params.cfg.rms_norm_eps)


def layer_router_logits(params: ModelParams, layer: int, h: np.ndarray) -> np.ndarray:
    """z = W_router(layer) · h (+ the router's logit bias, gpt-oss) in float32. [T, D] -> [T, E]"""
    z = router_logits(params.dense[TensorNames.block(layer, TensorNames.router)], h)
    if params.cfg.router_logit_bias:
        z = z + params.dense[TensorNames.block(layer, TensorNames.router_logit_bias)]
    return z


def layer_selections(cfg: ModelConfig, select: SelectFn, layer: int, z: np.ndarray) -> list[Selection]:
    """Every position's selection at MoE layer `layer` (a model layer) from its router logits.
    A non-finite logit is refused naming the model layer (the rule sees only the MoE index).

    Shapes: z [T, E] -> T selections."""
    m = cfg.moe_index(layer)
    try:
        return [select(m, z[t]) for t in range(len(z))]
    except NonFiniteError as e:
        raise NonFiniteError(f"layer {layer}: {e}") from None


def shared_output(params: ModelParams, layer: int, h: np.ndarray) -> np.ndarray:
    """The shared expert's output (zeros when the model has none). [T, D] -> [T, D]"""
    cfg, n = params.cfg, TensorNames
    if not cfg.has_shared_expert:
        return np.zeros_like(h)
    b = lambda s: n.block(layer, s)  # noqa: E731
    gate_inp = params.dense[b(n.shexp_gate_inp)] if cfg.shared_expert_gated else None
    return shared_expert(b(n.shexp_gate), b(n.shexp_up), b(n.shexp_down), gate_inp, h, product=params.dense.linear)


def moe_output(params: ModelParams, layer: int, h: np.ndarray, selections: list[Selection]) -> np.ndarray:
    """Routed experts (per token, its own selection) plus the shared expert. [T, D] -> [T, D]"""
    m, act = params.cfg.moe_index(layer), expert_act(params.cfg)
    routed = np.stack([
        routed_experts([params.experts.expert(m, int(e)) for e in sel.experts], sel.weights, h[t], act)
        for t, sel in enumerate(selections)
    ])
    return routed + shared_output(params, layer, h)


def head(params: ModelParams, x: np.ndarray) -> np.ndarray:
    """Final norm and LM head. [T, D] -> [T, vocab]"""
    n = TensorNames
    x = rms_norm(x, params.dense[n.output_norm], params.cfg.rms_norm_eps)
    out = n.token_embd if params.cfg.tie_embeddings else n.output
    return params.dense.linear(out, x).astype(np.float32)


@dataclass(frozen=True)
class ForwardTrace:
    """What the router saw and chose, per MoE layer (L = n_moe_layers). router_inputs: [L, T, D];
    selections[l][t]."""

    router_inputs: np.ndarray
    selections: tuple[tuple[Selection, ...], ...] = field(repr=False)


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

    Shapes:
        tokens: [T] (or float32 [T, D]) -> logits [T, vocab] float32 (or the hidden state [T, D])
    """
    cfg = params.cfg
    select = select or plain_select(cfg, params.dense)
    if cfg.hc_count:  # hyper-connection streams instead of one residual (reference/hyper_model.py)
        from strata.reference.hyper_model import hyper_forward

        return hyper_forward(params, state, tokens, select=select, trace=trace, window=window, layers=layers,
                             rows=rows)
    layers = layers or LayerRange.whole(cfg)
    x = embed(params, tokens) if layers.embeds else np.asarray(tokens, dtype=np.float32)
    held = layers.layers
    new_layers = [s if l in held else None for l, s in enumerate(state.layers)]
    inputs, all_sel = [], []
    for layer in held:
        kind = cfg.kinds[layer]
        if state.layers[layer] is None:
            raise ValueError(f"forward: the state does not hold layer {layer} (another stage's)")
        x, new_layers[layer] = mixer_block(params, layer, state.layers[layer], x, window=window)
        h = router_input(params, layer, x)
        if kind.ffn is Ffn.DENSE:
            x = x + dense_ffn_output(params, layer, h)
            continue
        selections = layer_selections(cfg, select, layer, layer_router_logits(params, layer, h))
        x = x + moe_output(params, layer, h, selections)
        if trace:
            inputs.append(h)
            all_sel.append(tuple(selections))
    logits = head(params, x) if layers.heads else x
    new_state = ModelState(tuple(new_layers))
    if trace:
        return logits, new_state, ForwardTrace(np.stack(inputs), tuple(all_sel))
    return logits, new_state
