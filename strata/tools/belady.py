"""Belady's MIN over a selection stream: the fewest misses any demand-paged cache of `capacity`
slots can have on it (the reference engine: 10.71/token vs LRU's 19.65 on the stock trace).

The stream is every selected (layer, expert) in token, layer, rank order. On a miss with the
cache full, MIN evicts the key whose next use is farthest away (never used again = infinitely
far). It is an offline bound: it knows the future, and it may evict an expert the current
window still needs, which no real arena may do (pinning only removes choices, so the bound
holds a fortiori). Misses are counted for tokens from `warmup` on; the cache runs through all.
"""

from __future__ import annotations

import heapq
from dataclasses import dataclass

import numpy as np

__all__ = ["BeladyResult", "belady", "request_stream"]

_NEVER = np.iinfo(np.int64).max


@dataclass(frozen=True)
class BeladyResult:
    capacity: int
    tokens: int  # tokens counted
    misses: int

    @property
    def misses_per_token(self) -> float:
        return self.misses / self.tokens if self.tokens else float("nan")

    def to_json(self) -> dict:
        return {"capacity": self.capacity, "tokens": self.tokens, "misses": self.misses,
                "misses_per_token": self.misses_per_token}


def request_stream(selections: np.ndarray, n_experts: int) -> tuple[np.ndarray, np.ndarray]:
    """Flatten selections [T, L, k] (negative = no expert) into keys layer·E + expert, in token,
    layer, rank order, with each request's token index. -> (keys [N], token [N])"""
    sel = np.asarray(selections, np.int64)
    T, L, _ = sel.shape
    keys = sel + (np.arange(L, dtype=np.int64) * n_experts)[None, :, None]  # [T, L, k]
    tok = np.broadcast_to(np.arange(T, dtype=np.int64)[:, None, None], sel.shape)
    valid = (sel >= 0).reshape(-1)
    return keys.reshape(-1)[valid], tok.reshape(-1)[valid]


def _next_use(keys: np.ndarray) -> np.ndarray:
    """For each request, the index of the next request of the same key (or _NEVER). [N]"""
    n = len(keys)
    nxt = np.full(n, _NEVER, np.int64)
    if n == 0:
        return nxt
    order = np.argsort(keys, kind="stable")  # same key -> increasing index
    k_sorted = keys[order]
    same = k_sorted[1:] == k_sorted[:-1]
    nxt[order[:-1][same]] = order[1:][same]
    return nxt


def belady(selections: np.ndarray, n_experts: int, capacity: int, *, warmup: int = 0) -> BeladyResult:
    """MIN misses on the stream of `selections` [T, L, k] with `capacity` slots."""
    if capacity < 1:
        raise ValueError(f"belady: capacity must be >= 1, got {capacity}")
    keys, tok = request_stream(selections, n_experts)
    nxt = _next_use(keys).tolist()
    counted = (tok >= warmup).tolist()
    cached: dict[int, int] = {}  # key -> its next use
    heap: list[tuple[int, int]] = []  # (-next use, key); stale entries are skipped when popped
    misses = 0
    for i, key in enumerate(keys.tolist()):
        n = nxt[i]
        if key not in cached:
            if counted[i]:
                misses += 1
            if len(cached) >= capacity:
                while True:
                    neg, victim = heapq.heappop(heap)
                    if cached.get(victim) == -neg:
                        del cached[victim]
                        break
        cached[key] = n
        heapq.heappush(heap, (-n, key))
    T = selections.shape[0]
    return BeladyResult(capacity, max(T - warmup, 0), misses)
