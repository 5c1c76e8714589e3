"""The closed loop shared by every analysis tool: route each (token, layer) with MoCE against the
residency the cache machine holds *now*, then drive the machine with that choice.

Per token: `begin_token()`; per layer l: `route(l, z)` (resident mask from the state -> MoCE
routing -> `AtLayer`), then `after(l, guesses...)` (`AfterLayer` with the ranked read-ahead
guesses for l+1, and l+2 with prefetch2; every read-ahead then lands: `ReadDone`). The routing is
`strata.reference.routing.route` and the cache is `strata.cache.machine.step`: no second copy
of either. `strata replay` feeds it logits from a trace, `strata quality` from the live model.
"""

from __future__ import annotations

import enum
from dataclasses import dataclass, replace

import numpy as np

from strata.errors import ConfigError
from strata.cache.machine import initial_state, step
from strata.cache.types import AfterLayer, AtLayer, BeginWindow, CacheConfig, CacheStats, Read, ReadDone
from strata.reference.routing import (
    BonusScale, LogitRange, MoCEPolicy, RouterRule, Selection, check_policy_for_rule, route,
    update_logit_range,
)

__all__ = ["GuessRanking", "LoopConfig", "ClosedLoop", "GuessRouters", "check_family_routing"]


class GuessRanking(enum.Enum):
    """How the read-ahead ranks its guess logits W_router(l+1)·h(l)."""

    PLAIN = "plain"  # top-K by z (ties -> lower index), as the streaming runtime ranks them
    MOCE = "moce"  # the reference engine's ahead(): the routing policy itself (top-J by z, then z' with the bonus)


class GuessRouters:
    """The routers the read-ahead guess multiplies: float32, or (pred_q8) the Q8_0 copy the
    runtime keeps for its guess GEMV (design §6). `logits` computes one [1, D] row the way the
    runtime does (`x @ W.T`), so the guesses agree bit for bit."""

    def __init__(self, routers, *, pred_q8: bool) -> None:
        if pred_q8:
            from strata.formats.quant_types import QuantType
            from strata.reference.quants import dequantize, quantize

            self.weights = [dequantize(quantize(QuantType.Q8_0, np.asarray(w, np.float32))) for w in routers]
        else:
            self.weights = [np.asarray(w, np.float32) for w in routers]

    def logits(self, layer: int, h: np.ndarray) -> np.ndarray:
        """Shapes: h [D] or [1, D] -> float32 [E]"""
        x = np.asarray(h, np.float32).reshape(1, -1)  # [1, D]
        return (x @ self.weights[layer].T).astype(np.float32)[0]


