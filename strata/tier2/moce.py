"""MoCE on tier 2, where a native module defines the selection score and the family routes in a
gate module the engine can replace.

MoCE (design §2) chooses experts with a bonus on resident ones, so it must act where the family
routes, not at the switch layer (which gets indices already chosen, and whose outputs the MoE
block combines with weights it computed for them). mlx-lm's DeepSeek-style MoE blocks
(`deepseek_v3`, `glm4_moe`, `glm4_moe_lite`: families strata also runs natively, with the
SIGMOID_TOPK rule of strata.reference.routing) call a gate module `MoEGate` that returns
(indices, weights): `MoCEGate` stands in its place and routes each token with that rule, read
from the gate itself (its `e_score_correction_bias`, groups, top-k, normalisation, scaling),
and the run's MoCE policy against the cache's residency of that layer at that moment
(`Streamer.resident_mask`), through the runtime's Selector, as native engines route. Families
that take the top-k inline in the block (qwen3_moe, qwen3_next, mixtral, ...) are refused in
one line: their MoCE is the native path's (`strata convert DIR OUT`). Drop-tail is refused too
(it would need the switch layer to skip entries). With λ = 0 nothing is replaced: mlx-lm's own
gate routes, bit for bit.
"""

from __future__ import annotations

import mlx.core as mx
import mlx.nn as nn
import numpy as np

from strata.errors import ConfigError
from strata.model_config import RoutingOrder
from strata.reference.routing import MoCEPolicy, RouterRule
from strata.runtime.selector import Selector

__all__ = ["MOCE_MODEL_TYPES", "check_moce", "MoCEGate", "moce_gates"]

# the model types whose mlx-lm MoE block routes in a replaceable `gate` module and whose rule
# is a native family's (strata.convert's deepseek / glm_moe modules: SIGMOID_TOPK)
MOCE_MODEL_TYPES = ("deepseek_v3", "glm4_moe", "glm4_moe_lite")
GATE_FIELDS = ("weight", "e_score_correction_bias", "top_k", "n_group", "topk_group", "norm_topk_prob",
               "routed_scaling_factor")


def check_moce(policy: MoCEPolicy, model_type: str | None) -> None:
    """Refuse, in one line, a lossy policy tier 2 cannot run for `model_type` (None: not known
    yet, so any bonus is refused)."""
    if policy.exact:
        return
    if policy.drop_tail_weight != 0.0:
        raise ConfigError("MoCE drop-tail is not run on tier 2 (mlx-lm's switch layer computes every selected "
                          "expert); run with --moce-drop-tail 0, or on the native path (`strata convert DIR OUT`)")
    if model_type not in MOCE_MODEL_TYPES:
        raise ConfigError(f"MoCE on tier 2 runs only where mlx-lm routes in a gate module strata replaces and a native "
                          f"rule defines the score ({', '.join(MOCE_MODEL_TYPES)}); {model_type or 'this model'} "
                          "routes inside its MoE block: run with --moce-lambda 0, or for a native family "
                          "`strata convert DIR OUT` and MoCE there")


def gate_rule(gate: nn.Module) -> RouterRule:
    """strata's SIGMOID_TOPK rule with one layer's parameters, read from mlx-lm's MoEGate."""
    missing = list(GATE_FIELDS) if gate is None else [f for f in GATE_FIELDS if getattr(gate, f, None) is None]
    if missing:
        raise ConfigError(f"MoCE on tier 2: this gate ({type(gate).__name__}) has no {', '.join(missing)}: not the "
                          "DeepSeek-style gate it replaces; run with --moce-lambda 0")
    rule = RouterRule(int(gate.top_k), RoutingOrder.SIGMOID_TOPK, bool(gate.norm_topk_prob), int(gate.n_group),
                      int(gate.topk_group), float(gate.routed_scaling_factor))
    return rule.for_layer(np.array(gate.e_score_correction_bias.astype(mx.float32)))


class MoCEGate(nn.Module):
    """Stands where MoE layer `moe_index`'s MoEGate stood: called with x [..., D], returns
    (indices int32 [..., k], weights float32 [..., k]) chosen by the Selector with the cache's
    residency of that layer now. `observer(m, z, resident, selections)`, where set, sees each call."""

    def __init__(self, gate: nn.Module, moe_index: int, selector: Selector, streamer) -> None:
        super().__init__()
        self.gate = gate
        self.moe_index = moe_index
        self._selector, self._streamer = selector, streamer
        self.observer = None

    def __call__(self, x: mx.array) -> tuple[mx.array, mx.array]:
        """Shapes: x [..., D] -> ([..., k], [..., k])"""
        m = self.moe_index
        # the logits as mlx-lm's gate forms them (the model's dtype), then float32 as it ranks them
        z = np.array((x @ self.gate.weight.T).astype(mx.float32)).reshape(-1, self.gate.weight.shape[0])  # [T, E]
        resident = self._streamer.resident_mask(m)
        selections = self._selector.select(m, z, resident)
        if self.observer is not None:
            self.observer(m, z, resident, selections)
        lead = tuple(x.shape[:-1])
        inds = np.stack([s.experts for s in selections]).astype(np.int32).reshape(*lead, -1)
        weights = np.stack([s.weights for s in selections]).astype(np.float32).reshape(*lead, -1)
        return mx.array(inds), mx.array(weights)


def moce_gates(model, policy: MoCEPolicy, streamer) -> list[MoCEGate]:
    """One MoCEGate per MoE layer of the tier-2 `model` (its blocks' `gate` modules), routing with
    `policy` through one Selector."""
    check_moce(policy, model.cfg.model_type)
    gates = model.gates  # the family's own, whatever an engine installed since
    rules = tuple(gate_rule(g) for g in gates)  # a layer with no gate module: refused there
    selector = Selector.for_rules(rules, policy, tuple(range(len(gates))))
    return [MoCEGate(g, m, selector, streamer) for m, g in enumerate(gates)]
