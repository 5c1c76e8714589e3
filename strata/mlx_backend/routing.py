"""Routing on MLX arrays: the twin of strata.reference.routing.route / route_batch.

The whole batch is ranked at once with exact comparisons (no sort whose tie order could differ
from numpy's stable argsort):

    rank_z[t, e]  = #{j : z_j > z_e or (z_j = z_e and j < e)}      (z descending, ties to lower id)
    protected     = rank_z < j_t     (j_t: min(J, k), lowered by margin gating as in the reference)
    z'            = z + float32(b) * resident                       (float32, as the reference)
    rank'[t, e]   = #{j unprotected : z'_j > z'_e or (z'_j = z'_e and rank_z_j < rank_z_e)}
    position      = rank_z (protected) | j_t + rank' (the rest), selected when position < k

so the selected experts and their rank order are the reference's bit for bit; the weights use the
same float32 formulas with MLX's summation order (budget: tests/mlx_agree.py ROUTING). Drop-tail
is applied on the host from those weights, as in the reference.

Shapes:
    logits float32 [T, E]; resident bool [E] or [T, E] -> T Selections (host numpy fields)
"""

from __future__ import annotations

import mlx.core as mx
import numpy as np

from strata.errors import NonFiniteError
from strata.model_config import RoutingOrder
from strata.reference.routing import MoCEPolicy, RouterRule, Selection

__all__ = ["route", "route_batch", "rank_order", "combine_weights", "router_logits", "selection_scores"]

_NOT_SELECTED = 1 << 20  # position key of an unselected expert (above any real position)


def rank_order(z: mx.array, tiebreak: mx.array) -> mx.array:
    """For each row, the rank of every entry: larger first, equal values by smaller tiebreak.

    Shapes:
        z: [T, E]; tiebreak: int [T, E] (distinct within a row) -> int32 [T, E]
    """
    zi, zj = z[:, :, None], z[:, None, :]  # [T, E, 1] vs [T, 1, E]
    ahead = (zj > zi) | ((zj == zi) & (tiebreak[:, None, :] < tiebreak[:, :, None]))  # [T, E, E]
    return ahead.astype(mx.int32).sum(axis=-1)


def _sigmoid(z: mx.array) -> mx.array:
    return 1.0 / (1.0 + mx.exp(-z))  # the reference's formula (not mx.sigmoid), so ranks agree


