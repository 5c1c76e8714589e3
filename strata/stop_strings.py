"""Stop strings over streamed text: a piece is handed out only once it cannot be the start of
a stop sequence, so a stream never shows text that the finished response would not contain."""

from __future__ import annotations


def held_back(text: str, needles: tuple[str, ...]) -> int:
    """Length of the longest suffix of `text` that is a proper prefix of one of `needles`:
    what must wait for the next piece before it can be shown."""
    longest = 0
    for needle in needles:
        for n in range(min(len(needle) - 1, len(text)), longest, -1):
            if text.endswith(needle[:n]):
                longest = n
                break
    return longest


def earliest_stop(text: str, stops: tuple[str, ...]) -> tuple[int, str] | None:
    """(where, which) of the stop sequence that starts first in `text`, or None."""
    hits = [(text.find(stop), stop) for stop in stops if stop in text]
    return min(hits) if hits else None


class StopMatcher:
    """Feed the generated text piece by piece; `feed` returns what is safe to show. After a stop
    sequence `stopped` names it and nothing more is shown (the sequence itself is not). The text
    is cut where the first stop sequence starts, not where the first one completes, so the result
    does not depend on how the text was split into pieces."""

    def __init__(self, stops: tuple[str, ...]) -> None:
        self.stops = stops
        self.stopped: str | None = None
        self._pending = ""

    def feed(self, piece: str) -> str:
        if self.stopped is not None:
            return ""
        text = self._pending + piece
        # From here on the text may be the start of a stop that the next pieces complete.
        undecided_from = len(text) - held_back(text, self.stops)
        stop = earliest_stop(text, self.stops)
        # A complete stop counts only if no stop still forming starts before it: with stops
        # "a" and "\naa", the text "\na" completes "a" but "\naa" may yet start at 0.
        if stop is not None and stop[0] <= undecided_from:
            return self._stop_at(text, stop)
        self._pending = text[undecided_from:]
        return text[:undecided_from]

    def flush(self) -> str:
        """At the end of generation: the held-back text, cut at a stop sequence it completed
        while an earlier one might still have formed (no later piece can complete that one)."""
        text, self._pending = self._pending, ""
        stop = earliest_stop(text, self.stops)
        return self._stop_at(text, stop) if stop is not None else text

    def _stop_at(self, text: str, stop: tuple[int, str]) -> str:
        at, self.stopped = stop
        self._pending = ""
        return text[:at]
