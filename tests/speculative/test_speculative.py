"""strata.speculative's pure parts: the suffix drafter, acceptance (greedy and speculative
sampling, statistically), the gate's decisions on made costs."""

from __future__ import annotations

import numpy as np
import pytest
from scipy.stats import chisquare

from strata.config import Config
from strata.errors import ConfigError
from strata.reference.sampling import SamplerConfig, probabilities
from strata.speculative import Draft, SuffixDrafter, drafter_for
from strata.speculative.acceptance import accept, accept_greedy
from strata.speculative.gate import GATE_SPAN, MIN_SAMPLES, PROBE_EVERY, RETRY_AFTER, Gate, WindowCost
from tests.budgets import CHI_SQUARE_P

# ---------------------------------------------------------------- the suffix drafter


def test_suffix_drafter_proposes_what_followed_the_longest_match():
    d = SuffixDrafter(3)
    d.start(list(b"def f(x): return x\ndef g(x): ret"))
    assert bytes(d.draft(3).tokens) == b"urn"
    d.extend(list(b"urn x\ndef g"))
    assert bytes(d.draft(3).tokens) == b"(x)"
    d.extend(list(b"(y): ret"))
    assert bytes(d.draft(3).tokens) == b"urn" and bytes(d.draft(1).tokens) == b"u" and len(d.draft(0)) == 0
    d.extend(list(b"urn y\nclass"))
    assert d.draft(3) == Draft()  # "ss" never seen before: no suffix of 2 tokens matches


def test_suffix_drafter_walks_its_own_draft_and_stops_without_a_match():
    d = SuffixDrafter(2)
    d.start([1, 2, 3, 4, 1, 2])
    assert d.draft(5).tokens == (3, 4)  # depth caps the draft
    d.start([5, 6, 7, 8])
    assert d.draft(2) == Draft()  # no 2-gram repeats: nothing to propose


def test_suffix_drafter_prefers_the_more_frequent_continuation_then_the_latest():
    d = SuffixDrafter(1)
    d.start([1, 2, 9, 1, 2, 9, 1, 2, 7, 1, 2])
    assert d.draft(1).tokens == (9,)  # 9 twice, 7 once
    d.start([1, 2, 9, 1, 2, 7, 1, 2])
    assert d.draft(1).tokens == (7,)  # once each: the latest


def test_config_names_the_drafter_and_grows_the_window():
    assert drafter_for(Config()) is None
    c = Config(suffix_draft=2)
    assert c.window == 3 and drafter_for(c).depth == 2
    assert Config(suffix_draft=1, window=4).window == 4
    with pytest.raises(ConfigError, match="suffix_draft"):
        Config(suffix_draft=4)


# ---------------------------------------------------------------- acceptance


def test_greedy_acceptance_keeps_the_argmax_chain():
    logits = np.full((4, 5), -1.0, np.float32)
    for row, best in enumerate([2, 0, 4, 1]):
        logits[row, best] = 1.0
    assert accept_greedy((2, 0, 4), logits).__dict__ == {"accepted": 3, "token": 1}
    assert accept_greedy((2, 3, 4), logits).__dict__ == {"accepted": 1, "token": 0}
    assert accept_greedy((1, 0, 4), logits).__dict__ == {"accepted": 0, "token": 2}


def _first_token_counts(draft_of, logits, sampler, draws):
    counts = np.zeros(logits.shape[-1], np.int64)
    for s in range(draws):
        draft = draft_of(s)
        v = accept(draft, logits[: len(draft) + 1], SamplerConfig(sampler.temperature, sampler.top_p, seed=s), 0)
        counts[draft.tokens[0] if v.accepted else v.token] += 1
    return counts


@pytest.mark.parametrize("top_p", [1.0, 0.8])
def test_speculative_sampling_preserves_the_distribution(top_p):
    """The first decided token is distributed as the sampler's p, whether the draft is a point
    mass on a likely token, on an unlikely one, or drawn from another distribution q."""
    rng = np.random.default_rng(0)
    vocab, draws = 12, 6000
    logits = rng.normal(0, 1.5, (2, vocab)).astype(np.float32)  # rows: after t, after t d1
    sampler = SamplerConfig(temperature=0.8, top_p=top_p)
    p = probabilities(logits[0], sampler)
    q = rng.dirichlet(np.ones(vocab))
    drafts = {
        "likely": lambda s: Draft((int(np.argmax(p)),)),
        "unlikely": lambda s: Draft((int(np.argmin(p)),)),
        "sampled q": lambda s: Draft((int(np.random.default_rng([s, 9]).choice(vocab, p=q)),), q[None]),
    }
    for name, draft_of in drafts.items():
        counts = _first_token_counts(draft_of, logits, sampler, draws)
        keep = p > 0
        assert counts[~keep].sum() == 0, f"{name}: a token outside top-p was handed out"
        expected = p[keep] * draws
        assert chisquare(counts[keep], expected).pvalue > CHI_SQUARE_P, f"{name}: {counts} vs {expected.round()}"


# ---------------------------------------------------------------- the gate


def _feed(gate, spec: WindowCost, plain: WindowCost, windows: int) -> None:
    for i in range(windows):
        gate.record(spec if gate.wants_draft() else plain, at_token=i)


def test_the_gate_stays_on_while_speculation_pays():
    gate = Gate()
    _feed(gate, WindowCost(3, 2, 0.015, 0), WindowCost(1, 1, 0.010, 0), 4 * GATE_SPAN)
    assert gate.on and gate.events == []
    assert len(gate.plain) >= MIN_SAMPLES  # the forced plain windows keep a baseline


def test_a_preempted_window_does_not_switch_the_gate_off():
    gate, spec, plain = Gate(), WindowCost(3, 2, 0.018, 0), WindowCost(1, 1, 0.010, 0)
    _feed(gate, spec, plain, PROBE_EVERY * MIN_SAMPLES)
    gate.record(WindowCost(3, 2, 0.500, 0), at_token=0)  # 25x: the host ran something else
    _feed(gate, spec, plain, PROBE_EVERY * MIN_SAMPLES)
    assert gate.on and gate.events == []


def test_the_gate_switches_off_when_bytes_per_token_grow_and_says_so():
    gate = Gate()
    _feed(gate, WindowCost(3, 2, 0.010, 3000), WindowCost(1, 1, 0.010, 1000), PROBE_EVERY * (MIN_SAMPLES + 2))
    assert not gate.on and gate.events and gate.events[0].startswith("off at token")
    assert not gate.wants_draft()


def test_the_gate_tries_again_after_plain_windows():
    gate, spec, plain = Gate(), WindowCost(2, 1, 0.030, 0), WindowCost(1, 1, 0.010, 0)
    _feed(gate, spec, plain, PROBE_EVERY * (MIN_SAMPLES + 2))
    assert not gate.on
    off_for = 0
    while not gate.on:
        assert not gate.wants_draft()
        gate.record(plain, at_token=0)
        off_for += 1
    assert off_for <= RETRY_AFTER and "on again" in gate.events[-1]
    _feed(gate, spec, plain, PROBE_EVERY * (MIN_SAMPLES + 2))  # still losing: off again, judged on fresh samples
    assert not gate.on and gate.events[-1].startswith("off at token")


def test_a_disabled_gate_always_drafts():
    gate = Gate(enabled=False)
    _feed(gate, WindowCost(2, 1, 0.030, 0), WindowCost(1, 1, 0.010, 0), 4 * GATE_SPAN)
    assert gate.wants_draft() and gate.events == [] and gate.verdict() is None  # no plain baseline taken
