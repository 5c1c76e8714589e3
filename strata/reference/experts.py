"""SwiGLU experts (pure numpy): routed experts on quantized weights, the shared expert on dense.

Routed expert:  y = down( silu(gate·x) * (up·x) )            (design §4)
gpt-oss's (ExpertKind.CLAMPED_SWIGLU, with biases b):
    g = min(gate·x + b_g, limit), u = clip(up·x + b_u, -limit, limit)
    y = down( (u + 1) * g * sigmoid(alpha g) ) + b_d
Shared expert:  the same SwiGLU on dense weights, times sigmoid(w_gate_inp · x) when gated.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Callable, Sequence

import numpy as np

from strata.formats.expert_record import ExpertWeights
from strata.model_config import ExpertKind, ModelConfig
from strata.reference.quants import QuantMatrix, gemv


@dataclass(frozen=True)
class ExpertAct:
    """What an expert computes between its projections (the model's `expert_kind` and its knobs)."""

    kind: ExpertKind = ExpertKind.SWIGLU
    alpha: float = 1.702  # CLAMPED_SWIGLU only
    limit: float = 7.0


SWIGLU = ExpertAct()


def expert_act(cfg: ModelConfig) -> ExpertAct:
    if cfg.gpt_oss.expert_kind is ExpertKind.SWIGLU:
        return SWIGLU
    return ExpertAct(cfg.gpt_oss.expert_kind, cfg.gpt_oss.swiglu_alpha, cfg.gpt_oss.swiglu_limit)


def gated_hidden(act: ExpertAct, g: np.ndarray, u: np.ndarray) -> np.ndarray:
    """The expert's hidden activation from its gate and up projections (biases already added).

    Shapes: g, u [.., F] -> [.., F] float32
    """
    if act.kind is ExpertKind.SWIGLU:
        return silu(g) * u
    limit = np.float32(act.limit)
    g = np.minimum(np.asarray(g, np.float32), limit)
    u = np.clip(np.asarray(u, np.float32), -limit, limit)
    return (u + np.float32(1.0)) * (g * sigmoid(g * np.float32(act.alpha)))  # transformers' order


def silu(x: np.ndarray) -> np.ndarray:
    x = np.asarray(x, dtype=np.float32)
    return x / (np.float32(1.0) + np.exp(-x))


def sigmoid(x: np.ndarray) -> np.ndarray:
    return np.float32(1.0) / (np.float32(1.0) + np.exp(-np.asarray(x, dtype=np.float32)))


def swiglu_expert(w: ExpertWeights, x: np.ndarray, act: ExpertAct = SWIGLU, *,
                  matvec: Callable[[QuantMatrix, np.ndarray], np.ndarray] = gemv) -> np.ndarray:
    """One routed expert on its stored (quantized) weights, with its biases if it has them.
    `matvec`: the product W x on a stored matrix (the reference's `gemv`; the numpy engines'
    compiled twin, strata.numpy_backend.quant_kernels, passes its own).

    Shapes:
        x: [D] or [T, D] -> [D] or [T, D]
    """
    g, u = matvec(w.gate, x), matvec(w.up, x)  # [.., F]
    if w.biases is not None:
        g, u = g + w.biases.gate, u + w.biases.up
    y = matvec(w.down, gated_hidden(act, g, u))
    return y if w.biases is None else y + w.biases.down


def routed_experts(experts: Sequence[ExpertWeights], weights: np.ndarray, x: np.ndarray,
                   act: ExpertAct = SWIGLU) -> np.ndarray:
    """Sum over the selected experts of weight_i * expert_i(x), in rank order, for one token.

    Shapes:
        weights: [k]; x: [D] -> [D]
    """
    out = np.zeros(x.shape[-1], dtype=np.float32)
    for w, weight in zip(experts, np.asarray(weights, dtype=np.float32)):
        out += weight * swiglu_expert(w, x, act)
    return out


def times_transpose(w: np.ndarray, x: np.ndarray) -> np.ndarray:
    """x W^T on a float matrix: what a dense SwiGLU's `product` is by default."""
    return x @ w.T


def dense_swiglu(gate, up, down, x: np.ndarray, *, product: Callable = times_transpose) -> np.ndarray:
    """down(silu(gate·x) * (up·x)) on dense float weights: a dense FFN layer, an ungated shared expert.
    `product(w, x)` is x W^T for each of the three; by default they are float arrays, and the
    model passes tensor names with DenseWeights.linear (which the numpy engines may compile).

    Shapes:
        gate, up: [F, D]; down: [D, F]; x: [D] or [T, D] -> like x
    """
    x = np.asarray(x, dtype=np.float32)
    return product(down, silu(product(gate, x)) * product(up, x))


def shared_expert(
    gate, up, down, gate_inp: np.ndarray | None, x: np.ndarray, *, product: Callable = times_transpose
) -> np.ndarray:
    """The shared expert on dense float weights, gated by sigmoid(gate_inp · x) when gate_inp is given
    (`product`: as dense_swiglu's).

    Shapes:
        gate, up: [Fs, D]; down: [D, Fs]; gate_inp: [D] or None; x: [D] or [T, D] -> like x
    """
    x = np.asarray(x, dtype=np.float32)
    y = dense_swiglu(gate, up, down, x, product=product)
    if gate_inp is not None:
        y = y * sigmoid(x @ gate_inp)[..., None]
    return y
