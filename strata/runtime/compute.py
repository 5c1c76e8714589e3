"""The per-layer compute seam: what the streaming loop asks a backend to do.

`LayerCompute` is the protocol a backend implements (numpy here; MLX plugs in the same way).
Arrays on the host are numpy; "Tensor" values (hidden states, partial outputs) may be the
backend's own lazy arrays — the loop only passes them back. The loop needs three things on the
host: router logits, guess logits (to decide reads) and the final logits.

`NumpyCompute` composes the reference layer pieces (strata.reference.model) in the reference's
order with the reference's float32 ops, so at λ = 0 it reproduces `ReferenceEngine`'s logits
exactly: routed experts are computed per token on its [D] row and summed in rank order, like
`routed_experts`; a prompt layer that needs several passes (its expert union did not fit)
keeps each (token, rank) term and sums them in rank order once all passes are done.
"""

from __future__ import annotations

from typing import Any, Protocol, Sequence

import numpy as np

from strata.formats.expert_record import ExpertWeights, RecordLayout, unpack_record
from strata.formats.quant_types import QuantType
from strata.model_config import TensorNames
from strata.reference import model as ref
from strata.reference.attention import LayerKV
from strata.reference.experts import swiglu_expert
from strata.reference.quants import dequantize, quantize
from strata.runtime.arena import Arena

__all__ = ["LayerCompute", "NumpyCompute", "RoutedPart"]

Tensor = Any  # a backend's array: numpy here, mx.array in the MLX backend


class LayerCompute(Protocol):
    """Per-layer math over resident dense weights and arena slots.

    Shapes (T positions, D hidden, E experts, k slots per position, V vocab):
        embed: tokens [T] -> x [T, D]
        attention: x [T, D] -> x [T, D]  (appends T positions to the layer's own KV cache)
        router_input: x -> h [T, D]
        router_logits: h -> float32 [T, E] numpy (host)
        guess_logits: h (this layer's) -> float32 [T, E] numpy for `layer` (= next layer)
        shared: h -> [T, D] (zeros without a shared expert)
        routed: h, slots int [T, k] (-1: skip), weights float32 [T, k] -> a partial output
        combine: x, partials (one per pass), shared -> x + (routed + shared)
        head: x -> float32 [T, V] numpy (host)
    """

    @property
    def length(self) -> int:
        """Positions in the KV cache."""

    def embed(self, tokens: np.ndarray) -> Tensor: ...

    def attention(self, layer: int, x: Tensor) -> Tensor: ...

    def router_input(self, layer: int, x: Tensor) -> Tensor: ...

    def router_logits(self, layer: int, h: Tensor) -> np.ndarray: ...

    def guess_logits(self, layer: int, h: Tensor) -> np.ndarray: ...

    def shared(self, layer: int, h: Tensor) -> Tensor: ...

    def routed(self, layer: int, h: Tensor, slots: np.ndarray, weights: np.ndarray) -> Tensor: ...

    def _weights(self, slot: int) -> ExpertWeights:
        w = self._slot_weights.get(slot)
        if w is None:
            w = self._slot_weights[slot] = unpack_record(self.arena.slot_buffer(slot), self.layout)
        return w

    def combine(self, x: Tensor, parts: Sequence[Tensor], shared: Tensor) -> Tensor: ...

    def head(self, x: Tensor) -> np.ndarray: ...


class RoutedPart:
    """The numpy backend's partial routed output: weight_i * expert_i(h_t) per (t, rank)."""

    __slots__ = ("terms",)

    def __init__(self) -> None:
        self.terms: dict[tuple[int, int], np.ndarray] = {}


class NumpyCompute:
    """LayerCompute on the numpy reference pieces; experts are read from arena slots."""

    # `routed` returns when the experts are computed: the loop's hand-off point (where the
    # split turn's read-ahead is issued) is before it, not after (strata.runtime.decode).
    synchronous = True

    def __init__(self, params: ref.ModelParams, arena: Arena, layout: RecordLayout, *, pred_q8: bool = True) -> None:
        self.params, self.arena, self.layout = params, arena, layout
        cfg = params.cfg
        self.kv = [LayerKV.empty(cfg) for _ in range(cfg.n_layers)]
        routers = [params.dense[TensorNames.block(l, TensorNames.router)] for l in range(cfg.n_layers)]
        # pred_q8: the guess GEMV reads a Q8_0 copy of each router (seed §2.2: -92 MB/token of
        # F32 reads on the GPU); the guess only chooses what to read ahead, never the math.
        # numpy has no Q8_0 GEMV, so the copy is kept dequantized: the same values `gemv` would
        # use (x @ dequantize(q).T), without dequantizing E x D weights per layer per token.
        self.guess_routers = [dequantize(quantize(QuantType.Q8_0, w)) for w in routers] if pred_q8 else routers
        # A slot's ExpertWeights are views of its buffer (unpack_record is zero-copy), valid
        # whatever record the slot holds: unpacked once per slot, not once per use.
        self._slot_weights: dict[int, ExpertWeights] = {}

    @property
    def length(self) -> int:
        return self.kv[0].length

    def embed(self, tokens: np.ndarray) -> np.ndarray:
        return ref.embed(self.params, tokens)

    def attention(self, layer: int, x: np.ndarray) -> np.ndarray:
        x, self.kv[layer] = ref.attention_block(self.params, layer, self.kv[layer], x)
        return x

    def router_input(self, layer: int, x: np.ndarray) -> np.ndarray:
        return ref.router_input(self.params, layer, x)

    def router_logits(self, layer: int, h: np.ndarray) -> np.ndarray:
        return ref.layer_router_logits(self.params, layer, h)

    def guess_logits(self, layer: int, h: np.ndarray) -> np.ndarray:
        return (h @ self.guess_routers[layer].T).astype(np.float32)

    def shared(self, layer: int, h: np.ndarray) -> np.ndarray:
        return ref.shared_output(self.params, layer, h)

    def routed(self, layer: int, h: np.ndarray, slots: np.ndarray, weights: np.ndarray) -> RoutedPart:
        part = RoutedPart()
        for t, r in zip(*np.nonzero(slots >= 0)):
            w = self._weights(int(slots[t, r]))
            part.terms[(int(t), int(r))] = weights[t, r] * swiglu_expert(w, h[t])  # as routed_experts
        return part

    def _weights(self, slot: int) -> ExpertWeights:
        w = self._slot_weights.get(slot)
        if w is None:
            w = self._slot_weights[slot] = unpack_record(self.arena.slot_buffer(slot), self.layout)
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
