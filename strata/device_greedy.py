"""Greedy decoding whose tokens the engine's device chooses: the pipeline an engine offers
(`SessionEngine.greedy_pipeline`) and the token source `strata.generate` draws from with it.

The host loop (generate's plain source) reads every position's logits, samples on the host and
only then encodes the next step: the device idles for the round trip and the encoding. Here the
device selects token n from its logits and step n + 1 is enqueued with that device-side token
before the host reads token n (one small read: the token, its log-probability and whether the
logits were finite). What the loop sees is the same: the same tokens (the device's argmax keeps
numpy's first-index tie rule), the same log-probabilities to float32 rounding (the host computes
them in float64), NonFiniteError on the same position with the same message, the same finish
reasons, and after the last token the same session (`length`, `tokens`, state): the step enqueued
past an end-of-text is dropped, never committed.

Taken for greedy decoding without a repetition penalty and without a drafter (sampling keeps
the host loop: its seeded draws are numpy's).
"""

from __future__ import annotations

from typing import Protocol

import numpy as np

from strata.errors import NonFiniteError
from strata.reference.sampling import SamplerConfig, log_softmax, sample

__all__ = ["GreedyPipeline", "PipelinedGreedySteps", "takes_pipeline", "non_finite_logits"]


class Selection(Protocol):
    token: int
    logprob: float
    finite: bool


class GreedyPipeline(Protocol):
    """Decode steps queued on an engine's device, each ending in its greedy selection.

    `push(token)`: enqueue the decode of `token` (an int), or, None, of the token the step
    before selects (the host never reads it first), one position after the last pushed step.
    `commit()`: the oldest pushed step becomes the session's next position (what `decode` of
    its token would have done; no wait). `selection()`: the last committed step's Selection
    (waits for that step only). `drop()`: forget the pushed steps not committed (the session
    holds what was committed). `pending`: steps pushed and not committed."""

    @property
    def pending(self) -> int: ...

    def push(self, token: int | None) -> None: ...

    def commit(self) -> None: ...

    def selection(self) -> Selection: ...

    def drop(self) -> None: ...


def takes_pipeline(sampler: SamplerConfig) -> bool:
    """Whether the device's greedy choice is `sample`'s: temperature 0 and no penalty."""
    return sampler.temperature == 0.0 and not sampler.penalized


def non_finite_logits(length: int) -> NonFiniteError:
    return NonFiniteError(f"the logits after {length} positions are not finite: the model's weights "
                          "or an expert read are bad (run `strata generate --verify-reads`)")


class PipelinedGreedySteps:
    """generate's TokenSource over a GreedyPipeline: token 0 from the prefill's logits (on the
    host already), every later token from the device, one step always queued ahead.

    The step ahead (token n + 1's decode, enqueued when token n is read) is pushed only where a
    token n + 2 may follow: `room` >= 2 and a position left in the context (`limit`)."""

    def __init__(self, engine, pipe: GreedyPipeline, logits: np.ndarray, sampler: SamplerConfig, limit: int) -> None:
        self.engine, self.pipe, self.sampler, self.limit = engine, pipe, sampler, limit
        self.logits: np.ndarray | None = logits  # the prefill's, until token 0 is taken from them
        self.start = engine.length  # positions before token 0

    def next(self, n: int) -> tuple[int, float]:
        if self.logits is not None:  # what the plain source does with the prefill's logits
            logits, self.logits = self.logits, None
            if not np.isfinite(logits.max()):
                raise non_finite_logits(self.engine.length)
            token = sample(logits, self.sampler, n)
            return token, float(log_softmax(logits)[token])
        selection = self.pipe.selection()  # of token n - 1's step, committed by advance(n - 1)
        if not selection.finite:
            self.pipe.drop()  # the step after it decoded a garbage token
            raise non_finite_logits(self.engine.length)
        return selection.token, selection.logprob

    def advance(self, token: int, n: int, room: int) -> None:
        if not self.pipe.pending:  # token n came from the host (token 0): its step is not queued yet
            self.pipe.push(token)
        self.pipe.commit()  # token n's decode is the session's now, as the host loop's `decode`
        if room >= 2 and self.start + n + 1 < self.limit:  # token n + 1's decode, on its device-side id
            self.pipe.push(None)

    def finish(self, n: int) -> None:
        self.pipe.drop()  # the step queued past the last token: never part of the session

    def report(self) -> None:
        return None
