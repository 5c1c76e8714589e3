"""The prompt path: chunked prefill, a layer's union in several passes when it does not fit,
held region released at both edges, and the same tokens as the all-resident reference."""

import numpy as np
import pytest

import strata
from strata.config import Config
from strata.numpy_backend.engine import ReferenceEngine
from strata.cache.state import LIMBO
from strata.runtime.decode import arena_plan_for
from strata.testing.engines import open_numpy_streaming
from strata.testing.faults import RandomDelays
from strata.testing.models import make_model
from tests.budgets import FLOAT32_REORDER

PROMPT = "The quick brown fox jumps over the lazy dog; " * 2


@pytest.fixture(scope="module")
def model(tmp_path_factory):
    made = make_model(tmp_path_factory.mktemp("pr") / "small", "small", seed=2)
    return strata.load(made.model_path)


@pytest.fixture(scope="module")
def reference(model):
    engine = ReferenceEngine(model.resident_params())
    first = engine.prefill(model.tokenizer.encode(PROMPT))
    return first, [int(np.argmax(engine.decode(t))) for t in (65, 66, 67)]


@pytest.mark.parametrize("chunk", [1, 7, 64])
def test_chunked_prefill_in_passes_matches_the_reference(model, reference, chunk):
    config = Config(moce_lambda=0.0, prefill_chunk=chunk, prefetch=2)  # 20 slots for 32 experts a layer
    least = arena_plan_for(model, config.replace(arena="9999slots")).min_slots
    with open_numpy_streaming(model, config.replace(arena=f"{least}slots"), hook=RandomDelays(4, 0.5)) as e:
        logits = e.prefill(model.tokenizer.encode(PROMPT))
        totals = e.streamer.totals
        assert not (np.asarray(e.streamer.state.slot_state) == LIMBO).any()  # released at the edge
        decoded = [int(np.argmax(e.decode(t))) for t in (65, 66, 67)]
        assert e.length == len(PROMPT) + 3
    n_chunks = -(-len(PROMPT) // chunk)
    assert totals.windows == n_chunks and totals.prompt_turns == n_chunks * model.cfg.n_layers
    if chunk >= 64:  # a union of 64 positions' experts does not fit the smallest arena
        assert totals.prompt_passes > totals.prompt_turns
    if chunk >= len(PROMPT):
        np.testing.assert_array_equal(logits, reference[0])
    else:
        np.testing.assert_allclose(logits, reference[0], **FLOAT32_REORDER)
    assert int(np.argmax(logits)) == int(np.argmax(reference[0])) and decoded == reference[1]


def test_prompt_counts_stay_out_of_the_decode_report(model):
    config = Config(arena="60slots", prefill_chunk=16)
    with open_numpy_streaming(model, config) as e:
        e.prefill(model.tokenizer.encode(PROMPT))
        r0 = e.report()
        assert r0.tokens == 0 and r0.reads_per_token == 0 and r0.prompt_reads > 0
        e.decode(70)
        r1 = e.report()
        assert r1.tokens == 1 and r1.prompt_reads == r0.prompt_reads
