"""SwiGLU experts (pure numpy): routed experts on quantized weights, the shared expert on dense.

Routed expert:  y = down( silu(gate·x) * (up·x) )            (SPEC §4)
Shared expert:  the same SwiGLU on dense weights, times sigmoid(w_gate_inp · x) when gated.
"""

from __future__ import annotations

from typing import Sequence

import numpy as np

from strata.formats.expert_record import ExpertWeights
from strata.reference.quants import gemv


def silu(x: np.ndarray) -> np.ndarray:
    x = np.asarray(x, dtype=np.float32)
    return x / (np.float32(1.0) + np.exp(-x))


def sigmoid(x: np.ndarray) -> np.ndarray:
    return np.float32(1.0) / (np.float32(1.0) + np.exp(-np.asarray(x, dtype=np.float32)))


def swiglu_expert(w: ExpertWeights, x: np.ndarray) -> np.ndarray:
    """One routed expert on its stored (quantized) weights.

    Shapes:
        x: [D] or [T, D] -> [D] or [T, D]
    """
    hidden = silu(gemv(w.gate, x)) * gemv(w.up, x)  # [.., F]
    return gemv(w.down, hidden)


def routed_experts(experts: Sequence[ExpertWeights], weights: np.ndarray, x: np.ndarray) -> np.ndarray:
    """Sum over the selected experts of weight_i * expert_i(x), in rank order, for one token.

    Shapes:
        weights: [k]; x: [D] -> [D]
    """
    out = np.zeros(x.shape[-1], dtype=np.float32)
    for w, weight in zip(experts, np.asarray(weights, dtype=np.float32)):
        out += weight * swiglu_expert(w, x)
    return out


def dense_swiglu(gate: np.ndarray, up: np.ndarray, down: np.ndarray, x: np.ndarray) -> np.ndarray:
    """down(silu(gate·x) * (up·x)) on dense float weights: a dense FFN layer, an ungated shared expert.

    Shapes:
        gate, up: [F, D]; down: [D, F]; x: [D] or [T, D] -> like x
    """
    x = np.asarray(x, dtype=np.float32)
    return (silu(x @ gate.T) * (x @ up.T)) @ down.T


def shared_expert(
    gate: np.ndarray, up: np.ndarray, down: np.ndarray, gate_inp: np.ndarray | None, x: np.ndarray
) -> np.ndarray:
    """The shared expert on dense float weights, gated by sigmoid(gate_inp · x) when gate_inp is given.

    Shapes:
        gate, up: [Fs, D]; down: [D, Fs]; gate_inp: [D] or None; x: [D] or [T, D] -> like x
    """
    x = np.asarray(x, dtype=np.float32)
    y = dense_swiglu(gate, up, down, x)
    if gate_inp is not None:
        y = y * sigmoid(x @ gate_inp)[..., None]
    return y