@dataclass(frozen=True)
class LoopConfig:
    """One closed-loop configuration: the arena and read-ahead (design §6) and the routing policy.
    Defaults are the streaming runtime's (`strata.config.Config`), so a replay and a run agree.

    policy None is the model's own routing (λ = 0). moce_pre: an unclaimed read-ahead (PRE)
    counts as resident for the MoCE bonus (the runtime's `moce_pre`). pred_q8: guesses use the
    Q8_0 copy of the routers. guess: PLAIN top-K (the runtime) or MOCE (the reference engine's `ahead()`).
    The cache machine has no insertion-policy knob, so the reference engine's insertion variants are not
    configurable here (docs/analysis.md says why).
    """

    capacity: int
    prefetch_depth: int = 10
    prefetch_touch: bool = False
    prefetch2: bool = False
    split_turn: bool = True
    pred_q8: bool = True
    policy: MoCEPolicy | None = MoCEPolicy()
    moce_pre: bool = False
    guess: GuessRanking = GuessRanking.PLAIN
    window: int = 1  # positions per decode window (speculative windows: strata.tools.windows)

    @classmethod
    def from_config(cls, config, capacity: int) -> "LoopConfig":
        """The closed loop a `strata.config.Config` runs (its arena given in slots)."""
        return cls(capacity=capacity, prefetch_depth=config.prefetch, prefetch_touch=config.prefetch_touch,
                   prefetch2=config.prefetch2, split_turn=config.split_turn, pred_q8=config.pred_q8,
                   policy=config.moce_policy(), moce_pre=config.moce_pre, window=config.window)

    def __post_init__(self) -> None:
        if self.policy is not None and not isinstance(self.policy, MoCEPolicy):
            raise ConfigError(f"loop config: policy must be a MoCEPolicy or None, got {self.policy!r}")
        if not isinstance(self.guess, GuessRanking):
            raise ConfigError(f"loop config: guess must be a GuessRanking, got {self.guess!r}")

    def cache_config(self, n_layers: int, n_experts: int, top_k: int) -> CacheConfig:
        return CacheConfig(capacity=self.capacity, n_layers=n_layers, n_experts=n_experts, top_k=top_k,
                           prefetch_depth=self.prefetch_depth, prefetch_touch=self.prefetch_touch,
                           prefetch2=self.prefetch2, split_turn=self.split_turn, window=self.window)

    @property
    def label(self) -> str:
        """A short name for tables: 'J3 λ0.85 K10', '+touch', '+2ahead', ..."""
        p = self.policy
        if p is None or p.bonus == 0:
            parts = ["λ0"]
        else:
            unit = "r" if p.bonus_scale is BonusScale.RANGE else ""
            parts = [f"J{p.protect_top_j} λ{p.bonus:g}{unit}"]
            if p.margin is not None:
                parts.append(f"m{p.margin:g}")
        if p is not None and p.drop_tail_weight > 0:
            parts.append(f"drop<{p.drop_tail_weight:g}@{p.drop_tail_min_rank}")
        parts.append(f"K{self.prefetch_depth}" if self.prefetch_depth else "no-prefetch")
        if self.prefetch_depth:
            parts += [s for s, on in (("touch", self.prefetch_touch), ("2ahead", self.prefetch2),
                                      ("moce-guess", self.guess is GuessRanking.MOCE and _has_bonus(p)),
                                      ("f32-guess", not self.pred_q8)) if on]
        if not self.split_turn:
            parts.append("in-turn")
        if self.moce_pre and _has_bonus(p):
            parts.append("pre-bonus")
        if self.window > 1:
            parts.append(f"T<={self.window}")
        return " ".join(parts)

    def to_json(self) -> dict:
        p = self.policy
        return {
            "capacity": self.capacity, "prefetch_depth": self.prefetch_depth,
            "prefetch_touch": self.prefetch_touch, "prefetch2": self.prefetch2, "split_turn": self.split_turn,
            "pred_q8": self.pred_q8, "guess": self.guess.value, "moce_pre": self.moce_pre,
            "J": None if p is None else p.protect_top_j, "lambda": 0.0 if p is None else p.bonus,
            "bonus_scale": None if p is None else p.bonus_scale.value, "margin": None if p is None else p.margin,
            "drop_tail_weight": 0.0 if p is None else p.drop_tail_weight,
            "drop_tail_min_rank": None if p is None else p.drop_tail_min_rank, "window": self.window,
        }


def check_family_routing(config: LoopConfig) -> None:
    """A tier-2 trace replays the family's own routing: refuse, in one line, a policy that would
    change it (MoCE's bonus and drop-tail need a native module's selection score)."""
    p = config.policy
    if p is not None and (p.bonus != 0 or p.drop_tail_weight != 0):
        raise ConfigError(f"{config.label}: this trace records a tier-2 model's own routing (mlx-lm's), which MoCE "
                          "cannot re-route; replay it at --lambda 0 without --drop-tail (a native model's trace "
                          "replays MoCE)")


def _has_bonus(p: MoCEPolicy | None) -> bool:
    return p is not None and p.bonus > 0


