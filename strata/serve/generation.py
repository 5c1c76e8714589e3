"""One request's generation, independent of the API that asked for it.

An endpoint turns its request into a `Plan` (prompt tokens, sampling, stop sequences, whether
tools were offered) and iterates `run(state, plan)`: `Piece`s of text as they become safe to
show (past any stop-sequence prefix, before any tool call), a `KEEPALIVE` while nothing is
ready yet, and one `Outcome` at the end. Leaving the loop early (the client disconnected)
cancels the job, which the worker stops after the token in flight.
"""

from __future__ import annotations

import dataclasses
import enum
import secrets
import time
from dataclasses import dataclass
from typing import AsyncIterator

from strata.reference.sampling import OPENAI_PENALTY_RANGE
from strata.serve.fields import Fields
from strata.serve.state import ServerState
from strata.stop_strings import StopMatcher
from strata.serve.tool_calls import ToolCall, ToolCallSplitter
from strata.serve.worker import Done, Failed, Job, Sampling, Started, Token

MAX_STOP_SEQUENCES = 16
SEED_LIMIT = 2**63  # numpy's generators take any non-negative int; JSON clients keep to 64 bits


class Finish(enum.Enum):
    STOP = "stop"  # the model ended its turn (an end-of-text token)
    LENGTH = "length"  # max_tokens, or the model's context is full
    STOP_SEQUENCE = "stop_sequence"
    TOOL_CALLS = "tool_calls"


@dataclass(frozen=True)
class Plan:
    tokens: list[int]
    sampling: Sampling
    stop: tuple[str, ...] = ()
    tools: bool = False  # tools were offered: parse tool calls out of the text
    logprobs: bool = False
    call_id_prefix: str = "call_"


@dataclass(frozen=True)
class TokenLogprob:
    token: str
    logprob: float


@dataclass(frozen=True)
class Piece:
    text: str
    logprobs: tuple[TokenLogprob, ...] = ()  # the tokens behind this text (when asked for)


@dataclass(frozen=True)
class Outcome:
    text: str  # everything shown, tool-call blocks excluded
    tool_calls: list[ToolCall]
    finish: Finish
    stop_sequence: str | None
    prompt_tokens: int
    prompt_reused: int  # of them, served from the session
    completion_tokens: int
    logprobs: tuple[TokenLogprob, ...]
    strata: dict  # the per-request extension field: reuse, seed, timings, the stream report


class GenerationFailed(Exception):
    """The engine raised during generation (a failed expert read, ...): a server-side error."""


KEEPALIVE = object()


def read_sampling(f: Fields, *, max_tokens: int, temperature_hi: float, default_temperature: float = 1.0,
                  openai_penalties: bool = False) -> Sampling:
    """temperature, top_p, top_k, min_p, repeat_penalty and seed (a random one when absent; the
    response names it): the sampling of `strata generate`, field for field. `openai_penalties`:
    also OpenAI's frequency_penalty and presence_penalty ([-2, 2], 0: off)."""
    top_p = f.number("top_p", 1.0, lo=0.0, hi=1.0)
    if top_p == 0.0:  # a nucleus of no mass keeps nothing
        raise f.error("top_p", "must be in (0, 1]; for the most likely token use temperature 0")
    min_p = f.number("min_p", 0.0, lo=0.0, hi=1.0)
    if min_p == 1.0:  # only tokens as probable as the most probable one: use temperature 0
        raise f.error("min_p", "must be in [0, 1) (0: off), got 1")
    repeat_penalty = f.number("repeat_penalty", 1.0, lo=0.0)
    if repeat_penalty == 0.0:
        raise f.error("repeat_penalty", "must be a number > 0 (1: off), got 0")
    lo, hi = OPENAI_PENALTY_RANGE
    penalties = {name: f.number(name, 0.0, lo=lo, hi=hi) for name in ("frequency_penalty", "presence_penalty")} \
        if openai_penalties else {}
    return Sampling(
        max_tokens=max_tokens,
        temperature=f.number("temperature", default_temperature, lo=0.0, hi=temperature_hi),
        top_p=top_p,
        seed=f.int("seed", secrets.randbelow(2**31), lo=0, hi=SEED_LIMIT - 1),
        top_k=f.int("top_k", 0, lo=0),
        min_p=min_p,
        repeat_penalty=repeat_penalty,
        **penalties,
    )


def read_stops(f: Fields, key: str, *, single: bool = True) -> tuple[str, ...]:
    return f.strings(key, most=MAX_STOP_SEQUENCES, single=single)


