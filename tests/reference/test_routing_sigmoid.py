"""Sigmoid routing with a selection-only bias and expert groups (DeepSeek-V3, GLM-4.5, MiniMax-M2),
and MoCE on it (docs/routing.md).

The model's rule is held bit for bit to a line-by-line numpy transcription of transformers'
`DeepseekV3TopkRouter.forward` (= `Glm4MoeTopkRouter`; MiniMax-M2 is the one-group case), and to
the torch module itself on the set and to float32 rounding on the weights. The data has
non-zero biases and several groups, and the tests check that ignoring the bias or the groups
changes the selection on it, so a rule applied wrongly cannot pass.
"""

from __future__ import annotations

import numpy as np
import pytest
from hypothesis import given
from hypothesis import strategies as st

from strata.errors import ConfigError
from strata.model_config import RoutingOrder
from strata.reference.routing import MoCEPolicy, RouterRule, route
from strata.runtime.selector import Selector, top_k_experts
from tests.budgets import WEIGHT_RTOL

E, K, N_GROUP, TOPK_GROUP, SCALE = 32, 4, 8, 3, 2.5


def hf_router_numpy(z: np.ndarray, bias: np.ndarray, k: int, n_group: int, topk_group: int, norm: bool,
                    scale: float) -> tuple[np.ndarray, np.ndarray]:
    """transformers' DeepseekV3TopkRouter.forward after the logits, one token, written in numpy
    statement by statement (topk without ties on these data; the weight sum in expert-id order).

    Shapes: z, bias float32 [E] -> (experts int64 [k] ascending, weights float32 [k])"""
    scores = (np.float32(1) / (np.float32(1) + np.exp(-z))).astype(np.float32)  # router_logits.sigmoid()
    scores_for_choice = (scores + bias).astype(np.float32)
    grouped = scores_for_choice.reshape(n_group, -1)
    group_scores = np.sort(grouped, axis=-1)[:, ::-1][:, :2].sum(axis=-1, dtype=np.float32)  # .topk(2)[0].sum(-1)
    group_idx = np.argsort(-group_scores, kind="stable")[:topk_group]
    group_mask = np.zeros(n_group, np.float32)
    group_mask[group_idx] = 1
    score_mask = np.repeat(group_mask, z.size // n_group).astype(bool)
    scores_for_choice = np.where(score_mask, scores_for_choice, -np.inf)
    topk_indices = np.sort(np.argsort(-scores_for_choice, kind="stable")[:k])
    topk_weights = scores[topk_indices]
    if norm:
        topk_weights = (topk_weights / (topk_weights.sum(dtype=np.float32) + np.float32(1e-20))).astype(np.float32)
    return topk_indices, (topk_weights * np.float32(scale)).astype(np.float32)


def problem(seed: int, e: int = E) -> tuple[np.ndarray, np.ndarray]:
    """Logits and a bias on the scale DeepSeek-V3's routers have (bias comparable to score gaps)."""
    rng = np.random.default_rng(seed)
    return rng.normal(0, 2, e).astype(np.float32), rng.normal(0, 0.3, e).astype(np.float32)


def rule_for(bias: np.ndarray, n_group: int = N_GROUP, topk_group: int = TOPK_GROUP, norm: bool = True,
             scale: float = SCALE) -> RouterRule:
    return RouterRule(K, RoutingOrder.SIGMOID_TOPK, norm, n_group, topk_group, scale).for_layer(bias)


@pytest.mark.parametrize("n_group,topk_group,norm,scale", [(8, 3, True, 2.5), (4, 2, False, 1.0), (1, 1, True, 1.0)])
def test_lambda_zero_is_transformers_routing_bit_for_bit(n_group, topk_group, norm, scale) -> None:
    for seed in range(200):
        z, bias = problem(seed)
        sel = route(z, rule_for(bias, n_group, topk_group, norm, scale), MoCEPolicy.off(), np.ones(E, bool))
        plain = route(z, rule_for(bias, n_group, topk_group, norm, scale))
        want_e, want_w = hf_router_numpy(z, bias, K, n_group, topk_group, norm, scale)
        order = np.argsort(sel.experts)
        assert sel.experts[order].tolist() == want_e.tolist()
        assert sel.weights[order].tobytes() == want_w.tobytes()
        assert plain.experts.tolist() == sel.experts.tolist() and plain.weights.tobytes() == sel.weights.tobytes()


def test_the_data_tells_a_wrong_rule_apart() -> None:
    """Dropping the bias, the groups, or weighting by the biased score changes the result on
    the problems above: the bit-for-bit test would catch each mistake."""
    no_bias = no_groups = biased_weights = 0
    for seed in range(200):
        z, bias = problem(seed)
        right = set(route(z, rule_for(bias)).experts.tolist())
        no_bias += right != set(route(z, rule_for(np.zeros(E, np.float32))).experts.tolist())
        no_groups += right != set(route(z, rule_for(bias, 1, 1)).experts.tolist())
        e, w = hf_router_numpy(z, bias, K, N_GROUP, TOPK_GROUP, True, SCALE)
        s = (1 / (1 + np.exp(-z[e])) + bias[e]).astype(np.float32)
        biased_weights += not np.allclose(s / s.sum() * SCALE, w)
    assert no_bias > 20 and no_groups > 20 and biased_weights > 100


def test_torch_router_module_agrees() -> None:
    torch = pytest.importorskip("torch")
    from transformers.models.deepseek_v3.configuration_deepseek_v3 import DeepseekV3Config
    from transformers.models.deepseek_v3.modeling_deepseek_v3 import DeepseekV3TopkRouter

    d, t = 16, 64
    cfg = DeepseekV3Config(hidden_size=d, n_routed_experts=E, num_experts_per_tok=K, n_group=N_GROUP,
                           topk_group=TOPK_GROUP, routed_scaling_factor=SCALE, norm_topk_prob=True)
    router = DeepseekV3TopkRouter(cfg)
    rng = np.random.default_rng(7)
    w, bias = rng.normal(0, 0.5, (E, d)).astype(np.float32), rng.normal(0, 0.3, E).astype(np.float32)
    x = rng.normal(0, 1, (t, d)).astype(np.float32)
    with torch.no_grad():
        router.weight.copy_(torch.from_numpy(w))
        router.e_score_correction_bias.copy_(torch.from_numpy(bias))
        logits, weights, indices = (a.numpy() for a in router(torch.from_numpy(x)))
    rule = rule_for(bias)
    for i in range(t):
        sel = route(logits[i], rule)
        order, theirs = np.argsort(sel.experts), np.argsort(indices[i])
        assert sel.experts[order].tolist() == indices[i][theirs].tolist()
        np.testing.assert_allclose(sel.weights[order], weights[i][theirs], rtol=WEIGHT_RTOL, atol=0)


@given(seed=st.integers(0, 2**31 - 1), j=st.integers(0, K + 1), bonus=st.floats(0.0, 2.0),
       resident_bits=st.integers(0, 2**E - 1))
def test_moce_on_the_sigmoid_rule(seed, j, bonus, resident_bits) -> None:
    """The bonus joins s = sigmoid(z) + bias inside the chosen groups: protected experts are the
    top-J by s, the rest the top by s + b·resident, never outside the groups; the weights are
    the rule's, from the unbiased scores of the selected set."""
    z, bias = problem(seed)
    rule = rule_for(bias)
    resident = np.array([(resident_bits >> e) & 1 for e in range(E)], bool)
    sel = route(z, rule, MoCEPolicy(protect_top_j=j, bonus=bonus), resident)
    s = rule.selection_scores(z)
    eligible = np.isfinite(s)
    by_s = sorted(range(E), key=lambda e: (-float(s[e]), e))
    jj = min(j, K)
    b = np.float32(bonus)
    rest = sorted(by_s[jj:], key=lambda e: (-float(s[e] + b * resident[e]), -float(s[e]), e))
    assert sel.experts.tolist() == by_s[:jj] + rest[: K - jj]
    assert eligible[sel.experts].all()
    assert sel.weights.tobytes() == rule.weights(z, sel.experts).tobytes()


def test_guesses_rank_with_the_rule() -> None:
    """The read-ahead guess's first k are the rule's own selection (rank order), and a longer
    guess lists every eligible expert before any the groups exclude."""
    for seed in range(50):
        z, bias = problem(seed)
        rule = rule_for(bias)
        g = top_k_experts(rule.guess_scores(z), 16)
        assert list(g[:K]) == route(z, rule).experts.tolist()
        eligible = np.isfinite(rule.selection_scores(z))
        n_eligible = int(eligible.sum())
        assert eligible[list(g[:n_eligible])].all()


def test_selector_uses_each_layers_rule() -> None:
    from strata.testing.models import SHAPES

    cfg = SHAPES["sigmoid"]
    rng = np.random.default_rng(3)
    biases = [rng.normal(0, 0.3, cfg.n_experts).astype(np.float32) for _ in range(cfg.n_moe_layers)]
    rules = tuple(RouterRule.from_model_config(cfg).for_layer(b) for b in biases)
    sel = Selector(cfg, MoCEPolicy.off(), rules)
    z = rng.normal(0, 2, (1, cfg.n_experts)).astype(np.float32)
    for m in range(cfg.n_moe_layers):
        assert sel.select(m, z, np.zeros(cfg.n_experts, bool))[0].experts.tolist() == route(z[0], rules[m]).experts.tolist()
        assert sel.guesses(z, cfg.n_experts_per_token, layer=m) == tuple(route(z[0], rules[m]).experts.tolist())


def test_rule_refuses_what_it_does_not_define() -> None:
    with pytest.raises(ConfigError, match="SIGMOID_TOPK"):
        RouterRule(2, RoutingOrder.SOFTMAX_TOPK, n_group=2, topk_group=1)
    with pytest.raises(ConfigError, match="topk_group"):
        RouterRule(2, RoutingOrder.SIGMOID_TOPK, n_group=2, topk_group=3)
    with pytest.raises(ConfigError, match="bias"):
        RouterRule(2, RoutingOrder.SIGMOID_TOPK, bias=(float("nan"),))