class ClosedLoop:
    """Routing against simulated residency, driving the pure cache machine. Mutable (a driver:
    it holds the current `CacheState`; every state it holds came from `step`)."""

    def __init__(self, config: LoopConfig, rule: RouterRule, n_layers: int, n_experts: int,
                 rules: tuple[RouterRule, ...] | None = None) -> None:
        """rules: one per layer (a sigmoid rule carries its layer's selection bias, as the
        runtime's `Selector`); None: `rule` for every layer."""
        check_policy_for_rule(config.policy, rule)
        self.config = config
        self.rule = rule
        self.rules = rules if rules is not None else (rule,) * n_layers
        if len(self.rules) != n_layers:
            raise ValueError(f"ClosedLoop: {len(self.rules)} rules for {n_layers} layers")
        self.n_layers, self.n_experts = n_layers, n_experts
        self.cache = config.cache_config(n_layers, n_experts, rule.k)
        self.state = initial_state(self.cache)
        self.policy = config.policy
        k = config.prefetch_depth
        # the MOCE guess ranks by the layer's own rule (groups, bias) with k = the read-ahead depth
        self._guess_rules = tuple(replace(r, k=min(k, n_experts)) for r in self.rules) if k else None
        moce_guess = config.guess is GuessRanking.MOCE and _has_bonus(config.policy)
        self._guess_policy = replace(config.policy, drop_tail_weight=0.0) if moce_guess else None
        uses_range = config.policy is not None and config.policy.bonus_scale is BonusScale.RANGE
        self._ranges = [LogitRange() for _ in range(n_layers)] if uses_range else None
        # misses by *selected rank*: the machine counts by position in AtLayer.selected, which
        # differs from the rank only after drop-tail removed an earlier rank
        self._rank_fix = np.zeros(self.cache.max_selected, np.int64)
        self.dropped = 0

    # -------------------------------------------------------------- the loop

    def begin_token(self) -> None:
        self.state, _ = step(self.state, BeginWindow())

    def resident(self, layer: int) -> np.ndarray:
        """bool [E]: claimed (RES) experts of `layer`, plus its read-aheads with moce_pre."""
        lo = layer * self.n_experts
        res = self.state.smap[lo:lo + self.n_experts] >= 0
        if self.config.moce_pre:
            res |= self.state.pmap[lo:lo + self.n_experts] >= 0
        return res

    def _logit_range(self, layer: int) -> float | None:
        return None if self._ranges is None else self._ranges[layer].average

    def route(self, layer: int, z: np.ndarray) -> Selection:
        """Route one token's layer-`layer` logits z [E] against the current residency, then take
        the layer's turn (`AtLayer`). Returns the selection the GPU computes."""
        rule = self.rules[layer]
        if self._ranges is not None:  # the spread of what the bonus is added to (the runtime's Selector)
            self._ranges[layer] = update_logit_range(self._ranges[layer], rule.range_scores(z))
        sel = route(z, rule, self.policy, self.resident(layer), self._logit_range(layer))
        self.state, _ = step(self.state, AtLayer(layer, sel.experts.tolist()))
        if len(sel.dropped):
            self.dropped += len(sel.dropped)
            for pos, n in enumerate(self.state.turn.urgent_misses_by_rank):
                if n and pos < len(sel.ranks) and sel.ranks[pos] != pos:
                    self._rank_fix[pos] -= n
                    self._rank_fix[sel.ranks[pos]] += n
        return sel

    def take(self, layer: int, experts) -> None:
        """Take the layer's turn with a selection made elsewhere (a tier-2 trace's family routing,
        or a window's union of them), rank order."""
        self.state, _ = step(self.state, AtLayer(layer, [int(e) for e in experts]))

    def route_window(self, layer: int, zs: np.ndarray) -> list[Selection]:
        """Route every position of a window (logits zs [T, E]) against the residency now, then
        take the layer's one turn with their union (position by position, rank order), as the
        runtime's decode window does. Misses are counted by position in the union, not by rank."""
        sels = []
        for z in zs:
            if self._ranges is not None:
                self._ranges[layer] = update_logit_range(self._ranges[layer], z)
            sels.append(route(z, self.rule, self.policy, self.resident(layer), self._logit_range(layer)))
        union = dict.fromkeys(e for sel in sels for e in sel.experts.tolist())
        self.state, _ = step(self.state, AtLayer(layer, list(union)))
        self.dropped += sum(len(sel.dropped) for sel in sels)
        return sels

    def rank_guesses(self, layer: int, g: np.ndarray | None) -> tuple[int, ...]:
        """The ranked read-ahead guesses for `layer` from guess logits g [E] (empty when there is
        no read-ahead or no such layer). MOCE ranking uses `layer`'s residency now."""
        if g is None or self._guess_rules is None or not 0 <= layer < self.n_layers:
            return ()
        rule = self._guess_rules[layer]
        if self._guess_policy is None:  # the runtime's ranking: the rule's guess scores (z for softmax rules)
            scores = rule.guess_scores(np.asarray(g, np.float32))
            return tuple(np.argsort(-scores, kind="stable")[: rule.k].tolist())
        sel = route(g, rule, self._guess_policy, self.resident(layer), self._logit_range(layer))
        return tuple(sel.experts.tolist())

    def after(self, layer: int, guess: np.ndarray | None = None, guess2: np.ndarray | None = None) -> None:
        """The GPU released `layer`: read ahead from guess logits for layer+1 (and layer+2 with
        prefetch2), then let every read-ahead land before the next layer's turn."""
        g1 = self.rank_guesses(layer + 1, guess)
        g2 = self.rank_guesses(layer + 2, guess2) if self.config.prefetch2 else ()
        self.state, actions = step(self.state, AfterLayer(layer, g1, g2))
        for a in actions:
            if isinstance(a, Read):
                self.state, _ = step(self.state, ReadDone(a.slot, a.ticket))

    # -------------------------------------------------------------- results

    def totals(self) -> CacheStats:
        """The machine's totals with urgent misses counted by selected rank (not position)."""
        t = self.state.totals
        by_rank = tuple(int(a + b) for a, b in zip(t.urgent_misses_by_rank, self._rank_fix))
        return replace(t, urgent_misses_by_rank=by_rank)
