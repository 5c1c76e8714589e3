"""Stop sequences over streamed text: a piece is handed out only once it cannot be the start of
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


class StopMatcher:
    """Feed the generated text piece by piece; `feed` returns what is safe to show. After a stop
    sequence `stopped` names it and nothing more is shown (the sequence itself is not)."""

    def __init__(self, stops: tuple[str, ...]) -> None:
        self.stops = stops
        self.stopped: str | None = None
        self._pending = ""

    def feed(self, piece: str) -> str:
        if self.stopped is not None:
            return ""
        text = self._pending + piece
        hits = [(text.find(s), s) for s in self.stops if s in text]
        if hits:
            at, self.stopped = min(hits)
            self._pending = ""
            return text[:at]
        keep = held_back(text, self.stops)
        self._pending = text[len(text) - keep:] if keep else ""
        return text[:len(text) - keep]

    def flush(self) -> str:
        """At the end of generation: the held-back text (it never completed a stop sequence)."""
        text, self._pending = self._pending, ""
        return text
