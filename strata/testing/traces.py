"""Synthetic routing traces with the structure that makes an expert cache and a read-ahead
matter: skewed per-layer expert popularity, token-to-token locality, and next-layer guesses
that are a noisy copy of the truth. Shared by the cache tests and benchmarks/cache.py.

Not a model of any real router; the reference engine's real trace (1,022 tokens × 48 layers, 256 experts,
top-10) had read-ahead recall 0.678 @10 and 0.821 @16. `DEFAULT_*` below land near that.
"""

from __future__ import annotations

from dataclasses import dataclass

import numpy as np

__all__ = ["RoutingTrace", "synthetic_routing_trace", "recall_at"]

DEFAULT_ZIPF = 1.0  # popularity of the expert ranked r in a layer ~ 1 / (r + 1) ** DEFAULT_ZIPF
DEFAULT_KEEP = 0.75  # chance an expert of token t-1 is selected again at token t (same layer)
DEFAULT_GUESS_SIGNAL = 3.8  # logit bonus of a true next-layer expert in the guess score


@dataclass(frozen=True)
class RoutingTrace:
    """Shapes: selected [tokens, layers, top_k] (rank order, distinct per row);
    guesses [tokens, layers, n_guesses]: after layer l, ranked guesses for layer l+1
    (the last layer's row is a guess for nothing and is not used)."""

    n_experts: int
    selected: np.ndarray
    guesses: np.ndarray

    @property
    def n_tokens(self) -> int:
        return self.selected.shape[0]

    @property
    def n_layers(self) -> int:
        return self.selected.shape[1]


def _gumbel(rng: np.random.Generator, shape) -> np.ndarray:
    return -np.log(-np.log(rng.random(shape) + 1e-12) + 1e-12)


def synthetic_routing_trace(n_tokens: int, n_layers: int, n_experts: int, top_k: int, n_guesses: int,
                            *, seed: int = 0, zipf: float = DEFAULT_ZIPF, keep: float = DEFAULT_KEEP,
                            guess_signal: float = DEFAULT_GUESS_SIGNAL) -> RoutingTrace:
    """A deterministic trace (same arguments, same arrays).

    Each (token, layer): each of the previous token's experts stays with probability `keep`;
    the rest of the top_k are drawn without replacement by popularity (Gumbel top-k over
    log-popularity). Rank order: by log-popularity + noise. Guesses for (t, l+1): top n_guesses
    of log-popularity + guess_signal·[in the true selection] + Gumbel noise.
    """
    if top_k > n_experts or n_guesses > n_experts:
        raise ValueError(f"top_k {top_k} and n_guesses {n_guesses} must be <= n_experts {n_experts}")
    rng = np.random.default_rng(seed)
    ranks = np.argsort(rng.random((n_layers, n_experts)), axis=1)  # [L, E] popularity rank per expert
    logpop = -zipf * np.log1p(ranks).astype(np.float64)  # [L, E]
    selected = np.empty((n_tokens, n_layers, top_k), np.int32)
    member = np.zeros((n_layers, n_experts), bool)  # previous token's selection, [L, E]
    rows = np.arange(n_layers)[:, None]
    for t in range(n_tokens):
        kept = member & (rng.random((n_layers, n_experts)) < keep)  # [L, E]
        # keep at most top_k: the kept experts outrank everything else, ties broken by noise
        score = logpop + _gumbel(rng, (n_layers, n_experts)) + np.where(kept, 1e6, 0.0)
        chosen = np.argpartition(-score, top_k - 1, axis=1)[:, :top_k]  # [L, k]
        order_score = logpop[rows, chosen] + _gumbel(rng, chosen.shape)
        chosen = np.take_along_axis(chosen, np.argsort(-order_score, axis=1), axis=1)
        selected[t] = chosen
        member = np.zeros((n_layers, n_experts), bool)
        member[rows, chosen] = True
    guesses = np.zeros((n_tokens, n_layers, n_guesses), np.int32)
    if n_layers > 1 and n_guesses:
        truth = np.zeros((n_tokens, n_layers - 1, n_experts), bool)  # [T, L-1, E]: layer l+1's truth
        t_idx = np.arange(n_tokens)[:, None, None]
        l_idx = np.arange(n_layers - 1)[None, :, None]
        truth[t_idx, l_idx, selected[:, 1:, :]] = True
        score = logpop[None, 1:, :] + guess_signal * truth + _gumbel(rng, truth.shape)
        top = np.argpartition(-score, n_guesses - 1, axis=2)[..., :n_guesses]
        top_score = np.take_along_axis(score, top, axis=2)
        guesses[:, :-1] = np.take_along_axis(top, np.argsort(-top_score, axis=2), axis=2)
    return RoutingTrace(n_experts=n_experts, selected=selected, guesses=guesses)


def recall_at(trace: RoutingTrace, k: int) -> float:
    """Mean fraction of layer l+1's true selection among the first k guesses made after layer l."""
    if trace.n_layers < 2:
        return float("nan")
    g = trace.guesses[:, :-1, :k]  # [T, L-1, k]
    truth = trace.selected[:, 1:, :]  # [T, L-1, top_k]
    hit = (truth[..., :, None] == g[..., None, :]).any(axis=-1)
    return float(hit.mean())
