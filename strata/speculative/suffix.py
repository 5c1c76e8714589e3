"""The suffix drafter: propose what followed the context's suffix where it occurred before.

The index maps every n-gram of the context (n = 1..MAX_MATCH) to the tokens that followed it,
with how often and where last: the top MAX_MATCH levels of a suffix tree over the prompt and
the generation, kept incrementally (MAX_MATCH dictionary updates per appended token). A draft
walks it: the longest suffix of the context (with the tokens drafted so far appended) that
occurred before names the next token, the one that followed it most often (ties: the most
recent). It stops where no suffix of at least `min_match` tokens occurred, so a context
without repetition drafts nothing and its window stays one position.

Code and templated text repeat whole lines; this is where a draft from the context itself is
accepted (docs/perf.md measures how often).
"""

from __future__ import annotations

from typing import Sequence

from strata.speculative.drafter import NO_DRAFT, Draft

__all__ = ["SuffixDrafter", "MAX_MATCH", "STOCK_MIN_MATCH"]

MAX_MATCH = 8  # longest suffix looked up: past ~8 tokens a match almost never changes the guess
STOCK_MIN_MATCH = 2  # one repeated token predicts little; two already name a line's continuation


class SuffixDrafter:
    """A suffix index over the context; `depth` is the most tokens one draft proposes.

    next[gram] = {token: (count, last position)} for every n-gram (n <= MAX_MATCH) seen before a
    token."""

    name = "suffix"

    def __init__(self, depth: int, *, min_match: int = STOCK_MIN_MATCH) -> None:
        if depth < 1:
            raise ValueError(f"a suffix drafter drafts at least 1 token, got depth {depth}")
        if not 1 <= min_match <= MAX_MATCH:
            raise ValueError(f"min_match must be in 1..{MAX_MATCH}, got {min_match}")
        self.depth, self.min_match = depth, min_match
        self.name = f"suffix-{depth}"
        self.start(())

    def start(self, context: Sequence[int]) -> None:
        self._context: list[int] = []
        self._next: dict[tuple[int, ...], dict[int, tuple[int, int]]] = {}
        self.extend(context)

    def extend(self, tokens: Sequence[int]) -> None:
        ctx, nxt = self._context, self._next
        for token in tokens:
            token, pos = int(token), len(ctx)
            for n in range(1, min(MAX_MATCH, pos) + 1):
                follow = nxt.setdefault(tuple(ctx[pos - n:]), {})
                count, _ = follow.get(token, (0, 0))
                follow[token] = (count + 1, pos)
            ctx.append(token)

    def draft(self, n: int) -> Draft:
        """Shapes: -> Draft of at most min(n, depth) tokens, probs None (deterministic)."""
        tail = self._context[-MAX_MATCH:]
        out: list[int] = []
        for _ in range(min(n, self.depth)):
            token = self._follow(tail)
            if token is None:
                break
            out.append(token)
            tail = (tail + [token])[-MAX_MATCH:]
        return Draft(tuple(out)) if out else NO_DRAFT

    def _follow(self, tail: list[int]) -> int | None:
        """The token that most often followed the longest suffix of `tail` seen before."""
        for n in range(min(MAX_MATCH, len(tail)), self.min_match - 1, -1):
            follow = self._next.get(tuple(tail[len(tail) - n:]))
            if follow:
                return max(follow.items(), key=lambda kv: kv[1])[0]
        return None
