"""`NumpyCompute`: the runtime's LayerCompute seam on the numpy reference pieces.

It composes the reference layer pieces (strata.reference.model) in the reference's order with
the reference's float32 ops, so at λ = 0 it reproduces `ReferenceEngine`'s logits exactly:
routed experts are computed once per slot over the rows that chose it (strata.numpy_backend.
grouped, as the reference engine's prompt path does; one row: on its [D] row, like
`routed_experts`) and summed in rank order; a prompt layer that needs several passes (its expert union did not fit)
keeps each (token, rank) term and sums them in rank order once all passes are done.
"""

from __future__ import annotations

import dataclasses
from typing import Callable, Sequence

import numpy as np

from strata.formats.expert_record import ExpertWeights, RecordLayout, unpack_record
from strata.formats.quant_types import QuantType
from strata.model_config import LayerRange, TensorNames
from strata.numpy_backend.grouped import grouped_terms
from strata.numpy_backend.quant_kernels import REFERENCE_OPS, CpuOps
from strata.reference import model as ref
from strata.reference.experts import expert_act
from strata.reference.quants import dequantize, quantize
from strata.runtime.arena import Arena
from strata.runtime.compute import StatefulCompute

__all__ = ["NumpyCompute", "RoutedPart"]


class RoutedPart:
    """The numpy backend's partial routed output: weight_i * expert_i(h_t) per (t, rank)."""

    __slots__ = ("terms",)

    def __init__(self) -> None:
        self.terms: dict[tuple[int, int], np.ndarray] = {}


class NumpyCompute(StatefulCompute):
    """LayerCompute on the numpy reference pieces; experts are read from arena slots."""

    # `routed` returns when the experts are computed: the loop's hand-off point (where the
    # split turn's read-ahead is issued) is before it, not after (strata.runtime.decode).
    synchronous = True

    def __init__(self, params: ref.ModelParams, arena: Arena,
                 layouts: RecordLayout | Callable[[int], RecordLayout], *,
                 pred_q8: bool = True, layers: LayerRange | None = None, ops: CpuOps = REFERENCE_OPS) -> None:
        """layouts: the record layout of every layer's experts, or a function of the (model) layer
        giving each layer its own, where the `.experts` file mixes types (`ExpertsFile.layer_layout`).
        ops: the experts' and the dense products, the float32 reference's or compiled."""
        if isinstance(layouts, RecordLayout):
            one = layouts
            layouts = lambda layer: one  # noqa: E731
        params = dataclasses.replace(params, dense=ops.dense(params.dense))  # its `linear`: the dense products
        self.params, self.arena, self.layouts, self.ops = params, arena, layouts, ops
        cfg = params.cfg
        self.state = ref.ModelState.empty(cfg, layers)  # `layers`: a pipeline stage's (the state it holds)
        names = {l: TensorNames.block(l, TensorNames.router) for l in cfg.moe_layers}
        # the routers this process holds (a pipeline stage loads only its own layers')
        routers = {l: params.dense[r] for l, r in names.items() if r in params.dense}
        # pred_q8: the guess GEMV reads a Q8_0 copy of each router (the reference engine: -92 MB/token of
        # F32 reads on the GPU); the guess only chooses what to read ahead, never the math.
        # numpy has no Q8_0 GEMV, so the copy is kept dequantized: the same values `gemv` would
        # use (x @ dequantize(q).T), without dequantizing E x D weights per layer per token.
        self.guess_routers = {l: dequantize(quantize(QuantType.Q8_0, w)) for l, w in routers.items()} if pred_q8 else routers
        self.guess_biases = ({l: params.dense[TensorNames.block(l, TensorNames.router_logit_bias)] for l in cfg.moe_layers}
                             if cfg.router_logit_bias else {})  # the guess adds the logits' bias too (gpt-oss)
        self.act = expert_act(cfg)
        # A slot's ExpertWeights are views of its buffer (unpack_record is zero-copy), valid
        # whatever record of that layout the slot holds: unpacked once per (slot, layout), not per use.
        self._slot_weights: dict[tuple[int, RecordLayout], ExpertWeights] = {}

    def embed(self, tokens: np.ndarray) -> np.ndarray:
        return ref.embed(self.params, tokens)

    def mixer(self, layer: int, x: np.ndarray, *, window: bool = False) -> np.ndarray:
        layers = list(self.state.layers)
        x, layers[layer] = ref.mixer_block(self.params, layer, layers[layer], x, window=window)
        self.state = ref.ModelState(tuple(layers))
        return x

    def dense_ffn(self, layer: int, x: np.ndarray) -> np.ndarray:
        return x + ref.dense_ffn_output(self.params, layer, ref.router_input(self.params, layer, x))

    def router_input(self, layer: int, x: np.ndarray) -> np.ndarray:
        return ref.router_input(self.params, layer, x)

    def router_logits(self, layer: int, h: np.ndarray) -> np.ndarray:
        return ref.layer_router_logits(self.params, layer, h)

    def guess_logits(self, layer: int, h: np.ndarray) -> np.ndarray:
        g = (h @ self.guess_routers[layer].T).astype(np.float32)
        return g + self.guess_biases[layer] if layer in self.guess_biases else g

    def shared(self, layer: int, h: np.ndarray) -> np.ndarray:
        return ref.shared_output(self.params, layer, h)

    def routed(self, layer: int, h: np.ndarray, slots: np.ndarray, weights: np.ndarray) -> RoutedPart:
        part = RoutedPart()
        layout = self.layouts(layer)
        terms = grouped_terms(h, slots, weights, lambda slot: self._weights(slot, layout), self.act,
                              expert=self.ops.expert, stack=self.ops.stack)  # as prompt_forward
        for t, r in zip(*np.nonzero(slots >= 0)):
            part.terms[(int(t), int(r))] = terms[t, r]
        return part

    def _weights(self, slot: int, layout: RecordLayout) -> ExpertWeights:
        w = self._slot_weights.get((slot, layout))
        if w is None:
            w = self._slot_weights[(slot, layout)] = unpack_record(self.arena.slot_buffer(slot), layout)
        return w

    def combine(self, x: np.ndarray, parts: Sequence[RoutedPart], shared: np.ndarray) -> np.ndarray:
        terms: dict[tuple[int, int], np.ndarray] = {}
        for p in parts:
            terms.update(p.terms)
        rows = []
        for t in range(x.shape[0]):
            out = np.zeros(x.shape[-1], dtype=np.float32)
            for r in sorted(r for (tt, r) in terms if tt == t):
                out += terms[(t, r)]
            rows.append(out)
        routed = np.stack(rows)  # [T, D]
        return x + (routed + shared)

    def head(self, x: np.ndarray) -> np.ndarray:
        return ref.head(self.params, x)
