"""The runtime gate: speculate only while it pays, per handed-out token, in bytes and in ms.

A window's cost is what it read (expert records x slot bytes; 0 where every expert is resident)
and how long it took; its yield is the tokens it decided (accepted drafts + 1). The gate keeps
the last GATE_SPAN speculative windows and the last GATE_SPAN plain (one-position) windows and
compares per token: speculation pays while its ms per token is no more than MS_MARGIN above
plain decoding's and its bytes per token are no more than plain's. Wall time on a shared host
is noisy (a preempted window takes 10x its time): windows over OUTLIER x their kind's median
seconds are left out of the ms figure, and the margin keeps noise from switching off a win. Plain windows come for free where the drafter has
nothing, and are forced every PROBE_EVERY windows so the baseline stays current.

When it stops paying the gate switches speculation off (plain windows only) and says why; after
RETRY_AFTER plain windows it tries again (the text may have turned repetitive), needing fresh
speculative samples before it judges. With `enabled=False` the gate only measures (the A/B
benchmark's "gate off").
"""

from __future__ import annotations

import statistics
from collections import deque
from dataclasses import dataclass

__all__ = ["Gate", "WindowCost", "GATE_SPAN", "PROBE_EVERY", "RETRY_AFTER", "MIN_SAMPLES"]

GATE_SPAN = 32  # windows per kind in the sliding window: ~a line of code's tokens
PROBE_EVERY = 8  # one forced plain window in 8 while speculating: <= 1/8 of windows lose their draft
RETRY_AFTER = 128  # plain windows after switching off before speculation is tried again
MIN_SAMPLES = 4  # windows of each kind (after each kind's first, which pays one-time costs) to judge
MS_MARGIN = 0.10  # speculation is kept up to 10% slower per token: the run-to-run noise of a shared host
OUTLIER = 3.0  # a window over 3x its kind's median seconds was preempted, not slow: left out of ms


@dataclass(frozen=True)
class WindowCost:
    """One verified window: positions run, tokens decided, seconds, bytes read."""

    positions: int
    tokens: int
    seconds: float
    bytes: int


def _per_token(costs) -> tuple[float, float]:
    """(ms, bytes) per decided token over `costs`; ms without the outlier windows."""
    n = sum(c.tokens for c in costs)
    cut = OUTLIER * statistics.median(c.seconds for c in costs)
    timed = [c for c in costs if c.seconds <= cut]
    ms = 1e3 * sum(c.seconds for c in timed) / sum(c.tokens for c in timed)
    return ms, sum(c.bytes for c in costs) / n


class Gate:
    """Decides whether the next window carries a draft; records what each window cost."""

    def __init__(self, *, enabled: bool = True) -> None:
        self.enabled = enabled
        self.on = True
        self.plain: deque[WindowCost] = deque(maxlen=GATE_SPAN)
        self.spec: deque[WindowCost] = deque(maxlen=GATE_SPAN)
        self._seen_plain = self._seen_spec = False  # each kind's first window is left out
        self._since_probe = 0
        self._off_windows = 0
        self.events: list[str] = []  # what the report says: when and why it switched

    def wants_draft(self) -> bool:
        """Whether the next window should carry a draft."""
        if not self.enabled:
            return True  # measuring only: every window drafts where the drafter can
        return self.on and self._since_probe < PROBE_EVERY - 1

    def record(self, cost: WindowCost, *, at_token: int) -> None:
        """A window ran: a plain one when cost.positions == 1. `at_token`: the generation's
        index of its first decided token (for the report)."""
        speculative = cost.positions > 1
        if speculative:
            self._since_probe += 1
            if self._seen_spec:
                self.spec.append(cost)
            self._seen_spec = True
        else:
            self._since_probe = 0
            if self._seen_plain:
                self.plain.append(cost)
            self._seen_plain = True
            if not self.on:
                self._off_windows += 1
                if self._off_windows >= RETRY_AFTER:
                    self.on, self._off_windows = True, 0
                    self.spec.clear()
                    self.events.append(f"on again at token {at_token} (retry after {RETRY_AFTER} plain windows)")
            return
        if self.enabled and self.on:
            verdict = self.verdict()
            if verdict is not None and not verdict[0]:
                self.on = False
                self.events.append(f"off at token {at_token}: {verdict[1]}")

    def verdict(self) -> tuple[bool, str] | None:
        """(pays, why) from the sliding windows, or None while either kind has too few samples."""
        if len(self.spec) < MIN_SAMPLES or len(self.plain) < MIN_SAMPLES:
            return None
        ms_s, bytes_s = _per_token(self.spec)
        ms_p, bytes_p = _per_token(self.plain)
        why = (f"speculative {ms_s:.2f} ms and {bytes_s / 1e6:.2f} MB per token vs plain "
               f"{ms_p:.2f} ms and {bytes_p / 1e6:.2f} MB")
        return (ms_s <= ms_p * (1 + MS_MARGIN) and bytes_s <= bytes_p), why
