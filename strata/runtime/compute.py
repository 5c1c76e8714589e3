"""The per-layer compute seam: what the streaming loop asks a backend to do.

`LayerCompute` is the protocol a backend implements (strata.numpy_backend.compute,
strata.mlx_backend.compute). Arrays on the host are numpy; "Tensor" values (hidden states,
partial outputs) may be the backend's own lazy arrays — the loop only passes them back. The
loop needs three things on the host: router logits, guess logits (to decide reads) and the
final logits. Layers are model layers; a dense FFN layer is computed whole by `dense_ffn`
(no router, no experts, no cache turn).
"""

from __future__ import annotations

from typing import Any, Protocol, Sequence

import numpy as np

__all__ = ["LayerCompute", "StatefulCompute", "Tensor"]

Tensor = Any  # a backend's array: numpy, or mx.array in the MLX backend


class LayerCompute(Protocol):
    """Per-layer math over resident dense weights and arena slots.

    Shapes (T positions, D hidden, E experts, k slots per position, V vocab):
        embed: tokens [T] -> x [T, D]
        mixer: x [T, D] -> x [T, D]  (the layer's mixer kind; appends T positions to its state;
               window: the positions are a decode window, so a recurrent layer keeps a snapshot at each)
        dense_ffn: x (after the mixer) -> x + ffn(rms_norm(x))  (dense FFN layers)
        router_input: x -> h [T, D]  (MoE layers)
        router_logits: h -> float32 [T, E] numpy (host)
        guess_logits: h (this layer's) -> float32 [T, E] numpy for `layer` (the next MoE layer)
        shared: h -> [T, D] (zeros or None without a shared expert)
        routed: h, slots int [T, k] (-1: skip), weights float32 [T, k] -> a partial output
        combine: x, partials (one per pass), shared -> x + (routed + shared)
        head: x -> float32 [T, V] numpy (host)
        trim: keep the first n positions of every layer's state
        kept_position: the largest m <= n that trim(m) can restore (recurrent layers: a snapshot)
    """

    # True where `routed` returns when the experts are computed (numpy): the loop's hand-off
    # point, where the split turn's read-ahead is issued, is then before it (runtime/decode.py)
    synchronous: bool

    @property
    def length(self) -> int:
        """Positions in the layers' state."""

    def embed(self, tokens: np.ndarray) -> Tensor: ...

    def mixer(self, layer: int, x: Tensor, *, window: bool = False) -> Tensor: ...

    def dense_ffn(self, layer: int, x: Tensor) -> Tensor: ...

    def router_input(self, layer: int, x: Tensor) -> Tensor: ...

    def router_logits(self, layer: int, h: Tensor) -> np.ndarray: ...

    def guess_logits(self, layer: int, h: Tensor) -> np.ndarray: ...

    def shared(self, layer: int, h: Tensor) -> Tensor: ...

    def routed(self, layer: int, h: Tensor, slots: np.ndarray, weights: np.ndarray) -> Tensor: ...

    def combine(self, x: Tensor, parts: Sequence[Tensor], shared: Tensor) -> Tensor: ...

    def head(self, x: Tensor) -> np.ndarray: ...

    def trim(self, n: int) -> None: ...

    def kept_position(self, n: int) -> int: ...


class StatefulCompute:
    """Mixin: a LayerCompute's session part over its `self.state`, a backend's model state
    (`length`, `trim(n)` -> a new state, `kept_position(n)`), which `mixer` replaces per layer."""

    @property
    def length(self) -> int:
        return self.state.length

    def trim(self, n: int) -> None:
        self.state = self.state.trim(n)

    def kept_position(self, n: int) -> int:
        return self.state.kept_position(n)
