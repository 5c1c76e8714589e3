"""The public API: load, generate, stream_generate, on a made model written to disk."""

import sys
import numpy as np
import pytest

import strata
from strata.errors import ContextLimitError, StrataError
from strata.reference.model import ModelState, forward
from strata.testing.models import make_model


@pytest.fixture(scope="module")
def model(tmp_path_factory):
    made = make_model(tmp_path_factory.mktemp("m") / "tiny", "tiny", seed=3)
    return strata.load(made.model_path)


def test_stream_generate_yields_typed_responses(model):
    responses = list(strata.stream_generate(model, "hello", max_tokens=6))
    assert len(responses) == 6
    assert [r.generation_tokens for r in responses] == list(range(1, 7))
    assert all(isinstance(r, strata.GenerationResponse) for r in responses)
    assert [r.finish_reason for r in responses] == [None] * 5 + ["length"]
    assert all(r.logprob <= 0.0 and r.prompt_tokens == 5 for r in responses)


def test_greedy_tokens_equal_the_reference_forward(model):
    """generate's greedy tokens are argmax of the reference forward over the whole sequence."""
    result = strata.generate(model, "abc", max_tokens=5)
    params = model.resident_params()
    seq = model.tokenizer.encode("abc") + result.tokens
    logits, _ = forward(params, ModelState.empty(model.cfg), np.array(seq))
    expected = np.argmax(logits[2:-1], axis=-1).tolist()
    assert result.tokens == expected


def test_generate_text_is_the_concatenation_of_the_stream(model):
    text = "".join(r.text for r in strata.stream_generate(model, "xyz", max_tokens=8, temperature=0.9, seed=4))
    assert strata.generate(model, "xyz", max_tokens=8, temperature=0.9, seed=4).text == text


def test_seeded_sampling_is_reproducible(model):
    a = strata.generate(model, "q", max_tokens=10, temperature=1.0, seed=1).tokens
    b = strata.generate(model, "q", max_tokens=10, temperature=1.0, seed=1).tokens
    c = strata.generate(model, "q", max_tokens=10, temperature=1.0, seed=2).tokens
    assert a == b and a != c


def test_prompt_longer_than_context_is_a_clear_error(model):
    with pytest.raises(ContextLimitError, match=f"context is {model.cfg.max_context}"):
        strata.generate(model, "x" * model.cfg.max_context, max_tokens=1)


def test_generation_stops_at_the_context_limit(model):
    limit = model.cfg.max_context
    responses = list(strata.stream_generate(model, [65] * (limit - 3), max_tokens=50))
    assert responses[-1].finish_reason == "context"
    assert responses[-1].prompt_tokens + len(responses) == limit + 1


def test_empty_prompt_is_an_error(model):
    with pytest.raises(StrataError, match="empty"):
        strata.generate(model, "", max_tokens=1)


@pytest.mark.parametrize("gpu, expert_type, expected", [
    (False, "Q2_0", "numpy"), (True, "Q2_0", "mlx"), (True, "Q4_0", "numpy"),
])
def test_auto_backend_is_mlx_only_on_a_gpu_with_q2_0_experts(tmp_path, monkeypatch, gpu, expert_type, expected):
    import strata.engines as gen
    from strata.config import Backend, Config
    from strata.formats.quant_types import QuantType

    made = make_model(tmp_path / "m", "tiny", expert_type=QuantType[expert_type])
    monkeypatch.setattr(gen, "mlx_gpu_available", lambda: gpu)
    model = strata.load(made.model_path)
    assert gen.resolve_backend(model, Config()) is Backend(expected)
    assert gen.resolve_backend(model, Config(backend=Backend.NUMPY)) is Backend.NUMPY


def test_no_gpu_here_means_auto_runs_numpy(model):
    import strata.engines as gen
    from strata.config import Config

    if gen.mlx_gpu_available():
        pytest.skip("this machine has an MLX GPU")
    assert gen.resolve_backend(model, Config()).value == "numpy"
