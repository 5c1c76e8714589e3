"""Reference routing (pure numpy): the model's own top-k rule, and MoCE on top of it (design §3).

The model's rule (`RouterRule`) turns router logits z into k experts and their combine weights.
MoCE (`MoCEPolicy`, cache-conditional routing) re-ranks with a bonus for resident experts so a
resident expert can take a slot from a non-resident one with a slightly higher logit:

1. the top-J experts by z are protected: always selected, ranks 0..J-1 in z order;
2. the other k-J slots go to the top by z' = z + b·resident(e) among the rest, where
   b = λ (`BonusScale.ABSOLUTE`) or λ·Δ_avg (`BonusScale.RANGE`, Qualcomm's Cache-Prior form,
   Δ_avg = a running average of the logit range max(z)-min(z), see `LogitRange`);
3. margin gating (optional) caps b at the margin, see `MoCEPolicy`;
4. drop-tail (optional) removes small-weight misses from the tail, see `MoCEPolicy`.

Weights always come from the model's rule on the unbiased z over the selected set
(`combine_weights`): the bias changes which experts run, never how they are mixed.

Tie-breaking (deterministic, so the reference, the fast twin and the replay agree bit for bit):
- ranking by z: higher z first, equal z -> lower expert index first. For SOFTMAX_TOPK this *is*
  "top-k by probability" (softmax is strictly increasing), ranked on z so that float32 rounding
  of the probabilities (equal or underflowed to 0) cannot create ties the logits do not have;
- ranking by z': equal z' -> the z order above. So a bonus must strictly exceed a logit lead to
  overturn it, and with b = 0 the order is exactly the z order.
"""

from __future__ import annotations

import dataclasses
import enum
import numbers
from dataclasses import dataclass

import numpy as np

from strata.errors import ConfigError, NonFiniteError
from strata.model_config import ModelConfig, RoutingOrder

__all__ = [
    "STOCK_J", "STOCK_BONUS", "STOCK_DROP_TAIL_RANK", "SEED_DROP_TAIL_WEIGHT", "LOGIT_RANGE_DECAY",
    "BonusScale", "RouterRule", "MoCEPolicy", "Selection", "LogitRange",
    "route", "route_batch", "combine_weights", "router_logits", "update_logit_range", "check_policy_for_rule",
]

STOCK_J = 3  # the reference engine: the top-3 unbiased picks are protected
STOCK_BONUS = 0.85  # the reference engine: λ in absolute logits (median z1-z3 is 0.35, so it binds often)
STOCK_DROP_TAIL_RANK = 6  # the reference engine: "drop tail misses w<0.05 (rank >= 6)"
SEED_DROP_TAIL_WEIGHT = 0.05  # the weight the reference engine measured drop-tail with (off by default)
LOGIT_RANGE_DECAY = 0.99  # EMA decay of the logit range: a horizon of ~100 tokens per layer


class BonusScale(enum.Enum):
    """The unit of the MoCE bonus λ."""

    ABSOLUTE = "absolute"  # z' = z + λ·resident
    RANGE = "range"  # z' = z + λ·Δ_avg·resident (Qualcomm Cache-Prior)


def _is_int(v: object) -> bool:
    return isinstance(v, numbers.Integral) and not isinstance(v, bool)


def _is_real(v: object) -> bool:
    return isinstance(v, numbers.Real) and not isinstance(v, bool) and np.isfinite(float(v))


