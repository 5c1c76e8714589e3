"""Closed-loop replay over a trace (the reference engine's `sim`, design §8): for every token and layer,
MoCE routing re-runs on the trace's router logits against the simulated residency, and the
cache machine takes the turn. One `ReplayResult` per configuration; `replay_grid` runs many
configurations over one trace (logits computed once).

Counting follows the reference engine's table: per token (after `warmup` tokens), urgent misses, read-ahead
hits, reads (urgent + read-ahead), urgent misses by selected rank.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from pathlib import Path

import numpy as np

from strata.cache.types import CacheStats, stats_delta
from strata.tools.closed_loop import ClosedLoop, LoopConfig, check_family_routing
from strata.tools.trace import Trace

__all__ = ["ReplayResult", "ReplayInputs", "replay", "replay_grid", "save_dump"]

NO_EXPERT = -1  # padding of a selection row shortened by drop-tail


class ReplayInputs:
    """A trace with its read-ahead guess logits computed once per (ahead, pred_q8) and shared
    by every configuration replayed over it."""

    def __init__(self, trace: Trace) -> None:
        self.trace = trace
        self._guesses: dict[tuple[int, bool], np.ndarray] = {}

    def guess_logits(self, ahead: int, pred_q8: bool) -> np.ndarray:
        """Shapes: -> float32 [T, L - ahead, E] (see `Trace.guess_logits`)"""
        key = (ahead, pred_q8)
        if key not in self._guesses:
            self._guesses[key] = self.trace.guess_logits(ahead, pred_q8=pred_q8)
        return self._guesses[key]


@dataclass(frozen=True, eq=False)
class ReplayResult:
    """One configuration's counts over the tokens after the warm-up.

    selections (kept on request): int64 [T, L, k], rank order, NO_EXPERT where drop-tail removed
    one; urgent [T, L]: urgent misses of each turn (kept with selections).
    """

    config: LoopConfig
    tokens: int  # tokens counted (after warm-up)
    warmup: int
    stats: CacheStats
    dropped: int
    selections: np.ndarray | None = field(default=None, repr=False)
    urgent: np.ndarray | None = field(default=None, repr=False)

    @property
    def label(self) -> str:
        return self.config.label

    def per_token(self, count: int) -> float:
        return count / self.tokens if self.tokens else float("nan")

    @property
    def urgent_per_token(self) -> float:
        return self.per_token(self.stats.urgent_misses)

    @property
    def readahead_hits_per_token(self) -> float:
        return self.per_token(self.stats.readahead_hits)

    @property
    def reads_per_token(self) -> float:
        return self.per_token(self.stats.reads_issued)

    @property
    def misses_by_rank_per_token(self) -> tuple[float, ...]:
        return tuple(self.per_token(n) for n in self.stats.urgent_misses_by_rank)

    @property
    def hit_rate(self) -> float:
        """Lookups that did not wait on an urgent read (hits + read-ahead hits) / lookups."""
        s = self.stats
        return (s.hits + s.readahead_hits) / s.lookups if s.lookups else float("nan")

    def to_json(self) -> dict:
        s = self.stats
        return {
            "label": self.label, **self.config.to_json(), "tokens": self.tokens, "warmup": self.warmup,
            "urgent_per_token": self.urgent_per_token, "readahead_hits_per_token": self.readahead_hits_per_token,
            "reads_per_token": self.reads_per_token, "reads_ahead_per_token": self.per_token(s.reads_ahead),
            "hit_rate": self.hit_rate, "misses_by_rank_per_token": list(self.misses_by_rank_per_token),
            "dropped_per_token": self.per_token(self.dropped), "lookups_per_token": self.per_token(s.lookups),
            "totals": {f: getattr(s, f) for f in CacheStats.__dataclass_fields__},
        }


def replay(trace: Trace | ReplayInputs, config: LoopConfig, *, warmup: int = 0,
           keep_selections: bool = False) -> ReplayResult:
    """Replay the trace through the closed loop under `config`.

    Tokens before `warmup` fill the cache but are not counted (the reference engine counted tokens
    128..1021). `keep_selections` records what was routed (for Belady and `--dump`). A tier-2
    trace (`family_routing`) takes its recorded selections at λ = 0 (another policy is refused).
    """
    inputs = trace if isinstance(trace, ReplayInputs) else ReplayInputs(trace)
    tr = inputs.trace
    T, L, k = tr.n_tokens, tr.n_layers, tr.top_k
    if not 0 <= warmup < max(T, 1):
        raise ValueError(f"warmup {warmup} must leave tokens to count (trace has {T})")
    if tr.family_routing:
        check_family_routing(config)
    loop = ClosedLoop(config, tr.rule, L, tr.n_experts, rules=tr.rules)
    sels = np.full((T, L, k), NO_EXPERT, np.int64) if keep_selections else None
    urgent = np.zeros((T, L), np.int64) if keep_selections else None
    ahead = config.prefetch_depth > 0
    z = tr.logits
    g1 = inputs.guess_logits(1, config.pred_q8) if ahead else None
    g2 = inputs.guess_logits(2, config.pred_q8) if ahead and config.prefetch2 else None
    before, dropped_before = loop.totals(), 0
    for t in range(T):
        if t == warmup:
            before, dropped_before = loop.totals(), loop.dropped
        loop.begin_token()
        for layer in range(L):
            if tr.family_routing:
                loop.take(layer, tr.selected[t, layer])
                if keep_selections:
                    sels[t, layer] = tr.selected[t, layer]
            else:
                sel = loop.route(layer, z[t, layer])
                if keep_selections:
                    sels[t, layer, sel.ranks] = sel.experts
            if keep_selections:
                urgent[t, layer] = loop.state.turn.urgent_misses
            loop.after(layer, g1[t, layer] if g1 is not None and layer + 1 < L else None,
                       g2[t, layer] if g2 is not None and layer + 2 < L else None)
    return ReplayResult(config, T - warmup, warmup, stats_delta(loop.totals(), before),
                        loop.dropped - dropped_before, sels, urgent)


def replay_grid(trace: Trace, configs: list[LoopConfig], *, warmup: int = 0,
                keep_selections: bool = False, progress=None) -> list[ReplayResult]:
    """`replay` for each configuration, sharing the guess logits. `progress(i, result)` after each."""
    inputs = ReplayInputs(trace)
    out = []
    for i, c in enumerate(configs):
        out.append(replay(inputs, c, warmup=warmup, keep_selections=keep_selections))
        if progress is not None:
            progress(i, out[-1])
    return out


def save_dump(directory: str | Path, results: list[ReplayResult]) -> list[Path]:
    """One .npz per result: selections [T, L, k] (NO_EXPERT padded), urgent misses per turn
    [T, L], and the configuration as JSON. Needs results replayed with keep_selections."""
    import json

    directory = Path(directory)
    directory.mkdir(parents=True, exist_ok=True)
    paths = []
    for i, r in enumerate(results):
        if r.selections is None:
            raise ValueError("save_dump needs results replayed with keep_selections=True")
        p = directory / f"replay_{i:03d}.npz"
        np.savez(p, selections=r.selections, urgent=r.urgent, config=np.array(json.dumps(r.to_json())))
        paths.append(p)
    return paths
