"""How much of a verified draft stands (pure functions).

The window [t, d1..dn] gives logits rows 0..n: row i is the model's next-token logits after
t, d1..di. Acceptance walks the draft:

- greedy (temperature 0): d(i+1) stands while it is row i's argmax; the first mismatch is
  replaced by that argmax, and when every drafted token stands row n gives one more. The
  tokens are exactly what one-at-a-time greedy decoding picks from the same logits: lossless.
- sampled: standard speculative sampling (Leviathan et al. 2023, Chen et al. 2023). With p
  the sampler's distribution from row i (temperature, top-p: `reference.sampling.probabilities`)
  and q the draft's (a point mass for a deterministic drafter), d(i+1) stands with probability
  min(1, p(d)/q(d)); a rejected one is replaced by a draw from max(p - q, 0), renormalized.
  Every token handed out is then distributed exactly as plain sampling would have drawn it.

Each decision is seeded by (seed, step, SPEC_STREAM), step being the index of the token it
decides, so a run is reproducible and no generator state is hidden. When every drafted token
stands, the extra token is `sample(row n, step)`, the plain path's own draw.
"""

from __future__ import annotations

from dataclasses import dataclass

import numpy as np

from strata.reference.sampling import SamplerConfig, probabilities, sample
from strata.speculative.drafter import Draft

__all__ = ["Verdict", "accept", "accept_greedy", "accept_sampled", "SPEC_STREAM"]

SPEC_STREAM = 1  # the third seed word: speculative draws never share a stream with `sample`'s


@dataclass(frozen=True)
class Verdict:
    """accepted: how many drafted tokens stand; token: the one after them (from row `accepted`)."""

    accepted: int
    token: int


def accept(draft: Draft, logits: np.ndarray, sampler: SamplerConfig, step: int) -> Verdict:
    """The verdict on `draft` from the window's logits; `step`: the index of the first drafted
    token in the generation.

    Shapes: logits [n + 1, V] for a draft of n tokens
    """
    if len(logits) != len(draft) + 1:
        raise ValueError(f"a draft of {len(draft)} tokens needs {len(draft) + 1} logits rows, got {len(logits)}")
    if sampler.temperature == 0.0:
        return accept_greedy(draft.tokens, logits)
    return accept_sampled(draft, logits, sampler, step)


def accept_greedy(tokens, logits: np.ndarray) -> Verdict:
    """Shapes: tokens [n], logits [n + 1, V]"""
    for i, d in enumerate(tokens):
        best = int(np.argmax(logits[i]))
        if best != int(d):
            return Verdict(i, best)
    return Verdict(len(tokens), int(np.argmax(logits[len(tokens)])))


def accept_sampled(draft: Draft, logits: np.ndarray, sampler: SamplerConfig, step: int) -> Verdict:
    """Shapes: draft of n tokens, logits [n + 1, V]"""
    for i, d in enumerate(draft.tokens):
        p = probabilities(logits[i], sampler)  # [V]
        q = _draft_probs(draft, i, p.shape[-1])
        rng = np.random.default_rng([sampler.seed, step + i, SPEC_STREAM])
        if q[d] > 0 and rng.random() < min(1.0, p[d] / q[d]):
            continue
        residual = np.maximum(p - q, 0.0)
        total = residual.sum()
        # total is 0 only where p == q, where rejection has probability 0: draw from p then
        residual = residual / total if total > 0 else p
        return Verdict(i, int(rng.choice(len(residual), p=residual)))
    n = len(draft)
    return Verdict(n, sample(logits[n], sampler, step + n))


def _draft_probs(draft: Draft, i: int, vocab: int) -> np.ndarray:
    if draft.probs is not None:
        return np.asarray(draft.probs[i], np.float64)
    q = np.zeros(vocab, np.float64)
    q[draft.tokens[i]] = 1.0
    return q
