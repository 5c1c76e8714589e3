"""The decoder forward on MLX arrays: the twin of strata.reference.model.

Per layer (decode, GPU path) six launches: the QKV projection, attention (q/k norms, RoPE, cache
write), the output projection, the router kernel (residual, router input, logits, guess), the
routed experts with the shared expert's blocks in the same grid (routing on the GPU when every
expert is resident) and combine. The ops path runs the same steps
as MLX ops. Dense matrices are held as the file stores them (mlx_backend/dense.py: F16 as float16,
Q8_0 as its planes; an F32 file's float16 on the kernel path, rounded once: tests use
float16-exact weights so the two agree to float32 reordering, float32 on the ops path); the
router stays float32 (design §3) and the read-ahead guess reads a Q8_0 copy.

Shapes: T positions, D hidden, E experts, V vocab.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Callable, Mapping

import mlx.core as mx
import numpy as np

from strata.formats.dense_weights import as_dense_weights
from strata.formats.expert_record import RecordLayout, pack_record
from strata.formats.quant_types import QuantType
from strata.mlx_backend.arena import MlxArena
from strata.mlx_backend.attention import AttentionWeights, MlxLayerKV
from strata.mlx_backend.deltanet import DeltaNetWeights
from strata.mlx_backend import decode_experts
from strata.mlx_backend.dense import Q8Dense, rows
from strata.mlx_backend.dense import held as held_weight
from strata.mlx_backend.experts import SharedWeights, experts_route, routed_partials, shared_partials
from strata.mlx_backend.indexed_attention import IndexedWeights
from strata.mlx_backend.kernels import embed as embed_kernel
from strata.mlx_backend.kernels.launch import KernelPath, current_path, index_param, index_view
from strata.mlx_backend.mixers import mixer_for
from strata.mlx_backend.mla import MlaWeights, MlxLatentKV
from strata.mlx_backend.quants import MlxQuantMatrix, to_mlx
from strata.mlx_backend.residual import (
    PLAIN, RESIDUALS, HcWeights, HyperLayerWeights, dense_ffn, ffn_input, head, residual_for, router_stage,
)
from strata.model_config import Ffn, ModelConfig, TensorNames
from strata.reference.attention import KVPrecision
from strata.reference.deltanet import DeltaNetState, kept_position
from strata.reference.indexed_attention import IndexedKV
from strata.reference.ngram_rows import NgramRows
from strata.reference.ple import PleLayerState
from strata.reference.experts import expert_act
from strata.reference.model import ExpertSource, ForwardTrace, ModelParams, SelectFn, check_token_ids, router_rule
from strata.reference.quants import quantize
from strata.reference.routing import RouterRule, Selection, route

__all__ = ["LayerWeights", "MlxParams", "MlxModelState", "to_mlx_params", "default_dtype", "embed",
           "attention_block", "router_stage", "head", "forward", "fill_resident_arena"]


def default_dtype() -> mx.Dtype:
    """float16 where kernels run (they read float16 dense weights), float32 on the ops path."""
    return mx.float32 if current_path() is KernelPath.OPS else mx.float16


@dataclass(frozen=True, eq=False)
class LayerWeights:
    """One layer's resident weights. MoE layers: router, guess, shared; dense FFN layers: dense
    (its SwiGLU, in SharedWeights' form without the gate) and no router."""

    attn: AttentionWeights | DeltaNetWeights | MlaWeights | IndexedWeights  # the mixer's weights, by its kind
    ffn_norm: mx.array | None  # [D]; None under hyper-connections (they norm the FFN input)
    router: mx.array | None  # float32 [E, D]
    guess: MlxQuantMatrix | None  # Q8_0 copy of this layer's router (read by the previous MoE layer)
    shared: SharedWeights | None
    dense: SharedWeights | None = None
    rule: RouterRule | None = None  # MoE layers: the model's rule with this layer's selection bias
    router_logit_bias: mx.array | None = None  # float32 [E]: the router's logit bias (gpt-oss)
    hyper: HyperLayerWeights | None = None  # the layer's hyper-connections and PLE module (residual.py)


@dataclass(frozen=True, eq=False)
class MlxParams:
    """Resident weights. `arena` holds every expert (slot l*E + e) for the all-resident engine,
    or is None when experts stream through a runtime arena. The residual's own weights (residual.py):
    out_norm for the plain stream, hc_out (the last hyper-connection) for hyper-connections."""

    cfg: ModelConfig
    layers: tuple[LayerWeights, ...]
    embed: mx.array  # [V, D]
    out_norm: mx.array | None  # [D]
    output: mx.array  # [V, D]
    dtype: mx.Dtype
    arena: MlxArena | None = None
    rec: RecordLayout | None = None
    layer_recs: tuple[RecordLayout, ...] | None = None  # each MoE layer's, where a file's layers differ
    hc_out: HcWeights | None = None

    def rec_of(self, layer: int) -> RecordLayout | None:
        """Model layer `layer`'s record layout (arena.record_layouts)."""
        return self.rec if self.layer_recs is None else self.layer_recs[self.cfg.moe_index(layer)]


@dataclass(frozen=True, eq=False)
class MlxModelState:
    layers: tuple[MlxLayerKV | DeltaNetState | MlxLatentKV, ...]

    @staticmethod
    def empty(cfg: ModelConfig, kv_precision: KVPrecision = KVPrecision.F32) -> "MlxModelState":
        """kv_precision: how the attention layers' caches store keys and values (float16 halves them)."""
        return MlxModelState(tuple(empty_layer_state(cfg, l, kv_precision) for l in range(cfg.n_layers)))

    @property
    def length(self) -> int:
        return self.layers[0].length if self.layers else 0

    def trim(self, n: int) -> "MlxModelState":
        """The first n positions: the same KV buffers with a shorter length (later positions are
        written over), so a compiled step bound to these buffers stays bound. A DeltaNet layer
        restores a kept snapshot (the reference's DeltaNetState.trim)."""
        return MlxModelState(tuple(s.trim(n) if isinstance(s, (DeltaNetState, MlxLatentKV, PleLayerState, IndexedKV))
                                   else MlxLayerKV(s.keys, s.values, n)
                                   for s in self.layers))

    def kept_position(self, n: int) -> int:
        """The largest m <= n every layer can restore (twin of the reference's)."""
        # a PLE module keeps snapshots where its DeltaNet does
        held = tuple(s.mixer if isinstance(s, PleLayerState) else s for s in self.layers)
        return kept_position(held, max(0, min(int(n), self.length)))


def empty_layer_state(cfg: ModelConfig, layer: int, kv_precision: KVPrecision = KVPrecision.F32) -> MlxLayerKV:
    """The state layer `layer` starts from, by its mixer kind (twin of the reference's; mixers.py),
    with what its residual keeps beside it (residual.py: a PLE module's state)."""
    return RESIDUALS[cfg.residual].empty_layer_state(cfg, layer, kv_precision)


def _layer_weights(cfg: ModelConfig, dense: Mapping[str, np.ndarray], layer: int, dtype: mx.Dtype,
                   pred_q8: bool) -> LayerWeights:
    mixer = mixer_for(cfg.kinds[layer].mixer, layer).weights(cfg, dense, layer, dtype)
    return _with_ffn(cfg, dense, layer, dtype, pred_q8, mixer)


def _with_ffn(cfg: ModelConfig, dense: Mapping[str, np.ndarray], layer: int, dtype: mx.Dtype, pred_q8: bool,
              attn) -> LayerWeights:
    n = TensorNames
    get = lambda s: np.asarray(dense[n.block(layer, s)], np.float32)  # noqa: E731
    arr = lambda a: mx.array(a).astype(dtype)  # noqa: E731
    w = lambda s: held_weight(as_dense_weights(dense).stored(n.block(layer, s)), dtype)  # noqa: E731  as stored
    ffn_norm, hyper = RESIDUALS[cfg.residual].layer_weights(cfg, dense, layer, dtype)
    if cfg.kinds[layer].ffn is Ffn.DENSE:
        dense_ffn = SharedWeights(w(n.ffn_gate), w(n.ffn_up), w(n.ffn_down), None)
        return LayerWeights(attn, ffn_norm, None, None, None, dense_ffn, hyper=hyper)
    shared = None
    if cfg.has_shared_expert:
        gi = arr(get(n.shexp_gate_inp)) if cfg.shared_expert_gated else None
        shared = SharedWeights(w(n.shexp_gate), w(n.shexp_up), w(n.shexp_down), gi)
    router = get(n.router)
    guess = to_mlx(quantize(QuantType.Q8_0, router)) if pred_q8 else None
    rule = router_rule(cfg).for_layer(get(n.exp_probs_b) if cfg.sigmoid.router_bias else None)
    bias = mx.array(get(n.router_logit_bias)) if cfg.gpt_oss.router_logit_bias else None
    return LayerWeights(attn, ffn_norm, mx.array(router), guess, shared, rule=rule, router_logit_bias=bias,
                        hyper=hyper)


def to_mlx_params(cfg: ModelConfig, dense: Mapping[str, np.ndarray], *, experts: ExpertSource | None = None,
                  dtype: mx.Dtype | None = None, pred_q8: bool = True) -> MlxParams:
    """MLX weights from the reference's dense weights (as stored: `dense.stored(name)`; a plain
    dict of float32 arrays is held as float32 was). With `experts`, every routed
    expert is packed into a resident MLX arena (slot m*E + e, m the MoE index). dtype: the float
    type of the kernels' path (default `default_dtype`, or float32 where the residual runs MLX ops)."""
    residual = RESIDUALS[cfg.residual]
    dtype = dtype or residual.dtype(default_dtype())
    n = TensorNames
    layers = tuple(_layer_weights(cfg, dense, l, dtype, pred_q8) for l in range(cfg.n_layers))
    stored = as_dense_weights(dense).stored
    embed_w = held_weight(stored(n.token_embd), dtype)
    output = embed_w if cfg.tie_embeddings else held_weight(stored(n.output), dtype)
    out_norm, hc_out = residual.head_weights(cfg, dense, dtype)
    arena = rec = None
    if experts is not None:
        first = experts.expert(0, 0)
        g, u, d = first.qtypes
        rec = RecordLayout(g, first.hidden, first.expert_ffn, first.biases is not None, up_qtype=u, down_qtype=d)
        arena = MlxArena(cfg.n_moe_layers * cfg.n_experts, rec.padded_bytes)
        fill_resident_arena(arena, cfg, lambda l, e: pack_record(experts.expert(l, e), rec))
    mx.eval(*_flat(_head_arrays(embed_w, output, out_norm, hc_out) + [a for lw in layers for a in _arrays(lw)]))
    return MlxParams(cfg, layers, embed_w, out_norm, output, dtype, arena, rec, hc_out=hc_out)


def _head_arrays(embed_w, output, out_norm, hc_out: HcWeights | None) -> list:
    return [a for a in [embed_w, output, out_norm] if a is not None] + (hc_out.arrays() if hc_out is not None else [])


def _arrays(lw: LayerWeights) -> list:
    """The layer's weights (mx.array, or Q8Dense: a stored Q8_0 matrix)."""
    a = lw.attn
    if isinstance(a, (DeltaNetWeights, MlaWeights, IndexedWeights)):
        out = a.arrays() + [x for x in (lw.ffn_norm, lw.router) if x is not None]
    else:
        out = [a.norm, a.wqkv, a.wo, lw.ffn_norm] + [x for x in (a.bqkv, a.q_norm, a.k_norm, lw.router, a.sinks, a.bo,
                                                                 lw.router_logit_bias) if x is not None]
    for sw in (lw.shared, lw.dense):
        if sw is not None:
            out += [sw.gate, sw.up, sw.down] + ([sw.gate_inp] if sw.gate_inp is not None else [])
    if lw.hyper is not None:
        out += lw.hyper.arrays()
    if lw.guess is not None:
        out += [lw.guess.w, lw.guess.codes, lw.guess.raw_scales] + [x for x in (lw.guess.scales, lw.guess.biases)
                                                                   if x is not None]
    return out


def _flat(weights: list) -> list[mx.array]:
    return [a for w in weights for a in (w.arrays() if isinstance(w, Q8Dense) else [w])]


def holds_q8_dense(p: MlxParams) -> bool:
    """Whether any dense matrix is held as Q8_0 planes (a Q8_0 model file: mlx_backend/dense.py)."""
    return any(isinstance(w, Q8Dense) for w in [p.embed, p.output] + [w for lw in p.layers for w in _arrays(lw)])


def dense_weights(p: MlxParams) -> list:
    """Every dense weight (an mx.array, or a Q8Dense: a stored Q8_0 matrix), each once (every
    layer's, the embedding, the head — a tied head is the embedding itself — and the Q8_0
    read-ahead copies of the routers)."""
    seen, out = set(), []
    for w in _head_arrays(p.embed, p.output, p.out_norm, p.hc_out) + [w for lw in p.layers for w in _arrays(lw)]:
        if id(w) not in seen:
            seen.add(id(w))
            out.append(w)
    return out


def dense_arrays(p: MlxParams) -> list[mx.array]:
    """Every dense weight's arrays, each once (`dense_weights`, a Q8_0 matrix as its planes)."""
    seen, out = set(), []
    for a in _flat(dense_weights(p)):
        if id(a) not in seen:
            seen.add(id(a))
            out.append(a)
    return out


def dense_nbytes(p: MlxParams) -> int:
    """The bytes MLX holds for the dense weights (`dense_arrays`): what a plan wires besides its experts."""
    return sum(int(a.nbytes) for a in dense_arrays(p))


def fill_resident_arena(arena: MlxArena, cfg: ModelConfig, record: Callable[[int, int], bytes | np.ndarray]) -> None:
    """Slot m*E + e <- record(m, e) for every expert of every MoE layer (m: the MoE index)."""
    for m in range(cfg.n_moe_layers):
        for e in range(cfg.n_experts):
            arena.fill(m * cfg.n_experts + e, record(m, e))


# ---------------------------------------------------------------- layer pieces (twins of reference.model)


def embed(p: MlxParams, tokens) -> mx.array:
    """Twin of reference `embed`. tokens [T] -> float32 [T, D]

    One decode token's id is a view into the device index table (no host write: see
    kernels/launch.py); a prompt's ids come from the host."""
    tokens = np.asarray(tokens, np.int64).reshape(-1)
    check_token_ids(tokens, p.cfg.vocab_size)
    one = tokens.size == 1
    if _embed_kernel_ok(p) and tokens.size:
        ids = index_param(int(tokens[0])) if one else tokens.astype(np.int32)
        return embed_kernel.embed_rows(p.embed, ids, tokens.size)
    return rows(p.embed, index_view(int(tokens[0])) if one else mx.array(tokens.astype(np.int32)))


def _embed_kernel_ok(p: MlxParams) -> bool:
    return current_path() is not KernelPath.OPS and p.embed.dtype == mx.float16


def embed_token(p: MlxParams, ids: mx.array) -> mx.array:
    """One decode token whose id is already on the device: element 0 of `ids` (int32, e.g.
    `index_param(token)`). No range check (the id is not on the host): the caller checks it.
    Same launches and values as `embed(p, [token])`. ids int32 [>= 1] -> float32 [1, D]"""
    if _embed_kernel_ok(p):
        return embed_kernel.embed_rows(p.embed, ids, 1)
    return rows(p.embed, ids[:1])


def attention_block(p: MlxParams, layer: int, kv: MlxLayerKV, x: mx.array) -> tuple[mx.array, MlxLayerKV]:
    """Twin of reference `attention_block`: x + attention(rms_norm(x)). [T, D] -> ([T, D], kv)"""
    parts, kv = mixer_partials(p, layer, kv, x)
    return x + parts.sum(axis=1), kv


def mixer_partials(p: MlxParams, layer: int, state: MlxLayerKV, x: mx.array, *, pos: mx.array | None = None,
                   window: bool = False) -> tuple[mx.array, MlxLayerKV]:
    """The layer's mixer (by kind: mixers.py) as partials of its output, and its new state. window: a
    decode window (a recurrent layer keeps a snapshot per position). Shapes: x [T, D] -> parts [T, P, D]"""
    mixer = mixer_for(p.cfg.kinds[layer].mixer, layer)
    return mixer.partials(p.cfg, p.layers[layer].attn, state, x, pos=pos, window=window)


def layer_forward(p: MlxParams, layer: int, kv: MlxLayerKV, x, select: SelectFn | None = None,
                  trace: list | None = None, *, pos: mx.array | None = None, window: bool = False,
                  residual=PLAIN, tokens: np.ndarray | None = None) -> tuple[mx.array, MlxLayerKV]:
    """One decoder layer over all-resident experts. select None: the model's own rule on the
    GPU (no host round trip); else one host round trip for the router logits. pos: kv.length on
    the device (attention_partials; kernel path only). residual: how the layer reads and writes
    x (residual.py; tokens: the positions' ids, which a PLE term reads)."""
    cfg, lw = p.cfg, p.layers[layer]
    if p.arena is None:
        raise ValueError("layer_forward needs resident experts (MlxParams.arena); streaming goes through MlxCompute")
    rec = p.rec_of(layer) if lw.dense is None else p.rec
    experts_on_device = residual.fuses_residual and select is None and lw.dense is None and decode_experts.applies(
        rec, lw.rule, lw.shared, expert_act(cfg), x.shape[0])
    # an MoE layer's attention and router in one launch where they can (residual.py)
    mixed, kv = residual.mixer_block(p, layer, kv, x, tokens, pos=pos, window=window, fuse_router=lw.dense is None,
                                     hand_on=experts_on_device)
    h, z, _, carry = residual.ffn_read(p, layer, mixed)
    if lw.dense is not None:  # a dense FFN layer: no router, no experts
        return dense_ffn(p, layer, carry, h), kv
    m = cfg.moe_index(layer)
    base = m * cfg.n_experts
    if experts_on_device:
        return decode_experts.routed_residual(p.arena.array, rec, carry, h, z, base, lw.rule, lw.shared), kv
    if select is None:
        routed, shared = experts_route(p.arena.array, rec, h, z, base, lw.rule, lw.shared, expert_act(cfg))
    else:
        shared = shared_partials(h, lw.shared) if lw.shared is not None else None
        zh = np.array(z)
        sels = [select(m, zh[t]) for t in range(zh.shape[0])]
        slots, weights = selections_to_slots(sels, cfg.n_experts_per_token, base)
        routed = routed_partials(p.arena.array, rec, h, slots, weights, act=expert_act(cfg))
        if trace is not None:
            trace.append((np.array(h), tuple(sels)))
    return residual.ffn_write(p, layer, carry, routed, shared, h), kv


def selections_to_slots(sels: list[Selection], k: int, base: int) -> tuple[np.ndarray, np.ndarray]:
    """Selections -> slots int32 [T, k] (base + expert; -1 where a selection is shorter) and weights."""
    slots = np.full((len(sels), k), -1, np.int32)
    weights = np.zeros((len(sels), k), np.float32)
    for t, s in enumerate(sels):
        n = len(s.experts)
        slots[t, :n] = base + s.experts
        weights[t, :n] = s.weights
    return slots, weights


def forward(p: MlxParams, state: MlxModelState, tokens, *, select: SelectFn | None = None, trace: bool = False,
            eval_every: int = 0, window: bool = False, rows: NgramRows | None = None):
    """Twin of reference `forward`: process `tokens` after the cached positions, the residual
    stream by the model's strategy (residual.py; rows: the PLE row source hyper-connections read).

    select None (and no trace): routing on the device by the model's rule. A `select` (or trace)
    routes each token on the host, like the reference. eval_every: layers per asynchronous
    evaluation on the GPU kernel path (0: none until the caller evaluates; kernel_plan.KernelPlan
    says why that is the default).

    Shapes:
        tokens: [T] -> logits float32 [T, V] (mx.array)
    """
    if trace and select is None:  # the model's rule per MoE layer (each with its selection bias)
        rules = [p.layers[l].rule for l in p.cfg.moe_layers]
        select = lambda m, z: route(z, rules[m])  # noqa: E731
    residual = residual_for(p.cfg, rows)
    tokens = np.asarray(tokens, np.int64).reshape(-1)
    x = residual.expand(p, embed(p, tokens), tokens)
    records = [] if trace else None
    every = eval_every if current_path() is KernelPath.GPU else 0
    logits, new_state = _layers_and_head(p, state, x, select, records, every, window=window, residual=residual,
                                         tokens=tokens)
    if trace:
        return logits, new_state, ForwardTrace(np.stack([r[0] for r in records]), tuple(r[1] for r in records))
    return logits, new_state


def _layers_and_head(p: MlxParams, state: MlxModelState, x: mx.array, select: SelectFn | None, records: list | None,
                     every: int, pos: mx.array | None = None, *, window: bool = False, residual=PLAIN,
                     tokens: np.ndarray | None = None) -> tuple[mx.array, MlxModelState]:
    layers, n = [], p.cfg.n_layers
    for layer in range(n):
        x, kv = layer_forward(p, layer, state.layers[layer], x, select, records, pos=pos, window=window,
                              residual=residual, tokens=tokens)
        layers.append(kv)
        if every and (layer + 1) % every == 0:
            mx.async_eval(x)
    return residual.head(p, x), MlxModelState(tuple(layers))


def decode_device(p: MlxParams, state: MlxModelState, ids: mx.array, pos: mx.array) -> tuple[mx.array, MlxModelState]:
    """`forward(p, state, [token], eval_every=0)` with the token id and the position already on
    the device (ids: element 0 is the token, pos: element 0 is state.length; int32 index views),
    routing on the device: the body compiled.py traces, where nothing may be a per-call Python
    int and no evaluation may start (mx.async_eval raises inside mx.compile). Kernel path only
    (the ops attention slices by the Python length). The caller checks the id's range and the
    context (the returned state's lengths are the trace's, +1).

    Shapes:
        ids int32 [>= 1], pos int32 [>= 1] -> logits float32 [1, V]
    """
    return _layers_and_head(p, state, embed_token(p, ids), None, None, 0, pos)


def from_reference(params: ModelParams, *, dtype: mx.Dtype | None = None) -> MlxParams:
    """MlxParams (experts resident) from the reference's ModelParams."""
    return to_mlx_params(params.cfg, params.dense, experts=params.experts, dtype=dtype)


__all__ += ["layer_forward", "selections_to_slots", "from_reference", "embed_token", "decode_device", "mixer_partials",
            "ffn_input", "dense_ffn", "empty_layer_state", "dense_weights", "dense_arrays", "dense_nbytes",
            "holds_q8_dense"]
_ = field  # dataclasses.field kept for frozen defaults above
