"""Twin of strata.reference.residual's `HyperConnections` on MLX ops: the forward of a hyper-connection model
(Qwen4-Exp), every expert resident in one MLX arena.

An ops-level twin: the hyper-connections, the PLE term (mlx_backend/ple.py), the indexed
attention (mlx_backend/indexed_attention.py) and the DeltaNet (mlx_backend/deltanet.py, its input
normed by the hyper-connection) are MLX ops on float32 weights; routing is the model's rule on
the device (`experts_route`, as the resident engine of every family routes) or the reference's on
the host, the routed experts the backend's over the arena, the gated shared expert its
`shared_partials`. Held to the reference within FORWARD.

Shapes: T positions, S = hc_count * D streams, V vocab.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Callable, Mapping

import mlx.core as mx
import numpy as np

from strata.errors import ConfigError
from strata.formats.dense_weights import DenseWeights, StoredTensor, StoredType
from strata.formats.expert_record import RecordLayout, pack_record
from strata.mlx_backend.arena import MlxArena, layer_record
from strata.mlx_backend.deltanet import DeltaNetWeights, deltanet_partials
from strata.mlx_backend.deltanet import empty_state as empty_deltanet_state
from strata.mlx_backend.experts import SharedWeights, combine, experts_route, routed_partials, shared_partials
from strata.mlx_backend.indexed_attention import IndexedWeights, empty_indexed_state, indexed_attention
from strata.mlx_backend.model import fill_resident_arena, selections_to_slots
from strata.mlx_backend.ple import PleWeights, empty_ple_state, grouped_rms_norm, ple
from strata.model_config import Mixer, ModelConfig, TensorNames
from strata.families.qwen4_exp import HC_FINAL, Qwen4Names, ple_layers
from strata.reference.experts import expert_act
from strata.reference.model import ExpertSource, ModelState, check_token_ids, router_rules
from strata.reference.ngram_rows import NgramRows
from strata.reference.ple import PleLayerState
from strata.reference.routing import RouterRule, route

__all__ = ["HyperMlxParams", "HyperConnections", "to_hyper_params", "empty_hyper_state", "hyper_forward", "hc_read",
           "hc_write"]


@dataclass(frozen=True, eq=False)
class HcWeights:
    """float32. Shapes: norm [S], down [r, S], up [S, r], inject [hc, S] or None (before the head)"""

    norm: mx.array
    down: mx.array
    up: mx.array
    inject: mx.array | None


@dataclass(frozen=True, eq=False)
class HyperLayer:
    hc_attn: HcWeights
    hc_ffn: HcWeights
    mixer: DeltaNetWeights | IndexedWeights
    ple: PleWeights | None
    router: mx.array  # float32 [E, D]
    shared: SharedWeights
    rule: RouterRule


@dataclass(frozen=True, eq=False)
class HyperMlxParams:
    cfg: ModelConfig
    layers: tuple[HyperLayer, ...]
    embed: mx.array  # [V, D]
    output: mx.array  # [V, D]
    hc_out: HcWeights
    arena: MlxArena | None  # every expert (slot m*E + e); None when experts stream (hyper_compute.py)
    rec: RecordLayout | None
    layer_recs: tuple[RecordLayout, ...] | None = None  # each MoE layer's, where a file's layers differ


def _hc(get, prefix: str, inject: bool = True) -> HcWeights:
    q = Qwen4Names
    return HcWeights(get(q.hc(prefix, q.hc_norm)), get(q.hc(prefix, q.hc_down)), get(q.hc(prefix, q.hc_up)),
                     get(q.hc(prefix, q.hc_inject)) if inject else None)


def _float32(dense: Mapping[str, np.ndarray], name: str) -> mx.array:
    """One dense tensor as float32 on the device. An F16 tensor crosses as its stored 2 bytes a
    weight and is widened there (exact, as the host's astype): the 48-layer synthetic's 13 GB of
    float32 were the longest part of opening an engine (widened on the host, then copied)."""
    held = dense.stored(name) if isinstance(dense, DenseWeights) else dense[name]
    if isinstance(held, StoredTensor) and held.qtype is StoredType.F16:
        out = mx.array(held.codes).astype(mx.float32)
        mx.eval(out)  # now, so the float16 copy is freed tensor by tensor
        return out
    return mx.array(np.asarray(dense[name], np.float32))


def _deltanet_weights(b) -> DeltaNetWeights:
    n = TensorNames
    w_in = mx.concatenate([b(n.ssm_qkv), b(n.ssm_z), b(n.ssm_beta), b(n.ssm_alpha)])
    return DeltaNetWeights(None, w_in, b(n.ssm_conv), b(n.ssm_a), b(n.ssm_dt_bias), b(n.ssm_norm), b(n.ssm_out))


def _indexed_weights(b) -> IndexedWeights:
    n, q = TensorNames, Qwen4Names
    return IndexedWeights(b(n.attn_q), b(n.attn_gate), b(n.attn_k), b(n.attn_v), b(n.attn_output),
                          b(n.attn_q_norm), b(n.attn_k_norm), b(q.idx_qk), b(q.idx_q_norm), b(q.idx_k_norm))


def _deltanet(cfg: ModelConfig, w: DeltaNetWeights, state, a: mx.array, *, window: bool):
    parts, state = deltanet_partials(cfg, w, state, a, window=window)
    return parts[:, 0], state


def _indexed(cfg: ModelConfig, w: IndexedWeights, state, a: mx.array, *, window: bool):
    return indexed_attention(cfg, w, state, a)


@dataclass(frozen=True)
class HyperMixer:
    """A mixer inside a hyper-connection: weights(b) from the layer's float32 tensors by suffix;
    empty_state(cfg); compute(cfg, weights, state, a, *, window) -> (out [T, D], state), a the
    hyper-connection's block input (it normed it)."""

    weights: Callable
    empty_state: Callable
    compute: Callable


# the hyper-connection model's mixers (families/qwen4_exp.py: its layers are these two kinds)
HYPER_MIXERS: dict[Mixer, HyperMixer] = {
    Mixer.DELTANET: HyperMixer(_deltanet_weights, empty_deltanet_state, _deltanet),
    Mixer.INDEXED_ATTENTION: HyperMixer(_indexed_weights, empty_indexed_state, _indexed),
}


def hyper_mixer_for(kind: Mixer, layer: int | None = None) -> HyperMixer:
    """The table's entry, or a ConfigError naming the kind (the family's check refuses it first)."""
    if kind not in HYPER_MIXERS:
        where = f" (layer {layer})" if layer is not None else ""
        raise ConfigError(f"MLX backend: mixer {kind.value}{where} has no twin inside a hyper-connection model")
    return HYPER_MIXERS[kind]


def _layer(cfg: ModelConfig, dense: Mapping[str, np.ndarray], layer: int, rule: RouterRule) -> HyperLayer:
    n, q = TensorNames, Qwen4Names
    get = lambda name: _float32(dense, name)  # noqa: E731
    b = lambda s: get(n.block(layer, s))  # noqa: E731
    mixer = hyper_mixer_for(cfg.kinds[layer].mixer, layer).weights(b)
    ple_w = None
    if layer in ple_layers(cfg):
        ple_w = PleWeights(b(q.ple_key), b(q.ple_value), b(q.ple_key_norm), b(q.ple_query_norm), b(q.ple_conv_norm),
                           b(q.ple_conv))
    shared = SharedWeights(b(n.shexp_gate), b(n.shexp_up), b(n.shexp_down), b(n.shexp_gate_inp))
    return HyperLayer(_hc(get, n.block(layer, "hc_attn")), _hc(get, n.block(layer, "hc_ffn")), mixer, ple_w,
                      b(n.router), shared, rule)


def to_hyper_params(cfg: ModelConfig, dense: Mapping[str, np.ndarray], experts: ExpertSource | None = None, *,
                    arena: MlxArena | None = None, rec: RecordLayout | None = None,
                    layer_recs: tuple[RecordLayout, ...] | None = None, resident: bool = True) -> HyperMlxParams:
    """MLX weights (float32) from the reference's dense dict, every routed expert in one arena
    (slot m*E + e): packed from `experts`, or an arena already filled (with its record layout, and
    each MoE layer's where they differ: arena.record_layouts);
    resident=False: no experts (they stream through a runtime arena). The n-gram tables stay
    where the row source has them."""
    n = TensorNames
    rules = router_rules(cfg, dense)
    layers = tuple(_layer(cfg, dense, l, rules[cfg.moe_index(l)]) for l in range(cfg.n_layers))
    get = lambda name: _float32(dense, name)  # noqa: E731
    embed_w = get(n.token_embd)
    output = embed_w if cfg.tie_embeddings else get(n.output)
    if arena is None and resident:
        first = experts.expert(0, 0)
        rec = RecordLayout(first.qtype, first.hidden, first.expert_ffn, first.biases is not None)
        arena = MlxArena(cfg.n_moe_layers * cfg.n_experts, rec.padded_bytes)
        fill_resident_arena(arena, cfg, lambda l, e: pack_record(experts.expert(l, e), rec))
    return HyperMlxParams(cfg, layers, embed_w, output, _hc(get, HC_FINAL, inject=False), arena, rec, layer_recs)


def empty_hyper_state(cfg: ModelConfig) -> ModelState:
    """The reference's ModelState with MLX arrays: DeltaNet (+ PLE) or indexed-attention states."""
    def one(layer: int):
        if layer in ple_layers(cfg):  # PLE layers are DeltaNet layers (families/qwen4_exp.py)
            return PleLayerState(empty_deltanet_state(cfg), empty_ple_state(cfg, layer))
        return hyper_mixer_for(cfg.kinds[layer].mixer, layer).empty_state(cfg)
    return ModelState(tuple(one(l) for l in range(cfg.n_layers)))


def hc_read(cfg: ModelConfig, w: HcWeights, streams: mx.array) -> tuple[mx.array, mx.array | None]:
    """Twin of reference `hc_read`. streams [T, S] -> (input [T, D], inject [T, hc] or None)"""
    hc, d, t = cfg.qwen4.hc_count, cfg.hidden_size, streams.shape[0]
    normed = grouped_rms_norm(streams, w.norm, d, cfg.rms_norm_eps)
    low = normed @ w.down.T / hc
    mix = mx.sigmoid((low * mx.sigmoid(low)) @ w.up.T)
    block_input = (mix * normed).reshape(t, hc, d).mean(axis=1)
    if w.inject is None:
        return block_input, None
    return block_input, 2.0 * mx.sigmoid(normed @ w.inject.T / hc)


def hc_write(streams: mx.array, inject: mx.array, out: mx.array) -> mx.array:
    """Twin of reference `hc_write`. streams [T, S], inject [T, hc], out [T, D] -> [T, S]"""
    t, hc = inject.shape
    return streams + (inject[:, :, None] * out[:, None, :]).reshape(t, -1)


class HyperConnections:
    """Twin of reference/residual.py's `HyperConnections` (the same steps, MLX ops over
    HyperMlxParams). rows: the PLE layers' n-gram row source."""

    def __init__(self, rows: NgramRows) -> None:
        self.rows = rows

    def expand(self, p: HyperMlxParams, x: mx.array, tokens: np.ndarray) -> mx.array:
        return mx.concatenate([x] * p.cfg.qwen4.hc_count, axis=1)  # [T, S]

    def mixer_block(self, p: HyperMlxParams, layer: int, state, r: mx.array, tokens: np.ndarray, *,
                    window: bool):
        """The PLE term (on PLE layers) and the mixer with its hyper-connection. [T, S] -> ([T, S], state)"""
        cfg, lw = p.cfg, p.layers[layer]
        mixer = hyper_mixer_for(cfg.kinds[layer].mixer, layer)
        if isinstance(state, PleLayerState):
            extra, ple_state = ple(cfg, lw.ple, layer, self.rows, state.ple, r, tokens, window=window)
            r = r + extra
            a, inject = hc_read(cfg, lw.hc_attn, r)
            out, mixer_state = mixer.compute(cfg, lw.mixer, state.mixer, a, window=window)
            return hc_write(r, inject, out), PleLayerState(mixer_state, ple_state)
        a, inject = hc_read(cfg, lw.hc_attn, r)
        out, state = mixer.compute(cfg, lw.mixer, state, a, window=window)
        return hc_write(r, inject, out), state

    def ffn_read(self, p: HyperMlxParams, layer: int, r: mx.array) -> tuple[mx.array, mx.array]:
        """h [T, D] and each stream's share of the FFN output, inject [T, hc]."""
        return hc_read(p.cfg, p.layers[layer].hc_ffn, r)

    def ffn_write(self, r: mx.array, carry: mx.array, out: mx.array) -> mx.array:
        return hc_write(r, carry, out)

    def head(self, p: HyperMlxParams, r: mx.array) -> mx.array:
        """The last hyper-connection and the LM head. [T, S] -> float32 [T, V]"""
        final, _ = hc_read(p.cfg, p.hc_out, r)
        return final @ p.output.T


def hyper_forward(p: HyperMlxParams, state: ModelState, tokens, rows: NgramRows, *, window: bool = False,
                  device_routing: bool = True) -> tuple[mx.array, ModelState]:
    """Twin of reference `forward` with hyper-connections and the model's own routing: on the device (no host
    round trip per layer), or device_routing=False on the host by the reference's `route`.

    Shapes: tokens [T] -> (logits float32 [T, V], state)"""
    cfg, residual = p.cfg, HyperConnections(rows)
    tokens = np.asarray(tokens, np.int64).reshape(-1)
    check_token_ids(tokens, cfg.vocab_size)
    streams = residual.expand(p, p.embed[mx.array(tokens.astype(np.int32))], tokens)  # [T, S]
    new_layers = list(state.layers)
    act = expert_act(cfg)
    for layer in range(cfg.n_layers):
        lw = p.layers[layer]
        streams, new_layers[layer] = residual.mixer_block(p, layer, state.layers[layer], streams, tokens,
                                                          window=window)
        h, inject = residual.ffn_read(p, layer, streams)
        z = h @ lw.router.T  # [T, E]
        base = cfg.moe_index(layer) * cfg.n_experts
        rec = layer_record(p.rec, p.layer_recs, cfg.moe_index(layer))
        if device_routing:  # the model's rule on the device (selects exactly as the host: ROUTING)
            routed, shared = experts_route(p.arena.array, rec, h, z, base, lw.rule, lw.shared, act)
        else:  # one host round trip: the reference's rule decides
            zh = np.array(z)
            slots, weights = selections_to_slots([route(zh[t], lw.rule) for t in range(len(zh))],
                                                 cfg.n_experts_per_token, base)
            routed, shared = routed_partials(p.arena.array, rec, h, slots, weights, act=act), shared_partials(
                h, lw.shared)
        moe = combine(mx.zeros_like(h), routed, shared, h, lw.shared.gate_inp)
        streams = residual.ffn_write(streams, inject, moe)
    return residual.head(p, streams), ModelState(tuple(new_layers))
