"""The decoder forward pass (pure numpy): `forward(params, state, tokens) -> (logits, state)`.

Each layer: x += attention(rms_norm(x)); h = rms_norm(x) is the router input; the router picks
k experts per token (SPEC §3, through `select`); x += sum_i w_i expert_i(h) + shared(h).
The layer pieces are public so the streaming runtime and the analysis tools compose the same
math with their own routing and residency, instead of keeping a second copy of it.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Callable, Mapping, Protocol

import numpy as np

from strata.formats.expert_record import ExpertWeights
from strata.model_config import ModelConfig, TensorNames
from strata.reference.attention import LayerKV, attention, rms_norm
from strata.reference.experts import routed_experts, shared_expert
from strata.reference.routing import RouterRule, Selection, route, router_logits


class ExpertSource(Protocol):
    """Anything that hands out a routed expert's weights: the all-resident store, an arena."""

    def expert(self, layer: int, expert: int) -> ExpertWeights: ...


@dataclass(frozen=True, eq=False)
class ModelParams:
    cfg: ModelConfig
    dense: Mapping[str, np.ndarray]  # float32, names and shapes from model_config.dense_tensor_shapes
    experts: ExpertSource


@dataclass(frozen=True)
class ModelState:
    """The KV cache of every layer; `length` positions have been processed."""

    layers: tuple[LayerKV, ...]

    @staticmethod
    def empty(cfg: ModelConfig) -> "ModelState":
        return ModelState(tuple(LayerKV.empty(cfg) for _ in range(cfg.n_layers)))

    @property
    def length(self) -> int:
        return self.layers[0].length if self.layers else 0


# (layer, router logits z [E] of one token) -> the selection for that token
SelectFn = Callable[[int, np.ndarray], Selection]


def router_rule(cfg: ModelConfig) -> RouterRule:
    return RouterRule(k=cfg.n_experts_per_token, order=cfg.routing_order, norm_topk_prob=cfg.norm_topk_prob)


def plain_select(cfg: ModelConfig) -> SelectFn:
    """The model's own routing rule (λ = 0)."""
    rule = router_rule(cfg)
    return lambda layer, z: route(z, rule)


def check_token_ids(tokens: np.ndarray, vocab: int) -> None:
    """Every id in [0, vocab), else a ValueError naming the range (every backend's embedding)."""
    if tokens.size and (tokens.min() < 0 or tokens.max() >= vocab):
        raise ValueError(f"token ids must be in [0, {vocab}), got {tokens.min()}..{tokens.max()}")


def embed(params: ModelParams, tokens: np.ndarray) -> np.ndarray:
    """Shapes: tokens [T] int -> [T, D] float32"""
    tokens = np.asarray(tokens, dtype=np.int64)
    check_token_ids(tokens, params.cfg.vocab_size)
    return params.dense[TensorNames.token_embd][tokens].astype(np.float32)


def attention_block(params: ModelParams, layer: int, kv: LayerKV, x: np.ndarray) -> tuple[np.ndarray, LayerKV]:
    """x + attention(rms_norm(x)). Shapes: x [T, D] -> ([T, D], LayerKV)"""
    n = TensorNames
    h = rms_norm(x, params.dense[n.block(layer, n.attn_norm)], params.cfg.rms_norm_eps)
    out, kv = attention(params.cfg, params.dense, layer, kv, h)
    return x + out, kv


def router_input(params: ModelParams, layer: int, x: np.ndarray) -> np.ndarray:
    """The FFN input h = rms_norm(x): what the router and the experts see. [T, D] -> [T, D]"""
    n = TensorNames
    return rms_norm(x, params.dense[n.block(layer, n.ffn_norm)], params.cfg.rms_norm_eps)


def layer_router_logits(params: ModelParams, layer: int, h: np.ndarray) -> np.ndarray:
    """z = W_router(layer) · h in float32. [T, D] -> [T, E]"""
    return router_logits(params.dense[TensorNames.block(layer, TensorNames.router)], h)


def shared_output(params: ModelParams, layer: int, h: np.ndarray) -> np.ndarray:
    """The shared expert's output (zeros when the model has none). [T, D] -> [T, D]"""
    cfg, n = params.cfg, TensorNames
    if not cfg.has_shared_expert:
        return np.zeros_like(h)
    w = lambda s: params.dense[n.block(layer, s)]  # noqa: E731
    gate_inp = w(n.shexp_gate_inp) if cfg.shared_expert_gated else None
    return shared_expert(w(n.shexp_gate), w(n.shexp_up), w(n.shexp_down), gate_inp, h)


def moe_output(params: ModelParams, layer: int, h: np.ndarray, selections: list[Selection]) -> np.ndarray:
    """Routed experts (per token, its own selection) plus the shared expert. [T, D] -> [T, D]"""
    routed = np.stack([
        routed_experts([params.experts.expert(layer, int(e)) for e in sel.experts], sel.weights, h[t])
        for t, sel in enumerate(selections)
    ])
    return routed + shared_output(params, layer, h)


def head(params: ModelParams, x: np.ndarray) -> np.ndarray:
    """Final norm and LM head. [T, D] -> [T, vocab]"""
    n = TensorNames
    x = rms_norm(x, params.dense[n.output_norm], params.cfg.rms_norm_eps)
    out_w = params.dense[n.token_embd] if params.cfg.tie_embeddings else params.dense[n.output]
    return (x @ out_w.T).astype(np.float32)


@dataclass(frozen=True)
class ForwardTrace:
    """What the router saw and chose. router_inputs: [L, T, D]; selections[l][t]."""

    router_inputs: np.ndarray
    selections: tuple[tuple[Selection, ...], ...] = field(repr=False)


def forward(
    params: ModelParams,
    state: ModelState,
    tokens: np.ndarray,
    *,
    select: SelectFn | None = None,
    trace: bool = False,
) -> tuple[np.ndarray, ModelState] | tuple[np.ndarray, ModelState, ForwardTrace]:
    """Process `tokens` after the `state.length` cached positions.

    `select` turns one token's router logits into its selection (default: the model's own rule).
    Tokens are routed one at a time in order, so a residency-dependent `select` sees the same
    sequence of calls as decoding would.

    Shapes:
        tokens: [T] -> logits [T, vocab] float32
    """
    cfg = params.cfg
    select = select or plain_select(cfg)
    x = embed(params, tokens)
    new_layers, inputs, all_sel = [], [], []
    for layer in range(cfg.n_layers):
        x, kv = attention_block(params, layer, state.layers[layer], x)
        new_layers.append(kv)
        h = router_input(params, layer, x)
        z = layer_router_logits(params, layer, h)  # [T, E]
        selections = [select(layer, z[t]) for t in range(len(z))]
        x = x + moe_output(params, layer, h, selections)
        if trace:
            inputs.append(h)
            all_sel.append(tuple(selections))
    logits = head(params, x)
    new_state = ModelState(tuple(new_layers))
    if trace:
        return logits, new_state, ForwardTrace(np.stack(inputs), tuple(all_sel))
    return logits, new_state
