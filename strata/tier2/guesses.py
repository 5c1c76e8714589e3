"""Read-ahead scores from a MoE block's own gate module (the next layer's router on this
layer's router input, design §1), for the families mlx-lm runs.

mlx-lm's MoE blocks call their gate on the same normed hidden state their switch layer takes,
so the next block's gate applied to this block's input is the guess. The gate is found by name
on the block (`gate`, `router`): a linear layer (quantized or not) gives logits; a gate module of
its own with a `weight` [E, D] (DeepSeek-V3's MoEGate, Bailing's) gives `x @ weight.T`; one that
wraps one linear layer (Step 3.5's `gate`, Hunyuan's `wg`) gives that. A selection bias beside
it (`e_score_correction_bias`, `expert_bias`, `router_bias`) ranks by sigmoid(logits) + bias, as
those families select. A guess
only decides what is read early, never what is computed, so a family whose gate is none of these
runs without read-ahead (the report says so).
"""

from __future__ import annotations

from typing import Callable

import mlx.core as mx
import mlx.nn as nn
import numpy as np

__all__ = ["gate_scorer", "GATE_NAMES", "BIAS_NAMES"]

GATE_NAMES = ("gate", "router")
BIAS_NAMES = ("e_score_correction_bias", "expert_bias", "router_bias")

Scorer = Callable[[mx.array], np.ndarray]


def _in_dims(linear) -> int:
    """A linear layer's input width (a quantized one packs 32 // bits codes per uint32)."""
    if isinstance(linear, nn.QuantizedLinear):
        return linear.weight.shape[-1] * 32 // linear.bits
    return linear.weight.shape[-1]


def _linear_logits(gate, input_dims: int) -> Callable[[mx.array], mx.array] | None:
    """The gate's logits as a function of the switch layer's input, or None where the gate is of
    another form or reads another width (Nemotron-H's latent experts take a projection of it)."""
    if isinstance(gate, (nn.Linear, nn.QuantizedLinear)):
        return (lambda x: gate(x).astype(mx.float32)) if _in_dims(gate) == input_dims else None
    weight = gate.get("weight") if isinstance(gate, nn.Module) else None
    if isinstance(weight, mx.array) and weight.ndim == 2:
        if weight.shape[-1] != input_dims:
            return None
        return lambda x: x.astype(mx.float32) @ weight.astype(mx.float32).T
    if isinstance(gate, nn.Module):  # a gate module around one linear layer (Step 3.5's `gate`, Hunyuan's `wg`)
        inner = [c for c in gate.children().values() if isinstance(c, (nn.Linear, nn.QuantizedLinear))]
        if len(inner) == 1 and _in_dims(inner[0]) == input_dims:
            return lambda x: inner[0](x).astype(mx.float32)
    return None


def _bias(*modules) -> mx.array | None:
    for m in modules:
        for name in BIAS_NAMES:
            b = m.get(name) if isinstance(m, nn.Module) else None
            if isinstance(b, mx.array):
                return b
    return None


def gate_scorer(block: nn.Module, n_experts: int, input_dims: int) -> Scorer | None:
    """scores(x [..., D]) -> float32 [T, E] on the host, larger = more likely selected, for x as
    the switch layer takes it (`input_dims` wide); None where the block's gate is not one of the
    known forms or reads another width.

    Shapes:
        x: [B, L, D] (or [T, D]) -> [B*L, E]
    """
    for name in GATE_NAMES:
        gate = block.get(name) if isinstance(block, nn.Module) else None
        if gate is None:
            continue
        logits = _linear_logits(gate, input_dims)
        if logits is None:
            continue
        bias = _bias(gate, block)

        def scores(x: mx.array, logits=logits, bias=bias) -> np.ndarray:
            z = logits(x)
            if bias is not None:
                z = mx.sigmoid(z) + bias.astype(mx.float32)
            return np.array(z, dtype=np.float32).reshape(-1, n_experts)

        return scores
    return None
