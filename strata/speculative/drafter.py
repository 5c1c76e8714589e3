"""The drafter seam: what proposes tokens for a speculative window to verify.

A drafter sees the context (the prompt, then every token the generation hands out) and
proposes up to n tokens that may follow it. The engine verifies the proposal in one
`decode_window`; strata.speculative.acceptance decides how much of it stands.

Two kinds fit the protocol:
- a deterministic drafter (the suffix index, strata.speculative.suffix): `Draft.probs` is None,
  the draft's distribution is a point mass on each proposed token;
- a drafter with a distribution (one that samples its draft): `Draft.probs[i]` is the
  distribution token i was drawn from, which speculative sampling needs to stay
  distribution-preserving. A drafter holds what it reads itself (the MTP drafter,
  strata.speculative.mtp, the target's hidden states); the protocol only passes tokens.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Protocol, Sequence

import numpy as np

__all__ = ["Draft", "Drafter", "NO_DRAFT"]


@dataclass(frozen=True)
class Draft:
    """Proposed tokens [n] (n may be 0) and, for a sampling drafter, the distribution each was
    drawn from.

    Shapes: tokens [n]; probs float64 [n, V] or None (a point mass on each token)
    """

    tokens: tuple[int, ...] = ()
    probs: np.ndarray | None = field(default=None, repr=False)

    def __post_init__(self) -> None:
        if self.probs is not None and len(self.probs) != len(self.tokens):
            raise ValueError(f"a draft of {len(self.tokens)} tokens with {len(self.probs)} distributions")

    def __len__(self) -> int:
        return len(self.tokens)


NO_DRAFT = Draft()


class Drafter(Protocol):
    """Proposes tokens that may follow the context. `name` is what reports call it."""

    name: str

    def start(self, context: Sequence[int]) -> None:
        """Forget what was seen and read `context` (the session's tokens: the prompt)."""

    def extend(self, tokens: Sequence[int]) -> None:
        """`tokens` were appended to the context (handed out by the generation)."""

    def draft(self, n: int) -> Draft:
        """Up to n tokens that may follow the context (fewer, or none, where it has no guess)."""
