"""How the runtime asks the reference for selections and read-ahead guesses.

The runtime never ranks experts itself: selections come from `strata.reference.routing.route`
with the run's MoCE policy and the cache's residency, and guesses are `route` with the rule
"top-K" (no policy), so ties break exactly as routing's do. One `LogitRange` per layer feeds
the RANGE form of the bonus (updated with each token's logits before routing that token).
"""

from __future__ import annotations

import numpy as np

from strata.model_config import ModelConfig
from strata.reference.routing import (
    BonusScale, LogitRange, MoCEPolicy, RouterRule, Selection, route, update_logit_range,
)

__all__ = ["Selector", "union_in_rank_order"]


class Selector:
    def __init__(self, cfg: ModelConfig, policy: MoCEPolicy) -> None:
        self.rule = RouterRule.from_model_config(cfg)
        self.policy = policy
        self.ranges = [LogitRange() for _ in range(cfg.n_layers)]
        self._uses_range = policy.bonus_scale is BonusScale.RANGE
        self._guess_rules: dict[int, RouterRule] = {}

    def select(self, layer: int, logits: np.ndarray, resident: np.ndarray) -> list[Selection]:
        """One selection per token, in order, against one residency mask.

        Shapes:
            logits: float32 [T, E];  resident: bool [E]  ->  T Selections
        """
        out = []
        for z in logits:
            rng = None
            if self._uses_range:
                self.ranges[layer] = update_logit_range(self.ranges[layer], z)
                rng = self.ranges[layer].average
            out.append(route(z, self.rule, self.policy, resident, rng))
        return out

    def guesses(self, logits: np.ndarray, k: int) -> tuple[int, ...]:
        """The top-k guesses from guess logits; for several tokens, ranked by their mean.

        Shapes:
            logits: float32 [T, E] -> k expert ids, best first
        """
        if k <= 0:
            return ()
        z = logits[0] if len(logits) == 1 else logits.mean(axis=0, dtype=np.float32)  # [E]
        k = min(k, z.shape[-1])
        rule = self._guess_rules.get(k)
        if rule is None:
            rule = self._guess_rules[k] = RouterRule(k, self.rule.order, self.rule.norm_topk_prob)
        return tuple(int(e) for e in route(z, rule).experts)


def union_in_rank_order(selections: list[Selection]) -> tuple[int, ...]:
    """Every expert the tokens selected, once, in order of first appearance (token, then rank)."""
    seen: dict[int, None] = {}
    for sel in selections:
        for e in sel.experts.tolist():
            seen.setdefault(e, None)
    return tuple(seen)
