"""Calls sharing one Model, as the sharing tests and the API fuzz make them (strata/sharing.py
says what they must give): a call is (whole, prompt, max_tokens, temperature, seed); `whole`
calls `generate`, else a `stream_generate` iterator is advanced one token at a time."""

from __future__ import annotations

import threading

import strata
from strata.errors import SessionBusyError

__all__ = ["REFUSED", "call_kwargs", "run_interleaved", "run_threads"]

REFUSED = "refused"  # a call that ended in SessionBusyError before its first token


def call_kwargs(call: tuple, prompts) -> dict:
    _, prompt, max_tokens, temperature, seed = call
    return dict(prompt=prompts[prompt], max_tokens=max_tokens, temperature=temperature, seed=seed)


def run_interleaved(model, config, calls: list[tuple], schedule: list[int], prompts) -> list:
    """Make `calls` on this thread, advancing them in `schedule`'s order (an index taken modulo
    len(calls)), then each unfinished one to its end: each call's tokens, or REFUSED. Any other
    error propagates; a call refused after its first token is an AssertionError."""
    out: list = [[] for _ in calls]
    live: dict = {}
    ended: set[int] = set()

    def advance(i: int) -> None:
        kwargs = call_kwargs(calls[i], prompts)
        try:
            if calls[i][0]:
                out[i] = strata.generate(model, **kwargs, config=config).tokens
                ended.add(i)
                return
            it = live.setdefault(i, strata.stream_generate(model, **kwargs, config=config))
            out[i].append(next(it).token)
        except StopIteration:
            ended.add(i)
        except SessionBusyError:
            if out[i]:
                raise AssertionError(f"call {i} refused after {len(out[i])} tokens") from None
            out[i] = REFUSED
            ended.add(i)

    for pick in schedule:
        if pick % len(calls) not in ended:
            advance(pick % len(calls))
    for i in range(len(calls)):
        while i not in ended:
            advance(i)
    return out


def run_threads(model, config, plans: list[tuple[list, list]], prompts, timeout: float) -> tuple[list, list, bool]:
    """One thread per (calls, schedule) plan, each run_interleaved: (each plan's outcomes or None,
    the errors raised, whether every thread finished within `timeout` seconds)."""
    results: list = [None] * len(plans)
    errors: list = []

    def worker(k: int) -> None:
        try:
            results[k] = run_interleaved(model, config, *plans[k], prompts)
        except BaseException as e:  # noqa: BLE001 - reported to the caller
            errors.append(e)

    threads = [threading.Thread(target=worker, args=(k,), daemon=True) for k in range(len(plans))]
    for t in threads:
        t.start()
    for t in threads:
        t.join(timeout=timeout)
    return results, errors, not any(t.is_alive() for t in threads)
