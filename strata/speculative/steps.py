"""The speculative token source the generation loop draws from (strata.generate).

The loop asks for token n (`next(n)`), hands it out, and, while it goes on, says so
(`advance(token, n, room)`). Plain decoding decodes the token there. Here the token opens a
window: [token, d1..dk] with d drafted (k <= the drafter's depth, the tokens the call may still
take, the context left), verified by one `engine.decode_window`. The verdict
(strata.speculative.acceptance) decides accepted drafts and the token after them; they queue,
and `next` hands them out in order without touching the engine. The session is trimmed back to
the last accepted token, at a position it can restore (`kept_position`: every position for
attention layers; a recurrent layer's snapshots); positions a restore falls short of are run
again, so speculation never needs more of an engine than the protocol.

At `finish(n)` the session keeps what plain decoding would: the prompt and tokens 0..n-1.
"""

from __future__ import annotations

import time
from collections import deque

import numpy as np

from strata.reference.sampling import SamplerConfig, log_softmax, sample
from strata.speculative.acceptance import accept
from strata.speculative.drafter import NO_DRAFT, Drafter
from strata.speculative.gate import Gate, WindowCost
from strata.speculative.report import SpeculationReport

__all__ = ["SpeculativeSteps"]


class SpeculativeSteps:
    """Tokens from verified windows. `logits` [V]: the prompt's last position's; `limit`: the
    model's context (positions)."""

    def __init__(self, engine, logits: np.ndarray, sampler: SamplerConfig, drafter: Drafter, *, gate: Gate,
                 limit: int) -> None:
        self.engine, self.sampler, self.drafter, self.gate, self.limit = engine, sampler, drafter, gate, limit
        self.logits: np.ndarray | None = logits
        self.base = engine.length  # the prompt's positions
        self.ready: deque[tuple[int, float]] = deque()
        self.slot_bytes = engine.model.experts_file.header.padded_bytes
        self.costs: list[WindowCost] = []
        self.drafted = self.accepted = 0
        drafter.start(engine.tokens)

    def next(self, n: int) -> tuple[int, float]:
        """Token n of the generation and its log-probability (before temperature)."""
        if self.ready:
            token, logprob = self.ready.popleft()
        else:  # token 0, from the prompt's logits
            token = sample(self.logits, self.sampler, n)
            logprob = float(log_softmax(self.logits)[token])
            self.logits = None
        self.drafter.extend([token])
        return token, logprob

    def advance(self, token: int, n: int, room: int) -> None:
        """Token n was handed out and the generation goes on for at most `room` more tokens."""
        if self.ready:
            return  # the session already holds `token` (an accepted draft)
        e = self.engine
        before = e.length
        depth = min(room - 1, self.limit - before - 1)
        reads, start = self._reads(), time.perf_counter()  # the draft's time counts: an MTP draft computes
        draft = self.drafter.draft(depth) if depth > 0 and self.gate.wants_draft() else NO_DRAFT
        window = [int(token), *draft.tokens]
        logits = e.decode_window(window)  # [1 + k, V]
        verdict = accept(draft, logits, self.sampler, n + 1)
        self._keep(before + 1 + verdict.accepted)
        cost = WindowCost(positions=len(window), tokens=verdict.accepted + 1, seconds=time.perf_counter() - start,
                          bytes=(self._reads() - reads) * self.slot_bytes)
        self.costs.append(cost)
        self.gate.record(cost, at_token=n + 1)
        self.drafted += len(draft)
        self.accepted += verdict.accepted
        for i, d in enumerate(draft.tokens[:verdict.accepted]):
            self.ready.append((d, float(log_softmax(logits[i])[d])))
        self.ready.append((verdict.token, float(log_softmax(logits[verdict.accepted])[verdict.token])))

    def finish(self, n: int) -> None:
        """Token n was the last: keep the prompt and tokens 0..n-1, as plain decoding does."""
        e = self.engine
        want = self.base + n
        if e.length > want:
            e.trim(e.kept_position(want))

    def _keep(self, n: int) -> None:
        """Trim the session to n positions; where it can restore only fewer, run the rest again."""
        e = self.engine
        if e.length == n:
            return
        held = e.tokens
        m = e.kept_position(n)
        e.trim(m)
        if m < n:
            e.decode_window(list(held[m:n]))

    def _reads(self) -> int:
        cache = self.engine.stats().cache
        return cache.reads_issued if cache is not None else 0

    def report(self) -> SpeculationReport:
        spec = [c for c in self.costs if c.positions > 1]
        plain = [c for c in self.costs if c.positions == 1]
        g = self.gate
        return SpeculationReport(
            drafter=self.drafter.name, gate=("on" if g.on else "off") if g.enabled else "measuring",
            windows=len(self.costs), spec_windows=len(spec), drafted=self.drafted, accepted=self.accepted,
            tokens=sum(c.tokens for c in self.costs), positions=sum(c.positions for c in self.costs),
            ms_per_token=_ms(self.costs), bytes_per_token=_bytes(self.costs),
            spec_ms_per_token=_ms(spec), spec_bytes_per_token=_bytes(spec),
            plain_ms_per_token=_ms(plain), plain_bytes_per_token=_bytes(plain), events=tuple(g.events))


def _ms(costs) -> float:
    n = sum(c.tokens for c in costs)
    return 1e3 * sum(c.seconds for c in costs) / n if n else float("nan")


def _bytes(costs) -> float:
    n = sum(c.tokens for c in costs)
    return sum(c.bytes for c in costs) / n if n else float("nan")
