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


def draws(logits, n=400, **kw):
    cfg = SamplerConfig(temperature=1.0, seed=5, **kw)
    return {sample(np.asarray(logits, np.float32), cfg, i) for i in range(n)}


def test_top_k_keeps_the_k_most_probable():
    logits = np.log([0.3, 0.25, 0.2, 0.15, 0.1])
    assert draws(logits, top_k=2) == {0, 1}
    assert draws(logits, top_k=0) == {0, 1, 2, 3, 4}  # 0: off


def test_min_p_keeps_tokens_near_the_most_probable():
    logits = np.log([0.5, 0.3, 0.12, 0.08])
    assert draws(logits, min_p=0.2) == {0, 1, 2}  # 0.08 < 0.2 x 0.5
    assert draws(logits, min_p=0.9) == {0}  # the most probable always stays


def test_top_p_applies_to_what_top_k_kept():
    from strata.reference.sampling import filtered_probs

    logits = np.log(np.array([0.4, 0.3, 0.2, 0.1], np.float32))
    ids, p = filtered_probs(logits, SamplerConfig(temperature=1.0, top_k=2, top_p=0.5))
    assert list(ids) == [0] and p.tolist() == [1.0]  # 0.4 / 0.7 >= 0.5: the renormalized nucleus
    ids, p = filtered_probs(logits, SamplerConfig(temperature=1.0, top_k=3))
    assert list(ids) == [0, 1, 2] and abs(p.sum() - 1) < 1e-12


def test_repeat_penalty_lowers_seen_tokens_even_when_greedy():
    from strata.reference.sampling import penalize

    logits = np.array([2.0, 1.75, -1.0, 0.5], np.float32)  # exact in float32
    assert sample(logits, SamplerConfig(), 0, history=[0]) == 0  # penalty off
    assert sample(logits, SamplerConfig(repeat_penalty=1.2), 0, history=[0, 0, 3]) == 1
    out = penalize(logits, [0, 2, 2], 2.0, window=64)
    assert out.tolist() == [1.0, 1.75, -2.0, 0.5]  # positive / penalty, negative x penalty, once per token
    assert penalize(logits, [0, 1, 3], 2.0, window=1).tolist() == [2.0, 1.75, -1.0, 0.25]  # only the last one
    assert logits.tolist() == [2.0, 1.75, -1.0, 0.5]  # pure: the input is untouched


def test_defaults_keep_the_old_draws():
    """All filters off: the draw of a step is what it was before they existed (same generator,
    same candidate order, same probabilities)."""
    rng = np.random.default_rng(0)
    for step in range(50):
        logits = rng.normal(size=40).astype(np.float32)
        cfg = SamplerConfig(temperature=0.8, top_p=0.9, seed=11)
        probs = np.exp(log_softmax(logits / np.float32(0.8)).astype(np.float64))
        order = np.argsort(-probs, kind="stable")
        keep = int(np.searchsorted(np.cumsum(probs[order]), 0.9) + 1)
        order = order[:keep]
        old = int(order[np.random.default_rng([11, step]).choice(keep, p=probs[order] / probs[order].sum())])
        assert sample(logits, cfg, step) == old


def test_repeat_penalty_breaks_the_embedded_models_greedy_loop():
    import strata

    with strata.load() as model:
        plain = strata.generate(model, "def f(x):", max_tokens=48)
        penalized = strata.generate(model, "def f(x):", max_tokens=48, repeat_penalty=1.3)
    distinct = lambda toks: len(set(toks)) / len(toks)
    assert distinct(penalized.tokens) > distinct(plain.tokens)


def test_frequency_and_presence_penalties_follow_openais_definition():
    from strata.reference.sampling import penalize_counts

    logits = np.array([2.0, 1.5, -1.0, 0.5], np.float32)
    generated = [0, 0, 0, 2]  # c = [3, 0, 1, 0]
    # mu[j] - c[j] * frequency - (c[j] > 0) * presence
    assert penalize_counts(logits, generated, 0.5, 0.0).tolist() == [0.5, 1.5, -1.5, 0.5]
    assert penalize_counts(logits, generated, 0.0, 0.25).tolist() == [1.75, 1.5, -1.25, 0.5]
    assert penalize_counts(logits, generated, -0.5, 0.0).tolist() == [3.5, 1.5, -0.5, 0.5]  # negative: favoured
    assert logits.tolist() == [2.0, 1.5, -1.0, 0.5]  # pure
    # the prompt does not count: only `generated` does, while the repetition penalty reads `history`
    cfg = SamplerConfig(presence_penalty=1.0)
    assert sample(logits, cfg, 0, history=[0, 0], generated=[]) == 0
    assert sample(logits, cfg, 0, history=[0, 0], generated=[0]) == 1


@pytest.mark.parametrize("kw", [dict(frequency_penalty=2.5), dict(presence_penalty=-2.01),
                                dict(frequency_penalty=float("nan"))])
def test_openai_penalties_outside_their_range_are_rejected(kw):
    with pytest.raises(ValueError, match=next(iter(kw))):
        SamplerConfig(**kw)
