"""Determinism with real threads: random read delays and completion orders (hypothesis-drawn
seeds) change neither the decision trace nor the tokens, at λ = 0 and at λ > 0; the late count
(the one timing-dependent number) is free to vary. Run with the fast cache twin (the default)
and with the reference machine (`reference_cache`), which must agree with each other too."""

import numpy as np
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

import strata
from strata.config import Config
from strata.runtime.decode import arena_plan_for
from strata.testing.engines import open_numpy_streaming
from strata.testing.faults import RandomDelays
from strata.testing.models import make_model

PROMPT = "for i in range(3):"
N_DECODE = 8
CONFIGS = {
    "lambda0": Config(moce_lambda=0.0, prefetch=6, prefill_chunk=6),
    "stock": Config(prefetch=6, prefill_chunk=6),
    "j1-l2-pf2": Config(moce_j=1, moce_lambda=2.0, prefetch=4, prefetch2=True, prefill_chunk=6),
}


@pytest.fixture(scope="module")
def model(tmp_path_factory):
    made = make_model(tmp_path_factory.mktemp("det") / "tiny48", "tiny", seed=11, n_experts=48)
    return strata.load(made.model_path)


def run(model, config, hook):
    config = config.replace(arena=f"{arena_plan_for(model, config.replace(arena='9999slots')).min_slots + 2}slots",
                            io_threads=3)
    with open_numpy_streaming(model, config, hook=hook, keep_trace=True) as engine:
        logits = engine.prefill(model.tokenizer.encode(PROMPT))
        tokens = []
        for _ in range(N_DECODE):
            tokens.append(int(np.argmax(logits)))
            logits = engine.decode(tokens[-1])
        return tokens, engine.streamer.trace, engine.streamer.decisions


CACHES = {"fast": False, "reference": True}  # Config.reference_cache


@pytest.fixture(scope="module")
def undelayed(model):
    return {(name, cache): run(model, c.replace(reference_cache=ref), None)
            for name, c in CONFIGS.items() for cache, ref in CACHES.items()}


@pytest.mark.parametrize("name", list(CONFIGS))
def test_the_fast_cache_and_the_reference_machine_agree(undelayed, name):
    assert undelayed[(name, "fast")] == undelayed[(name, "reference")]


@pytest.mark.parametrize("cache", list(CACHES))
@pytest.mark.parametrize("name", list(CONFIGS))
@settings(max_examples=6, deadline=None)
@given(seed=st.integers(0, 2**32 - 1))
def test_random_io_timing_changes_no_decision_and_no_token(model, undelayed, name, cache, seed):
    config = CONFIGS[name].replace(reference_cache=CACHES[cache])
    tokens, trace, decisions = run(model, config, RandomDelays(seed, max_ms=1.0))
    want_tokens, want_trace, want_decisions = undelayed[(name, cache)]
    assert tokens == want_tokens
    assert trace == want_trace  # the turns (routing and guesses) the machine was fed
    assert decisions == want_decisions  # Read, Cancel, Evict, Use: slot for slot
