"""How the runtime asks the reference for selections and read-ahead guesses.

Selections come from `strata.reference.routing.route` with the run's MoCE policy and the
cache's residency. Guesses are the experts of `route` with the rule "top-K" (no policy): the K
largest logits, ties to the lower index. `top_k_experts` is that ranking's twin (held to `route`
by tests/runtime/test_runtime_selector.py): a partition instead of route's full sort of E logits plus
the combine weights and Selection a guess never uses (~35 µs -> ~6 µs at E = 256, K = 16). One
`LogitRange` per layer feeds the RANGE form of the bonus (updated with each token's logits
before routing that token).
"""

from __future__ import annotations

import numpy as np

from strata.cache.types import Use
from strata.errors import NonFiniteError
from strata.model_config import ModelConfig, RoutingOrder
from strata.reference.routing import (
    BonusScale, LogitRange, MoCEPolicy, RouterRule, Selection, check_policy_for_rule, route,
    update_logit_range,
)

__all__ = ["Selector", "top_k_experts", "union_in_rank_order", "slots_for"]


class Selector:
    """Routing per MoE layer (`layer` arguments are MoE indices: one logit range each)."""

    def __init__(self, cfg: ModelConfig, policy: MoCEPolicy, rules: tuple[RouterRule, ...] | None = None,
                 moe_layers: tuple[int, ...] | None = None) -> None:
        """rules: one per MoE layer of `moe_layers` (a sigmoid rule carries its layer's selection
        bias: `reference.model.router_rules`); None: the model's rule, the same for every layer.
        moe_layers: the model layers routed here (default every MoE layer; a pipeline stage's own)."""
        rule = RouterRule.from_model_config(cfg)
        # MoE index -> model layer (errors name the model layer); a pipeline stage's local ones
        layers = cfg.moe_layers if moe_layers is None else moe_layers
        self._setup(rule, rules if rules is not None else (rule,) * len(layers), layers, policy)

    @classmethod
    def for_rules(cls, rules: tuple[RouterRule, ...], policy: MoCEPolicy,
                  moe_layers: tuple[int, ...]) -> "Selector":
        """A Selector over one rule per MoE layer given as they are, with no ModelConfig (tier 2
        reads each layer's rule from the family's own gate module: strata.tier2.moce)."""
        self = cls.__new__(cls)
        self._setup(rules[0], tuple(rules), tuple(moe_layers), policy)
        return self

    def _setup(self, rule: RouterRule, rules: tuple[RouterRule, ...], moe_layers: tuple[int, ...],
               policy: MoCEPolicy) -> None:
        self.rule = rule
        self.moe_layers = moe_layers
        self.rules = rules
        if len(self.rules) != len(self.moe_layers):
            raise ValueError(f"Selector: {len(self.rules)} rules for {len(self.moe_layers)} MoE layers")
        check_policy_for_rule(policy, self.rule)
        self.policy = policy
        self.ranges = [LogitRange() for _ in self.moe_layers]
        self._uses_range = policy.bonus_scale is BonusScale.RANGE

    def select(self, layer: int, logits: np.ndarray, resident: np.ndarray) -> list[Selection]:
        """One selection per token, in order, against one residency mask.

        Shapes:
            logits: float32 [T, E];  resident: bool [E]  ->  T Selections
        """
        out = []
        for z in logits:
            rng = None
            if self._uses_range:
                self.ranges[layer] = update_logit_range(self.ranges[layer], self.rules[layer].range_scores(z))
                rng = self.ranges[layer].average
            try:
                out.append(route(z, self.rules[layer], self.policy, resident, rng))
            except NonFiniteError as e:  # route checks anyway: naming the layer costs nothing
                raise NonFiniteError(f"layer {self.moe_layers[layer]}: {e}") from None
        return out

    def guesses(self, logits: np.ndarray, k: int, layer: int | None = None) -> tuple[int, ...]:
        """The top-k guesses from guess logits for MoE layer `layer`, ranked by that layer's
        rule (`RouterRule.guess_scores`: z itself for softmax rules, so `layer` may be None);
        for several tokens, ranked by their mean logits.

        Shapes:
            logits: float32 [T, E] -> k expert ids, best first
        """
        if k <= 0:
            return ()
        z = logits[0] if len(logits) == 1 else logits.mean(axis=0, dtype=np.float32)  # [E]
        if self.rule.order is RoutingOrder.SIGMOID_TOPK:
            if layer is None:
                raise ValueError("Selector.guesses: a sigmoid rule ranks by its layer's bias; name the layer")
            z = self.rules[layer].guess_scores(z)
        return top_k_experts(z, min(k, z.shape[-1]))


def top_k_experts(logits: np.ndarray, k: int) -> tuple[int, ...]:
    """`tuple(route(logits, RouterRule(k, ...)).experts)`: the k largest logits, best first, equal
    logits -> lower expert index first (routing's tie rule). Non-finite logits raise as route does.

    Shapes:
        logits: float32 [E] -> k expert ids
    """
    if k <= 0:
        return ()
    z = np.asarray(logits, dtype=np.float32)
    if z.ndim != 1 or k > z.size or not np.isfinite(z).all():
        return tuple(int(e) for e in route(z, RouterRule(max(k, 1), RoutingOrder.SOFTMAX_TOPK)).experts)
    kth = np.partition(z, z.size - k)[z.size - k]  # the k-th largest value
    cand = np.flatnonzero(z >= kth)  # [>= k] ascending index: every expert that can rank in the top k
    order = np.argsort(-z[cand], kind="stable")[:k]  # z descending; the stable sort keeps index order on ties
    return tuple(cand[order].tolist())


def union_in_rank_order(selections: list[Selection]) -> tuple[int, ...]:
    """Every expert the tokens selected, once, in order of first appearance (token, then rank)."""
    seen: dict[int, None] = {}
    for sel in selections:
        for e in sel.experts.tolist():
            seen.setdefault(e, None)
    return tuple(seen)


def slots_for(selections: list[Selection], use: Use) -> tuple[np.ndarray, np.ndarray]:
    """Each token's selected experts as arena slots (-1: not in this pass, or none), in rank
    order, with their combine weights.

    Shapes:
        -> slots int64 [T, k], weights float32 [T, k]   (k = the longest selection)
    """
    where = dict(zip(use.experts, use.slots))
    k = max((len(sel.experts) for sel in selections), default=0)
    if len(selections) == 1 and len(selections[0].experts) == k:  # decode: one row, no per-item numpy writes
        sel = selections[0]
        row = [where.get(e, -1) for e in sel.experts.tolist()]
        slots = np.array([row], np.int64).reshape(1, k)
        weights = np.where(slots >= 0, sel.weights.astype(np.float32, copy=False), np.float32(0))
        return slots, weights
    slots = np.full((len(selections), k), -1, np.int64)
    weights = np.zeros((len(selections), k), np.float32)
    for t, sel in enumerate(selections):
        for r, (e, w) in enumerate(zip(sel.experts.tolist(), sel.weights)):
            if e in where:
                slots[t, r] = where[e]
                weights[t, r] = w
    return slots, weights
