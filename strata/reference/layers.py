"""The pieces a forward pass is composed of, layer by layer (pure numpy).

The forward's loop (model.py) and its residual strategies (residual.py: the plain one is
x += mixer(rms_norm(x)); h = rms_norm(x); x += moe(h) or ffn(h)) call these same pieces; so do the streaming
runtime and the analysis tools, with their own routing and residency, instead of keeping a second
copy of the math. Routed experts are addressed by MoE index (`ModelConfig.moe_index`), as the
`.experts` file stores them.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Callable, Mapping, Protocol

import numpy as np

from strata.errors import NonFiniteError
from strata.formats.dense_weights import DenseWeights, as_dense_weights
from strata.formats.expert_record import ExpertWeights
from strata.model_config import ModelConfig, TensorNames
from strata.reference.attention import LayerKV, attention, rms_norm
from strata.reference.experts import dense_swiglu, expert_act, routed_experts, shared_expert
from strata.reference.mixers import MixerState, mixer_for
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
    if not cfg.sigmoid.router_bias:
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


def mixer_block(params: ModelParams, layer: int, state: MixerState, x: np.ndarray, *,
                window: bool = False) -> tuple[np.ndarray, MixerState]:
    """x + mixer(rms_norm(x)) for the layer's mixer kind (mixers.py). window: these positions are a
    decode window (a recurrent layer keeps a snapshot after each). Shapes: x [T, D] -> ([T, D], state)"""
    n = TensorNames
    h = rms_norm(x, params.dense[n.block(layer, n.attn_norm)], params.cfg.rms_norm_eps)
    out, state = mixer_for(params.cfg.kinds[layer].mixer).compute(params.cfg, params.dense, layer, state, h,
                                                                  window=window)
    return x + out, state


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
    if params.cfg.gpt_oss.router_logit_bias:
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
