import numpy as np
import pytest

from strata.reference.sampling import SamplerConfig, log_softmax, sample


def test_greedy_is_argmax():
    logits = np.array([0.1, 3.0, -1.0, 2.9], np.float32)
    assert sample(logits, SamplerConfig(), 0) == 1


def test_seeded_sampling_is_reproducible_and_varies_with_seed():
    logits = np.zeros(50, np.float32)
    a = [sample(logits, SamplerConfig(temperature=1.0, seed=7), n) for n in range(40)]
    b = [sample(logits, SamplerConfig(temperature=1.0, seed=7), n) for n in range(40)]
    c = [sample(logits, SamplerConfig(temperature=1.0, seed=8), n) for n in range(40)]
    assert a == b and a != c


def test_top_p_keeps_only_the_nucleus():
    logits = np.log(np.array([0.5, 0.3, 0.15, 0.05], np.float32))
    seen = {sample(logits, SamplerConfig(temperature=1.0, top_p=0.7, seed=1), n) for n in range(300)}
    assert seen == {0, 1}


def test_sampling_frequencies_follow_probabilities():
    probs = np.array([0.6, 0.3, 0.1])
    draws = [sample(np.log(probs).astype(np.float32), SamplerConfig(temperature=1.0, seed=3), n) for n in range(3000)]
    freq = np.bincount(draws, minlength=3) / 3000
    assert np.all(np.abs(freq - probs) < 0.04)  # ~4 standard errors at n=3000


def test_log_softmax_normalizes():
    lp = log_softmax(np.array([1.0, 2.0, 3.0], np.float32))
    assert abs(np.exp(lp).sum() - 1.0) < 1e-6


@pytest.mark.parametrize("kw", [dict(temperature=-1.0), dict(top_p=0.0), dict(top_p=1.5)])
def test_bad_sampler_values_are_rejected(kw):
    with pytest.raises(ValueError):
        SamplerConfig(**kw)
