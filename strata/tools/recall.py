"""Read-ahead recall (the reference engine): how much of layer l+a's real selection the guess
W_router(l+a)·h(l), made after layer l, puts in its top K.

- recall@K: mean over (token, layer) of |real top-k ∩ guessed top-K| / k;
- top-1@K: how often the real rank-0 expert is in the guessed top-K;
- weight recall@K: mean of the real combine weight covered by the guessed top-K (over the
  selection's total weight).
The real selection is the trace's λ = 0 one; guesses are ranked by z (ties -> lower index).
"""

from __future__ import annotations

from dataclasses import dataclass

import numpy as np

from strata.tools.trace import Trace

__all__ = ["RecallResult", "readahead_recall", "DEFAULT_KS"]

DEFAULT_KS = (10, 16, 32)  # the reference engine's depths


@dataclass(frozen=True)
class RecallResult:
    ahead: int  # 1: the next layer; 2: two layers ahead (PREFETCH2)
    pairs: int  # (token, layer) pairs scored
    recall: dict[int, float]
    top1: dict[int, float]
    weight_recall: dict[int, float]

    def to_json(self) -> dict:
        keyed = lambda d: {str(k): v for k, v in d.items()}  # noqa: E731
        return {"ahead": self.ahead, "pairs": self.pairs, "recall": keyed(self.recall),
                "top1": keyed(self.top1), "weight_recall": keyed(self.weight_recall)}


def readahead_recall(trace: Trace, ks=DEFAULT_KS, *, ahead: int = 1, warmup: int = 0,
                     pred_q8: bool = False) -> RecallResult:
    """Recall of the guess `ahead` layers ahead, over tokens from `warmup` on (`pred_q8`: the
    guess on the Q8_0 copy of the routers, as the runtime reads ahead by default).

    Shapes (inside): guesses [T, L-a, K]; truth [T, L-a, k]
    """
    ks = tuple(sorted({int(k) for k in ks}))
    if not ks or ks[0] < 1:
        raise ValueError(f"recall depths must be positive, got {ks}")
    if ahead < 1:
        raise ValueError(f"ahead must be >= 1, got {ahead}")
    if trace.n_layers <= ahead or trace.n_tokens <= warmup:
        nan = {k: float("nan") for k in ks}
        return RecallResult(ahead, 0, nan, dict(nan), dict(nan))
    g = trace.guess_logits(ahead, pred_q8=pred_q8)[warmup:]  # [T', L-a, E]
    kmax = min(ks[-1], trace.n_experts)
    guesses = np.argsort(-g, axis=-1, kind="stable")[..., :kmax]  # [T', L-a, Kmax]
    truth = trace.selected[warmup:, ahead:]  # [T', L-a, k]
    w = trace.weights[warmup:, ahead:].astype(np.float64)  # [T', L-a, k]
    # position of each real expert in the guess ranking (kmax = not in the top kmax)
    match = truth[..., :, None] == guesses[..., None, :]  # [T', L-a, k, Kmax]
    pos = np.where(match.any(-1), match.argmax(-1), kmax)  # [T', L-a, k]
    recall, top1, wrec = {}, {}, {}
    for k in ks:
        inside = pos < k  # [T', L-a, k]
        recall[k] = float(inside.mean())
        top1[k] = float(inside[..., 0].mean())
        wrec[k] = float(((inside * w).sum(-1) / w.sum(-1)).mean())  # NaN where weights are not recorded (tier 2)
    return RecallResult(ahead, int(truth.shape[0] * truth.shape[1]), recall, top1, wrec)