def selection_scores(z: mx.array, rule: RouterRule) -> mx.array:
    """Twin of `RouterRule.selection_scores` for a batch: z (softmax orders), or sigmoid(z) +
    bias with -inf outside each token's chosen groups (SIGMOID_TOPK).

    Shapes:
        z float32 [T, E] -> float32 [T, E]
    """
    if rule.order is not RoutingOrder.SIGMOID_TOPK:
        return z
    t, e = z.shape
    s = _sigmoid(z)
    if rule.bias:
        s = s + mx.array(np.asarray(rule.bias, np.float32))
    if rule.n_group == 1:
        return s
    g = mx.sort(s.reshape(t, rule.n_group, e // rule.n_group), axis=-1)  # [T, G, E/G] ascending
    group_score = g[..., -1] + g[..., -2]  # [T, G]: the best two (the reference adds best + second)
    ids = mx.broadcast_to(mx.arange(rule.n_group, dtype=mx.int32)[None], (t, rule.n_group))
    chosen = rank_order(group_score, ids) < rule.topk_group  # [T, G] (ties -> lower group)
    mask = mx.repeat(chosen, e // rule.n_group, axis=-1)  # [T, E]
    return mx.where(mask, s, mx.array(-np.inf, mx.float32))


def combine_weights(z: mx.array, experts: mx.array, rule: RouterRule) -> mx.array:
    """The model's combine weights of the selected experts from the unbiased logits.

    Shapes:
        z float32 [T, E]; experts int [T, k] -> float32 [T, k]
    """
    if rule.order is RoutingOrder.SIGMOID_TOPK:
        w = _sigmoid(mx.take_along_axis(z, experts, axis=-1))  # [T, k] unbiased: the bias only chose
        if rule.norm_topk_prob:
            w = w / (w.sum(axis=-1, keepdims=True) + mx.array(1e-20, mx.float32))
        return w * mx.array(rule.scaling, mx.float32)
    if rule.order is RoutingOrder.SOFTMAX_TOPK:
        e = mx.exp(z - z.max(axis=-1, keepdims=True))
        p = e / e.sum(axis=-1, keepdims=True)  # [T, E]
        w = mx.take_along_axis(p, experts, axis=-1)
        return w / w.sum(axis=-1, keepdims=True) if rule.norm_topk_prob else w
    zs = mx.take_along_axis(z, experts, axis=-1)  # [T, k]
    e = mx.exp(zs - zs.max(axis=-1, keepdims=True))
    return e / e.sum(axis=-1, keepdims=True)


def _protected_count(z_desc: mx.array, policy: MoCEPolicy | None, k: int) -> mx.array:
    """Per token, how many of the top experts are protected (reference `protected_count`). [T]"""
    t, e = z_desc.shape
    if policy is None:
        return mx.zeros((t,), mx.int32)
    j = min(policy.protect_top_j, k)
    if policy.margin is None or j <= 1 or j >= e:
        return mx.full((t,), j, mx.int32)
    leads = z_desc[:, 1:j] - z_desc[:, j:j + 1]  # [T, j-1] float32
    return 1 + (leads >= mx.array(policy.margin, mx.float32)).astype(mx.int32).sum(axis=-1)


def select_device(z: mx.array, rule: RouterRule, policy: MoCEPolicy | None, resident: mx.array | None,
                  bonus: float) -> tuple[mx.array, mx.array, mx.array, mx.array]:
    """The device part of routing: (experts int32 [T, k] in rank order, weights float32 [T, k],
    j int32 [T] protected counts, resident-of-selected bool [T, k])."""
    t, e = z.shape
    k = rule.k
    ids = mx.broadcast_to(mx.arange(e, dtype=mx.int32)[None], (t, e))
    score = selection_scores(z, rule)  # [T, E] what the rule ranks by (z for the softmax orders)
    rank_z = rank_order(score, ids)  # [T, E]
    j = _protected_count(mx.sort(score, axis=-1)[:, ::-1], policy, k)  # [T]
    protected = rank_z < j[:, None]
    res = mx.zeros((t, e), mx.bool_) if resident is None else mx.broadcast_to(resident, (t, e))
    z_b = score + mx.array(bonus, mx.float32) * res.astype(mx.float32)  # [T, E] the biased score s'
    big = mx.array(np.finfo(np.float32).min, mx.float32)
    z_rest = mx.where(protected, big, z_b)  # protected experts never rank among the rest
    rank_r = rank_order(z_rest, rank_z)  # among the unprotected (the protected sink below them)
    pos = mx.where(protected, rank_z, j[:, None] + rank_r)
    pos = mx.where(pos < k, pos, _NOT_SELECTED + ids)  # [T, E] distinct keys
    experts = mx.argsort(pos, axis=-1)[:, :k].astype(mx.int32)  # [T, k] rank order
    weights = combine_weights(z, experts, rule)
    return experts, weights, j, mx.take_along_axis(res, experts, axis=-1)


def route_batch(logits, rule: RouterRule, policy: MoCEPolicy | None = None, resident=None,
                logit_range: float | None = None) -> list[Selection]:
    """Twin of `strata.reference.routing.route_batch`.

    Shapes:
        logits: float32 [T, E];  resident: bool [E] or [T, E]  ->  T Selections
    """
    z = mx.array(np.asarray(logits, np.float32)) if not isinstance(logits, mx.array) else logits.astype(mx.float32)
    if z.ndim != 2:
        raise ValueError(f"route_batch wants [T, E] logits, got shape {z.shape}")
    if rule.k > z.shape[1]:
        raise ValueError(f"route: top-{rule.k} of only {z.shape[1]} experts")
    res = None if resident is None else mx.array(np.asarray(resident, dtype=bool))
    bonus = policy.effective_bonus(logit_range) if policy is not None else 0.0
    experts, weights, j, sel_res = select_device(z, rule, policy, res, bonus)
    experts, weights, j, sel_res, zh = (np.array(a) for a in (experts, weights, j, sel_res, z))
    if not np.all(np.isfinite(zh)):
        raise NonFiniteError(f"router logits are not finite ({int(np.count_nonzero(~np.isfinite(zh)))} of {zh.size} "
                             "NaN or inf): the model's weights or the experts are damaged")
    out = []
    ranks = np.arange(rule.k, dtype=np.int64)
    for t in range(zh.shape[0]):
        ex, w, r = experts[t].astype(np.int64), weights[t].astype(np.float32), sel_res[t].astype(bool)
        drop = np.zeros(rule.k, bool)
        if policy is not None and policy.drop_tail_weight > 0:
            drop = (~r) & (ranks >= max(int(j[t]), policy.drop_tail_min_rank)) & (w < np.float32(policy.drop_tail_weight))
        keep = ~drop
        out.append(Selection(experts=ex[keep], weights=w[keep], protected=(ranks < j[t])[keep], resident=r[keep],
                             ranks=ranks[keep], dropped=ex[drop], dropped_weights=w[drop], logits=zh[t]))
    return out


def route(logits, rule: RouterRule, policy: MoCEPolicy | None = None, resident=None,
          logit_range: float | None = None) -> Selection:
    """Twin of `strata.reference.routing.route`: one token. logits [E] -> Selection"""
    z = np.asarray(logits, np.float32) if not isinstance(logits, mx.array) else logits
    if z.ndim != 1:
        raise ValueError(f"route wants [E] logits, got shape {z.shape}")
    return route_batch(z[None], rule, policy, resident, logit_range)[0]


def router_logits(w_router, x) -> mx.array:
    """Twin of `strata.reference.routing.router_logits`: z = W x in float32. [E, D], [T, D] -> [T, E]"""
    w = mx.array(np.asarray(w_router, np.float32)) if not isinstance(w_router, mx.array) else w_router
    x = mx.array(np.asarray(x, np.float32)) if not isinstance(x, mx.array) else x
    return (x.astype(mx.float32) @ w.astype(mx.float32).T).astype(mx.float32)