async def run(state: ServerState, plan: Plan) -> AsyncIterator[Piece | Outcome | object]:
    job = Job(plan.tokens, plan.sampling)
    state.worker.submit(job)
    stopper = StopMatcher(plan.stop + tuple(s for s in state.stops if s not in plan.stop))
    splitter = ToolCallSplitter(id_prefix=plan.call_id_prefix) if plan.tools else None
    tokenizer = state.model.tokenizer
    shown, pending, every, calls = [], [], [], []
    queue_seconds, first_at, last, finished = 0.0, None, None, False
    try:
        while True:
            event = await job.next_event(state.keepalive_seconds)
            if event is None:
                yield KEEPALIVE
                continue
            if isinstance(event, Started):
                queue_seconds = event.queue_seconds
                continue
            if isinstance(event, Failed):
                state.metrics.failed += 1
                finished = True  # the worker has moved on; nothing to cancel
                raise GenerationFailed(f"generation failed: {type(event.error).__name__}: {event.error}")
            if isinstance(event, Done):  # the generator ended without a final response
                break
            assert isinstance(event, Token)
            r = last = event.response
            first_at = first_at or time.perf_counter()
            if plan.logprobs:
                pending.append(TokenLogprob(tokenizer.decode([r.token]), r.logprob))
            text = stopper.feed(r.text)
            if stopper.stopped is None and r.finish_reason is not None:
                text += stopper.flush()
            done = stopper.stopped is not None or r.finish_reason is not None
            if splitter is not None:
                text = splitter.feed(text)
                if done:
                    tail, calls = splitter.finish()
                    text += tail
            if text or (done and pending):
                shown.append(text)
                every += pending
                yield Piece(text, tuple(pending))
                pending = []
            if done:
                break
        if stopper.stopped is not None:
            job.cancel()  # the worker stops after the token in flight
        outcome = _outcome(plan, job, last, "".join(shown), calls, stopper.stopped, tuple(every),
                           queue_seconds, first_at)
        _record(state, outcome, last, job, first_at, queue_seconds)
        finished = True
        yield outcome
    finally:
        if not finished:  # the consumer left: the client disconnected
            job.cancel()
            state.metrics.cancelled += 1


def _outcome(plan: Plan, job: Job, last, text: str, calls: list[ToolCall], stop_sequence: str | None,
             logprobs: tuple[TokenLogprob, ...], queue_seconds: float, first_at: float | None) -> Outcome:
    if calls:
        finish = Finish.TOOL_CALLS
    elif stop_sequence is not None:
        finish = Finish.STOP_SEQUENCE
    elif last is not None and last.finish_reason == "stop":
        finish = Finish.STOP
    else:
        finish = Finish.LENGTH
    reused = last.prompt_reused if last is not None else 0
    report = last.report if last is not None else None
    cache = last.cache if last is not None else None
    extension = {
        "prompt_reused": reused,
        "seed": plan.sampling.seed,
        "queue_ms": round(1e3 * queue_seconds, 3),
        "ttft_ms": round(1e3 * (first_at - job.submitted), 3) if first_at else None,
        "prompt_tps": last.prompt_tps if last is not None else 0.0,
        "generation_tps": last.generation_tps if last is not None else 0.0,
        "finish_reason": last.finish_reason if last is not None else None,  # strata's: stop, length, context
        "report": report.to_dict() if report is not None else None,  # the stream report; None all-resident
        "cache": _cache_dict(cache),  # the engine's cumulative cache counts; None all-resident
    }
    return Outcome(text=text, tool_calls=calls, finish=finish, stop_sequence=stop_sequence,
                   prompt_tokens=len(plan.tokens), prompt_reused=reused,
                   completion_tokens=last.generation_tokens if last is not None else 0,
                   logprobs=logprobs, strata=extension)


def _cache_dict(cache) -> dict | None:
    if cache is None:
        return None
    d = dataclasses.asdict(cache)
    d["urgent_misses_by_rank"] = list(d["urgent_misses_by_rank"])
    return d


def _record(state: ServerState, outcome: Outcome, last, job: Job, first_at: float | None,
            queue_seconds: float) -> None:
    now = time.perf_counter()
    state.metrics.record(
        prompt_tokens=outcome.prompt_tokens, prompt_reused=outcome.prompt_reused,
        generated=outcome.completion_tokens, ttft_seconds=(first_at or now) - job.submitted,
        generation_seconds=now - (first_at or now), queue_seconds=queue_seconds,
        prompt_tps=last.prompt_tps if last is not None else 0.0,
        generation_tps=last.generation_tps if last is not None else 0.0,
        report=last.report if last is not None else None,
    )