@dataclass(frozen=True)
class RouterRule:
    """The model's own rule: k experts per token, and how logits become weights.

    SOFTMAX_TOPK (Qwen/OLMoE): p = softmax(z) over all E; top-k by p; weights p, divided by
    their sum if `norm_topk_prob`. TOPK_SOFTMAX (Mixtral): top-k by z; softmax over those k.
    SIGMOID_TOPK (DeepSeek-V3, GLM-4.5, MiniMax-M2; docs/routing.md): s = sigmoid(z) + bias
    ranks, within the best `topk_group` of `n_group` expert groups (a group scores by its top 2
    s); weights sigmoid(z) without the bias, divided by their sum if `norm_topk_prob`, times
    `scaling`. The bias is one MoE layer's (`for_layer`), so a sigmoid rule is per layer.
    """

    k: int
    order: RoutingOrder
    norm_topk_prob: bool = True
    n_group: int = 1
    topk_group: int = 1
    scaling: float = 1.0
    bias: tuple[float, ...] = ()  # the selection-only bias, one float32 per expert (): none

    def __post_init__(self) -> None:
        if not _is_int(self.k) or self.k < 1:
            raise ConfigError(f"router rule: k must be a positive int, got {self.k!r}")
        if not isinstance(self.order, RoutingOrder):
            raise ConfigError(f"router rule: order must be a RoutingOrder, got {self.order!r}")
        if not isinstance(self.norm_topk_prob, bool):
            raise ConfigError(f"router rule: norm_topk_prob must be a bool, got {self.norm_topk_prob!r}")
        if not (_is_int(self.n_group) and _is_int(self.topk_group) and 1 <= self.topk_group <= self.n_group):
            raise ConfigError(f"router rule: need 1 <= topk_group <= n_group, got {self.topk_group}, {self.n_group}")
        if not _is_real(self.scaling) or self.scaling <= 0:
            raise ConfigError(f"router rule: scaling must be a finite number > 0, got {self.scaling!r}")
        sigmoid_only = self.n_group > 1 or self.bias or self.scaling != 1.0
        if sigmoid_only and self.order is not RoutingOrder.SIGMOID_TOPK:
            raise ConfigError("router rule: groups, a selection bias and scaling need order SIGMOID_TOPK")
        bias = np.asarray(self.bias, np.float32)  # [E] or [0]
        if bias.ndim != 1 or not np.all(np.isfinite(bias)):
            raise ConfigError("router rule: bias must be finite floats, one per expert")
        object.__setattr__(self, "bias", tuple(float(b) for b in bias))  # float32 values, exactly
        object.__setattr__(self, "_bias", bias)

    @classmethod
    def from_model_config(cls, cfg: ModelConfig) -> "RouterRule":
        """The rule without a layer's bias (`for_layer` adds it)."""
        return cls(cfg.n_experts_per_token, cfg.routing_order, cfg.norm_topk_prob, cfg.n_group, cfg.topk_group,
                   float(cfg.routed_scaling_factor))

    def for_layer(self, bias: np.ndarray | None) -> "RouterRule":
        """This rule with one MoE layer's selection bias (None: the rule unchanged). Shapes: bias [E]"""
        return self if bias is None else dataclasses.replace(self, bias=tuple(np.asarray(bias, np.float32).tolist()))

    def _biased(self, logits: np.ndarray) -> np.ndarray:
        """s = sigmoid(z) + bias in float32 (no group mask). [E] -> [E]"""
        s = _sigmoid(logits)
        if self._bias.size:
            if self._bias.shape != s.shape[-1:]:
                raise ValueError(f"router rule: bias has {self._bias.size} experts, logits {s.shape[-1]}")
            s = (s + self._bias).astype(np.float32)
        return s

    def group_mask(self, scores: np.ndarray) -> np.ndarray:
        """Which experts lie in the chosen groups: the topk_group groups with the largest sum of
        their two best scores (ties -> lower group index). Shapes: scores float32 [E] -> bool [E]"""
        e = scores.shape[-1]
        if self.n_group == 1:
            return np.ones(e, bool)
        g = scores.reshape(self.n_group, e // self.n_group)  # [G, E/G]
        top2 = -np.sort(-g, axis=-1)[:, :2]  # [G, 2] descending
        group_score = (top2[:, 0] + top2[:, 1]).astype(np.float32)  # [G]
        chosen = np.argsort(-group_score, kind="stable")[: self.topk_group]
        keep = np.zeros(self.n_group, bool)
        keep[chosen] = True
        return np.repeat(keep, e // self.n_group)  # [E]

    def selection_scores(self, logits: np.ndarray) -> np.ndarray:
        """The score the rule ranks experts by (higher first); MoCE adds its bonus to it.

        Softmax orders rank on z itself: softmax is strictly increasing, so top-k by probability
        is top-k by z, and ranking on z keeps float32 rounding of probabilities from creating
        ties the logits do not have. SIGMOID_TOPK ranks on sigmoid(z) + bias, -inf outside the
        chosen groups (so no bonus can pick an expert the group limit excludes).

        Shapes:
            logits: float32 [E] -> float32 [E]
        """
        if self.order is not RoutingOrder.SIGMOID_TOPK:
            return logits
        s = self._biased(logits)
        return np.where(self.group_mask(s), s, np.float32(-np.inf)).astype(np.float32)

    def guess_scores(self, logits: np.ndarray) -> np.ndarray:
        """What the read-ahead guess ranks by: the selection score, finite everywhere, the
        experts of the groups the rule would not choose after every chosen one (in their own
        score order), so a guess longer than the eligible set still ranks them. [E] -> [E]"""
        if self.order is not RoutingOrder.SIGMOID_TOPK:
            return logits
        s = self._biased(logits)
        below = np.float32(s.max() - s.min() + 1.0)  # drops every unchosen score under the chosen minimum
        return np.where(self.group_mask(s), s, s - below).astype(np.float32)

    def range_scores(self, logits: np.ndarray) -> np.ndarray:
        """What the RANGE form of the bonus measures the spread of: z (softmax orders), the
        ungrouped s = sigmoid(z) + bias (SIGMOID_TOPK: the bonus is in score units). [.., E]"""
        return logits if self.order is not RoutingOrder.SIGMOID_TOPK else self._biased(logits)

    def weights(self, logits: np.ndarray, experts: np.ndarray) -> np.ndarray:
        """The combine weights of a selected set, from the unbiased logits (`combine_weights`)."""
        return combine_weights(logits, experts, self)


@dataclass(frozen=True)
class MoCEPolicy:
    """Cache-conditional routing parameters. `MoCEPolicy.off()` (bonus 0, no drop-tail) routes
    exactly like the model (`route(..., policy=None)`), bit for bit.

    protect_top_j (J): the top-J by z are always selected (J >= k: plain routing).
    bonus (λ >= 0) and bonus_scale: see `BonusScale`.
    margin (None: no gating): the reference engine's margin gating. The top-1 stays protected; a protected
        rank i in 1..J-1 keeps its protection only while its unbiased lead over the best
        unprotected candidate (the expert at z-rank J) is >= margin. Leads shrink with rank, so
        the protected experts stay a prefix of the z order (`protected_count`). Because λ = 0.85
        exceeds most router gaps, margins of 0.5-1.0 make J3 behave like J1 (the reference engine).
    drop_tail_weight (w, 0 = off) and drop_tail_min_rank (r): after selection, a selected expert
        that is not resident, not protected, at rank >= r, and whose weight is < w is dropped
        (not computed: a miss that would cost a read for little output). The weights of the
        remaining experts are NOT renormalized: dropping is then exactly "that term of the
        routed sum is zero", so the error it adds is the dropped terms and nothing else, and the
        kept experts' outputs are bit-identical to the undropped run. Dropped experts are
        reported in `Selection.dropped`.
    """

    protect_top_j: int = STOCK_J
    bonus: float = STOCK_BONUS
    bonus_scale: BonusScale = BonusScale.ABSOLUTE
    margin: float | None = None
    drop_tail_weight: float = 0.0
    drop_tail_min_rank: int = STOCK_DROP_TAIL_RANK

    def __post_init__(self) -> None:
        if not _is_int(self.protect_top_j) or self.protect_top_j < 0:
            raise ConfigError(f"MoCE: protect_top_j must be an int >= 0, got {self.protect_top_j!r}")
        if not _is_real(self.bonus) or self.bonus < 0:
            raise ConfigError(f"MoCE: bonus must be a finite number >= 0, got {self.bonus!r}")
        if not isinstance(self.bonus_scale, BonusScale):
            raise ConfigError(f"MoCE: bonus_scale must be a BonusScale, got {self.bonus_scale!r}")
        if self.margin is not None and (not _is_real(self.margin) or self.margin <= 0):
            raise ConfigError(f"MoCE: margin must be None or a finite number > 0, got {self.margin!r}")
        if not _is_real(self.drop_tail_weight) or not 0 <= self.drop_tail_weight <= 1:
            raise ConfigError(f"MoCE: drop_tail_weight must be in [0, 1], got {self.drop_tail_weight!r}")
        if not _is_int(self.drop_tail_min_rank) or self.drop_tail_min_rank < 0:
            raise ConfigError(f"MoCE: drop_tail_min_rank must be an int >= 0, got {self.drop_tail_min_rank!r}")

    @classmethod
    def off(cls) -> "MoCEPolicy":
        """No bonus, no drop-tail: the model's own routing."""
        return cls(bonus=0.0)

    @property
    def exact(self) -> bool:
        """Whether this policy routes exactly like the model (no bonus, no drop-tail)."""
        return self.bonus == 0 and self.drop_tail_weight == 0

    def describe(self) -> str:
        """One phrase for reports: "exact (λ = 0)" or "lossy: MoCE J3 λ0.85 ..."."""
        if self.exact:
            return "exact (λ = 0: the model's routing)"
        parts = [f"J{self.protect_top_j}", f"λ{self.bonus:g}" + (" x range" if self.bonus_scale is BonusScale.RANGE else "")]
        if self.margin is not None:
            parts.append(f"margin {self.margin:g}")
        if self.drop_tail_weight > 0:
            parts.append(f"drop<{self.drop_tail_weight:g}@{self.drop_tail_min_rank}")
        return "lossy: MoCE " + " ".join(parts)

    def effective_bonus(self, logit_range: float | None = None) -> float:
        """The bonus b added to resident logits, in logits (after the RANGE scaling)."""
        b = float(self.bonus)
        if self.bonus_scale is BonusScale.RANGE:
            if logit_range is None or not _is_real(logit_range) or logit_range < 0:
                raise ValueError(f"MoCE RANGE form needs a finite logit_range >= 0, got {logit_range!r}")
            b *= float(logit_range)
        return b


@dataclass(frozen=True, eq=False)
class Selection:
    """One token's routing result, in rank order (protected by z, then the rest by z').

    Shapes (k' = k - n experts kept, n dropped by drop-tail):
        experts:  int64 [k']     expert ids
        weights:  float32 [k']   combine weights (the model's rule on unbiased z, before drops)
        protected: bool [k']     among the top-J by z
        resident: bool [k']      resident when routed
        ranks:    int64 [k']     selected rank 0..k-1 (differs from position only after drops)
        dropped:  int64 [n]      experts removed by drop-tail, in rank order
        dropped_weights: float32 [n]  the weights they would have had
        logits:   float32 [E]    the unbiased z
    """

    experts: np.ndarray
    weights: np.ndarray
    protected: np.ndarray
    resident: np.ndarray
    ranks: np.ndarray
    dropped: np.ndarray
    dropped_weights: np.ndarray
    logits: np.ndarray


@dataclass(frozen=True)
class LogitRange:
    """Running average Δ_avg of the router's logit range max(z) - min(z), for the RANGE form.

    Rule: exponential moving average, avg <- DECAY·avg + (1-DECAY)·range with
    DECAY = LOGIT_RANGE_DECAY, started at the first token's range (so it is never biased toward
    0). An EMA rather than a cumulative mean so that it follows the prompt-to-generation drift of
    the router's scale without a tuning knob beyond the horizon. Keep one per layer: router
    scales differ by layer. Update with a token's logits before routing that token.
    """

    average: float = 0.0
    count: int = 0


def update_logit_range(state: LogitRange, logits: np.ndarray) -> LogitRange:
    """Fold one token's (or T tokens', in order) logit range into the running average.

    Shapes:
        logits: [E] or [T, E]
    """
    z = np.asarray(logits, dtype=np.float32)
    if z.ndim not in (1, 2) or z.size == 0:
        raise ValueError(f"update_logit_range wants [E] or [T, E] logits, got shape {z.shape}")
    rows = z.reshape(-1, z.shape[-1])  # [T, E]
    avg, count = float(state.average), int(state.count)
    for r in (rows.max(axis=-1).astype(np.float64) - rows.min(axis=-1)).tolist():  # [T]
        avg = r if count == 0 else LOGIT_RANGE_DECAY * avg + (1.0 - LOGIT_RANGE_DECAY) * r
        count += 1
    return LogitRange(average=avg, count=count)


def router_logits(w_router: np.ndarray, x: np.ndarray) -> np.ndarray:
    """z = W_router · x in float32.

    Shapes:
        w_router: [E, D];  x: [D] or [T, D]  ->  z: [E] or [T, E]
    """
    w = np.asarray(w_router, dtype=np.float32)
    x = np.asarray(x, dtype=np.float32)
    if w.ndim != 2 or x.ndim not in (1, 2) or x.shape[-1] != w.shape[1]:
        raise ValueError(f"router_logits: W {w.shape} cannot multiply x {x.shape}")
    return (x @ w.T).astype(np.float32)


def _sigmoid(z: np.ndarray) -> np.ndarray:
    """float32 sigmoid 1 / (1 + exp(-z))."""
    z = np.asarray(z, dtype=np.float32)
    return (np.float32(1.0) / (np.float32(1.0) + np.exp(-z))).astype(np.float32)


# DeepSeek-V3 and GLM-4.5 divide by (sum + 1e-20); in float32 that is the sum itself for every
# sum above ~1e-13 (k sigmoids of finite logits), so one rule serves MiniMax-M2 (no epsilon) too
NORM_EPS = np.float32(1e-20)


def _softmax(z: np.ndarray) -> np.ndarray:
    """float32 softmax; the sum runs in the array's order."""
    e = np.exp(z - z.max())
    return (e / e.sum()).astype(np.float32)


def combine_weights(logits: np.ndarray, experts: np.ndarray, rule: RouterRule) -> np.ndarray:
    """The model's combine weights of `experts` (a selected set), from the unbiased logits.

    Sums run over the set in expert-id order, so the weights depend only on the set, never on
    the rank order a policy produced (bit for bit).

    Shapes:
        logits: float32 [E];  experts: int [k]  ->  weights: float32 [k], aligned with experts
    """
    z = np.asarray(logits, dtype=np.float32)
    sel = np.asarray(experts, dtype=np.int64)
    canon = np.argsort(sel, kind="stable")  # [k] summation order
    if rule.order is RoutingOrder.SIGMOID_TOPK:
        w = _sigmoid(z[sel])  # the unbiased scores: the bias only chose
        if rule.norm_topk_prob:
            w = (w / (w[canon].sum(dtype=np.float32) + NORM_EPS)).astype(np.float32)
        return (w * np.float32(rule.scaling)).astype(np.float32)
    if rule.order is RoutingOrder.SOFTMAX_TOPK:
        w = _softmax(z)[sel]
        if rule.norm_topk_prob:
            w = (w / w[canon].sum()).astype(np.float32)
        return w
    w = np.empty(sel.shape, np.float32)
    w[canon] = _softmax(z[sel[canon]])
    return w


def _check(logits: np.ndarray, resident: np.ndarray | None, k: int) -> tuple[np.ndarray, np.ndarray]:
    z = np.asarray(logits, dtype=np.float32)
    if z.ndim != 1:
        raise ValueError(f"route wants [E] logits, got shape {z.shape}")
    if not np.all(np.isfinite(z)):
        raise NonFiniteError(f"router logits are not finite ({int(np.count_nonzero(~np.isfinite(z)))} of {z.size} "
                             "NaN or inf): the model's weights or the experts are damaged")
    if k > z.size:
        raise ValueError(f"route: top-{k} of only {z.size} experts")
    res = np.zeros(z.shape, bool) if resident is None else np.asarray(resident)
    if res.dtype != bool or res.shape != z.shape:
        raise ValueError(f"route: resident must be bool {z.shape}, got {res.dtype} {res.shape}")
    return z, res


def protected_count(z_sorted: np.ndarray, policy: MoCEPolicy | None, k: int) -> int:
    """How many of the top experts by z are protected: min(J, k), less under margin gating.

    Shapes:
        z_sorted: float32 [E], descending
    """
    if policy is None:
        return 0
    j = min(policy.protect_top_j, k)
    if policy.margin is None or j <= 1 or j >= z_sorted.size:
        return j
    leads = z_sorted[1:j] - z_sorted[j]  # [j-1] float32, non-increasing
    return 1 + int(np.count_nonzero(leads >= np.float32(policy.margin)))


def check_policy_for_rule(policy: MoCEPolicy | None, rule: RouterRule) -> None:
    """Refuse the stock λ on a sigmoid rule. An ABSOLUTE bonus is in the units of the rule's
    selection score: logits for the softmax orders, σ(z) + bias for SIGMOID_TOPK (σ in (0, 1)).
    The stock λ = 0.85 is a logit value measured on softmax routers and means nothing there;
    the RANGE form (λ × the running spread of the score) carries across rules."""
    if (policy is not None and rule.order is RoutingOrder.SIGMOID_TOPK
            and policy.bonus_scale is BonusScale.ABSOLUTE and policy.bonus == STOCK_BONUS):
        raise ConfigError(f"MoCE: the stock λ = {STOCK_BONUS} is in logits (measured on softmax routers), but this "
                          "model's sigmoid rule ranks by σ(z) + bias in (0, 1): use the RANGE form "
                          "(moce_scale='range', on the command line --moce-scale range: λ × the running score spread) or an absolute λ in score units "
                          "(docs/routing.md)")


def route(logits: np.ndarray, rule: RouterRule, policy: MoCEPolicy | None = None,
          resident: np.ndarray | None = None, logit_range: float | None = None) -> Selection:
    """Select one token's experts: the model's rule, with MoCE when `policy` is given.

    `resident` None means nothing is resident (the bonus has nothing to favour; drop-tail then
    treats every tail expert as a miss). `logit_range` is Δ_avg for the RANGE form (typically
    `LogitRange.average` of this layer) and is ignored by the ABSOLUTE form.

    Shapes:
        logits: float32 [E];  resident: bool [E]  ->  Selection with k' <= k experts
    """
    z, res = _check(logits, resident, rule.k)
    k = rule.k
    b = policy.effective_bonus(logit_range) if policy is not None else 0.0
    score = rule.selection_scores(z)  # [E] what the rule ranks by
    by_z = np.argsort(-score, kind="stable")  # [E] score descending, ties -> lower index
    j = protected_count(score[by_z], policy, k)
    rest = by_z[j:]  # [E-j] non-protected, in score order
    # s' in float32 with the bonus rounded to float32, as the GPU kernels compute it (no float64).
    biased = score[rest] + np.float32(b) * res[rest].astype(np.float32)  # [E-j] s'
    rest = rest[np.argsort(-biased, kind="stable")[: k - j]]  # s' ties keep the score order
    experts = np.concatenate([by_z[:j], rest]).astype(np.int64)  # [k] rank order
    weights = rule.weights(z, experts)  # [k]
    ranks = np.arange(k, dtype=np.int64)
    drop = np.zeros(k, bool)
    if policy is not None and policy.drop_tail_weight > 0:
        drop = (~res[experts]) & (ranks >= max(j, policy.drop_tail_min_rank)) & (
            weights < np.float32(policy.drop_tail_weight))
    keep = ~drop
    return Selection(
        experts=experts[keep], weights=weights[keep], protected=(ranks < j)[keep],
        resident=res[experts][keep], ranks=ranks[keep], dropped=experts[drop],
        dropped_weights=weights[drop], logits=z,
    )


def route_batch(logits: np.ndarray, rule: RouterRule, policy: MoCEPolicy | None = None,
                resident: np.ndarray | None = None, logit_range: float | None = None) -> list[Selection]:
    """`route` for each of T tokens against the same (or a per-token) residency.

    Shapes:
        logits: float32 [T, E];  resident: bool [E] or [T, E]  ->  T Selections
    """
    z = np.asarray(logits, dtype=np.float32)
    if z.ndim != 2:
        raise ValueError(f"route_batch wants [T, E] logits, got shape {z.shape}")
    res = None if resident is None else np.broadcast_to(np.asarray(resident), z.shape)
    return [route(z[t], rule, policy, None if res is None else res[t], logit_range) for t in range(z.shape[0])]
