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
# the orders that rank on z itself (the independent definitions in test_routing.py sort by z);
# SIGMOID_TOPK has its own tests (test_routing_sigmoid.py)
routing_orders = st.sampled_from([RoutingOrder.SOFTMAX_TOPK, RoutingOrder.TOPK_SOFTMAX])


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


# ---------------------------------------------------------------- expert cache (tests/cache/test_cache_*.py)

from strata.cache.types import (  # noqa: E402
    AfterLayer, AtLayer, BeginWindow, CacheConfig, HoldRegion, min_capacity,
)


@st.composite
def cache_configs(draw, *, max_layers: int = 4, max_experts: int = 8, below_min: bool = False):
    """Small CacheConfigs over every knob. Capacity is the smallest legal one plus a little
    (below_min: anything from 1 up, so victim() may legitimately fail)."""
    n_layers = draw(st.integers(1, max_layers))
    n_experts = draw(st.integers(2, max_experts))
    top_k = draw(st.integers(1, min(3, n_experts)))
    window = draw(st.integers(1, 2))
    k = draw(st.integers(0, 4))
    split, prefetch2, layer_pins = draw(st.booleans()), draw(st.booleans()), draw(st.booleans())
    least = min_capacity(n_layers, top_k, k, window=window, split_turn=split, prefetch2=prefetch2,
                         n_experts=n_experts, layer_pins=layer_pins)
    capacity = draw(st.integers(1, least + 2) if below_min else st.integers(least, least + 6))
    return CacheConfig(capacity=capacity, n_layers=n_layers, n_experts=n_experts, top_k=top_k,
                       window=window, prefetch_depth=k, prefetch_touch=draw(st.booleans()),
                       prefetch2=prefetch2, split_turn=split, layer_pins=layer_pins)


@st.composite
def cache_selections(draw, config: CacheConfig, prompt: bool):
    """A turn's selected experts: distinct, rank order; a prompt chunk may select any number.
    The size is drawn first so that large (arena-filling) turns are as likely as small ones."""
    most = config.n_experts if prompt else config.max_selected
    n = draw(st.integers(1, most))
    return tuple(draw(st.permutations(range(config.n_experts)))[:n])


@st.composite
def cache_guesses(draw, config: CacheConfig):
    """Ranked guesses, sometimes longer than K (the machine uses the first K)."""
    n = draw(st.integers(0, min(config.prefetch_depth + 1, config.n_experts)))
    return tuple(draw(st.permutations(range(config.n_experts)))[:n])


@st.composite
def cache_turn_sequences(draw, config: CacheConfig, max_windows: int = 4):
    """A legal event sequence without ReadDone: whole windows, some inside a held prompt region."""
    events, prompt = [], False
    for _ in range(draw(st.integers(1, max_windows))):
        if draw(st.integers(0, 3)) == 0:
            prompt = not prompt
            events.append(HoldRegion(prompt))
        events.append(BeginWindow())
        for layer in range(config.n_layers):
            events.append(AtLayer(layer, draw(cache_selections(config, prompt))))
            events.append(AfterLayer(layer, draw(cache_guesses(config)), draw(cache_guesses(config))))
    if prompt:
        events.append(HoldRegion(False))
    return events


# ---------------------------------------------------------------- PLE rows


def ngram_row_ids(rows: int, max_ids: int = 24):
    """Row ids of one PLE layer's request: int64 [n] in [0, rows), repeats allowed."""
    return hnp.arrays(np.int64, st.integers(1, max_ids), elements=st.integers(0, rows - 1))


# ---------------------------------------------------------------- calls sharing one Model

SHARED_PROMPTS = (list(b"def f(x):"), list(b"def f(x): return x"), list(b"hello"), list(b"def g"))  # shared prefixes


@st.composite
def generation_calls(draw):
    """One call: (whole, prompt index into SHARED_PROMPTS, max_tokens, temperature, seed); whole:
    `generate` (all at once), else a `stream_generate` iterator; greedy or sampled."""
    temperature = draw(st.sampled_from([0.0, 0.9]))
    return (draw(st.booleans()), draw(st.integers(0, len(SHARED_PROMPTS) - 1)), draw(st.integers(1, 5)), temperature,
            draw(st.integers(0, 3)) if temperature else 0)


def interleavings(max_calls: int = 4, max_steps: int = 24):
    """(calls, schedule): the calls one thread makes, and which of them advances at each step
    (an index taken modulo the number of calls); what the schedule leaves is drained in order."""
    return st.tuples(st.lists(generation_calls(), min_size=1, max_size=max_calls),
                     st.lists(st.integers(0, max_calls - 1), max_size=max_steps))
