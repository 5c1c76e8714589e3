"""Hypothesis strategies shared by the test modules (one place, STYLE §8)."""

from __future__ import annotations

import numpy as np
from hypothesis import strategies as st
from hypothesis.extra import numpy as hnp

from strata.model_config import RoutingOrder
from strata.reference.routing import BonusScale, MoCEPolicy

finite_f32 = st.floats(min_value=-1e4, max_value=1e4, allow_nan=False, allow_infinity=False, width=32)


def float_matrices(max_rows: int = 8, max_blocks: int = 4, block: int = 32):
    """[rows, blocks*32] float32 matrices with finite entries."""
    return st.tuples(st.integers(1, max_rows), st.integers(1, max_blocks)).flatmap(
        lambda rb: hnp.arrays(np.float32, (rb[0], rb[1] * block), elements=finite_f32)
    )


# ---------------------------------------------------------------- routing

MAX_ROUTING_EXPERTS = 64
MAX_ROUTING_K = 10
logit_values = st.floats(min_value=-16, max_value=16, allow_nan=False, allow_infinity=False, width=32)
routing_orders = st.sampled_from(list(RoutingOrder))


@st.composite
def routing_problems(draw, max_experts: int = MAX_ROUTING_EXPERTS, max_k: int = MAX_ROUTING_K, distinct: bool = False):
    """(logits float32 [E], resident bool [E], k). `distinct` draws logits without exact ties."""
    n_experts = draw(st.integers(1, max_experts))
    k = draw(st.integers(1, min(n_experts, max_k)))
    logits = draw(hnp.arrays(np.float32, n_experts, elements=logit_values, unique=distinct))
    resident = draw(hnp.arrays(np.bool_, n_experts))
    return logits, resident, k


def moce_policies(drop_tail: bool = True, max_bonus: float = 4.0):
    """MoCEPolicy over every variant: J, λ, both bonus scales, margin gating, drop-tail."""
    return st.builds(
        MoCEPolicy,
        protect_top_j=st.integers(0, MAX_ROUTING_K + 1),
        bonus=st.one_of(st.just(0.0), st.floats(0.0, max_bonus)),
        bonus_scale=st.sampled_from(list(BonusScale)),
        margin=st.one_of(st.none(), st.floats(0.01, 4.0)),
        drop_tail_weight=st.one_of(st.just(0.0), st.floats(0.0, 0.5)) if drop_tail else st.just(0.0),
        drop_tail_min_rank=st.integers(0, MAX_ROUTING_K),
    )


logit_ranges = st.floats(0.0, 32.0)
