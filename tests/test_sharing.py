"""One Model shared by threads and interleaved iterators (strata/sharing.py): every call gives
exactly what the same call gives alone, token for token, or ends in the documented refusal
(SessionBusyError, only where the engine takes turns: a streaming engine's single arena)."""

from __future__ import annotations

import threading

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

import strata
from strata.config import Backend
from strata.engines import close_session
from strata.errors import SessionBusyError
from strata.testing.models import make_model
from strata.testing.sharing import REFUSED, call_kwargs, run_interleaved, run_threads
from engine_kinds import EXACT0, min_slots  # noqa: E402
from tests.strategies import SHARED_PROMPTS, interleavings

MODES = ["resident", "streaming-min"]  # the reference engine (snapshots); numpy streaming at the smallest arena
EXAMPLES = 30  # each example is a few tiny-model generations: enough interleavings, seconds per test


@pytest.fixture(scope="module")
def made(tmp_path_factory):
    return make_model(tmp_path_factory.mktemp("share") / "tiny", "tiny", seed=5)


@pytest.fixture(scope="module", params=MODES)
def shared(request, made):
    """(model shared by the calls, config, the result of each call made alone)."""
    model = strata.load(made.model_path)
    alone_model = strata.load(made.model_path)
    config = EXACT0.replace(backend=Backend.NUMPY)
    if request.param == "streaming-min":
        config = config.replace(arena=f"{min_slots(model, config)}slots")
    alone: dict = {}

    def expected(call) -> list[int]:
        key = call[1:]
        if key not in alone:  # one at a time, on a model of its own
            alone[key] = strata.generate(alone_model, **call_kwargs(call, SHARED_PROMPTS), config=config).tokens
        return alone[key]

    yield model, config, expected, request.param
    model.close()
    alone_model.close()


def check(outcomes, calls, expected, mode) -> None:
    for call, got in zip(calls, outcomes):
        if got == REFUSED:
            assert mode == "streaming-min", "an engine that takes snapshots never refuses"
        else:
            assert got == expected(call), call


@settings(max_examples=EXAMPLES, deadline=None)
@given(plan=interleavings())
def test_iterators_interleaved_on_one_thread_equal_each_call_alone(shared, plan):
    model, config, expected, mode = shared
    calls, schedule = plan
    check(run_interleaved(model, config, calls, schedule, SHARED_PROMPTS), calls, expected, mode)


@settings(max_examples=EXAMPLES // 2, deadline=None)
@given(plans=st.lists(interleavings(max_calls=3, max_steps=12), min_size=2, max_size=3))
def test_threads_each_interleaving_equal_each_call_alone(shared, plans):
    """Threads share the model, each interleaving calls of its own: a call from another thread
    waits for its turn (never refused); only a thread's own second iterator can be."""
    model, config, expected, mode = shared
    results, errors, finished = run_threads(model, config, plans, SHARED_PROMPTS, timeout=120)
    assert finished, "a thread hung"
    assert not errors, errors
    for (calls, _), outcomes in zip(plans, results):
        check(outcomes, calls, expected, mode)


def test_a_second_iterator_on_one_thread_interleaves_or_is_refused_in_one_line(shared):
    """Resident: the two interleave, each exact. Streaming: the second is refused in one line
    naming the fix, and once the first is closed the session serves it."""
    model, config, expected, mode = shared
    first = strata.stream_generate(model, SHARED_PROMPTS[0], max_tokens=3, config=config)
    got = [next(first).token]
    second = strata.stream_generate(model, SHARED_PROMPTS[1], max_tokens=3, config=config)
    if mode == "resident":
        pairs = [(next(second).token, next(first).token), (next(second).token, next(first).token)]
        got += [b for _, b in pairs]
        assert [a for a, _ in pairs] + [r.token for r in second] == expected((False, 1, 3, 0.0, 0))
        assert got == expected((False, 0, 3, 0.0, 0))
        return
    with pytest.raises(SessionBusyError, match=r"close\(\) that iterator first.*strata\.open_engine") as err:
        next(second)
    assert "\n" not in str(err.value)
    first.close()  # the fix it names: the session is free again
    assert strata.generate(model, SHARED_PROMPTS[1], max_tokens=3, config=config).tokens == expected(
        (True, 1, 3, 0.0, 0))


def test_the_named_fix_a_second_engine_gives_the_call_alone(shared):
    model, config, expected, mode = shared
    first = strata.stream_generate(model, SHARED_PROMPTS[0], max_tokens=4, config=config)
    tokens = [next(first).token]
    with strata.open_engine(model, config) as own:
        assert strata.generate(own, SHARED_PROMPTS[2], max_tokens=4).tokens == expected((True, 2, 4, 0.0, 0))
    tokens += [r.token for r in first]
    assert tokens == expected((True, 0, 4, 0.0, 0))


def test_a_change_outside_the_calls_is_refused_not_computed_over(shared):
    model, config, expected, mode = shared
    it = strata.stream_generate(model, SHARED_PROMPTS[0], max_tokens=4, config=config)
    next(it)
    model.session.trim(0)  # the session changed under the suspended iterator
    with pytest.raises(SessionBusyError, match="changed outside this stream_generate call"):
        next(it)
    assert strata.generate(model, SHARED_PROMPTS[0], max_tokens=4, config=config).tokens == expected(
        (True, 0, 4, 0.0, 0))


def test_another_config_waits_for_the_session_or_is_refused_on_its_own_thread(shared):
    model, config, expected, mode = shared
    it = strata.stream_generate(model, SHARED_PROMPTS[0], max_tokens=3, config=config)
    next(it)
    with pytest.raises(SessionBusyError, match="config differs"):
        strata.generate(model, SHARED_PROMPTS[1], max_tokens=2, config=config.replace(prefill_chunk=7))
    other: list = []
    waiter = threading.Thread(target=lambda: other.append(
        strata.generate(model, SHARED_PROMPTS[1], max_tokens=2, config=config.replace(prefill_chunk=7)).tokens))
    waiter.start()
    waiter.join(timeout=0.2)
    assert waiter.is_alive()  # it waits for the iterator, which still runs on the old engine
    assert [r.token for r in it] == expected((True, 0, 3, 0.0, 0))[1:]
    waiter.join(timeout=60)
    assert not waiter.is_alive() and len(other) == 1
    close_session(model)
