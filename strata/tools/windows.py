"""Replay with T-position windows: predict from a trace what speculative windows cost in expert
reads, before running them.

A plan cuts the trace's tokens into windows. Each window is one cache window (one BeginWindow;
per MoE layer one turn with the union of its positions' selections, pinned together; the
read-ahead ranks the mean of its positions' guess logits, as the runtime's window does) and
decides some tokens (its accepted drafts + 1). Two plans:

- `fixed_windows(n, T)`: every window T positions, every draft accepted: the bound of what
  windows of T can save (or cost);
- `suffix_windows(tokens, depth)`: the suffix drafter (strata.speculative.suffix) run over the
  trace's own tokens, greedy acceptance against them. Exact for a trace of a greedy generation
  (`strata trace` over generated text). A rejected draft's positions are routed as the trace's
  true next tokens there: the model computed some other token at those positions, whose routing
  the trace does not hold; the true token at the same context is the nearest stand-in.

Counted per decided token (after `warmup` tokens): reads (x slot bytes: bytes), urgent misses;
per window and MoE layer: the union's experts. `replay_windows` with the plan of windows of 1 is
the ordinary closed-loop replay (strata.tools.replay), counts for counts.
"""

from __future__ import annotations

from dataclasses import dataclass, field, replace

import numpy as np

from strata.cache.types import CacheStats, stats_delta
from strata.speculative.suffix import SuffixDrafter
from strata.tools.closed_loop import ClosedLoop, check_family_routing, LoopConfig
from strata.tools.replay import ReplayInputs
from strata.tools.trace import Trace

__all__ = ["Window", "WindowPlan", "fixed_windows", "suffix_windows", "WindowReplay", "replay_windows"]


@dataclass(frozen=True)
class Window:
    start: int  # the trace position of its first token (the one decoded)
    positions: int  # positions run: 1 + drafted
    tokens: int  # tokens it decides: 1 + accepted (<= positions)


@dataclass(frozen=True)
class WindowPlan:
    name: str  # "T=1", "T=3 (all accepted)", "suffix-2"
    windows: tuple[Window, ...] = field(repr=False)

    @property
    def max_positions(self) -> int:
        return max((w.positions for w in self.windows), default=1)


def fixed_windows(n_tokens: int, size: int) -> WindowPlan:
    """Windows of `size` positions over n tokens, every position accepted (the last one shorter)."""
    if size < 1:
        raise ValueError(f"a window holds at least 1 position, got {size}")
    ws = tuple(Window(s, min(size, n_tokens - s), min(size, n_tokens - s)) for s in range(0, n_tokens, size))
    return WindowPlan("T=1" if size == 1 else f"T={size} (all accepted)", ws)


def suffix_windows(tokens, depth: int, *, prompt: int = 0) -> WindowPlan:
    """The windows a suffix drafter of `depth` would run over `tokens`, as the generation, after
    the first `prompt` tokens (its context at the start)."""
    tokens = [int(t) for t in tokens]
    drafter = SuffixDrafter(depth)
    drafter.start(tokens[:prompt])
    out, s = [], prompt
    while s < len(tokens):
        drafter.extend([tokens[s]])
        draft = drafter.draft(min(depth, len(tokens) - s - 1)).tokens
        accepted = 0
        while accepted < len(draft) and draft[accepted] == tokens[s + 1 + accepted]:
            accepted += 1
        out.append(Window(s, 1 + len(draft), 1 + accepted))
        drafter.extend(tokens[s + 1:s + 1 + accepted])
        s += 1 + accepted
    return WindowPlan(f"suffix-{depth}", tuple(out))


@dataclass(frozen=True, eq=False)
class WindowReplay:
    """One plan's counts over the windows that start after the warm-up."""

    plan: str
    config: LoopConfig
    windows: int
    positions: int
    tokens: int  # decided
    drafted: int
    accepted: int
    stats: CacheStats
    union_per_layer: float  # mean experts in one window's union, per MoE layer

    def per_token(self, count: float) -> float:
        return count / self.tokens if self.tokens else float("nan")

    @property
    def reads_per_token(self) -> float:
        return self.per_token(self.stats.reads_issued)

    @property
    def urgent_per_token(self) -> float:
        return self.per_token(self.stats.urgent_misses)

    @property
    def acceptance(self) -> float:
        return self.accepted / self.drafted if self.drafted else float("nan")

    def to_json(self, slot_bytes: int = 0) -> dict:
        return {"plan": self.plan, "label": self.config.label, **self.config.to_json(), "windows": self.windows,
                "positions": self.positions, "tokens": self.tokens, "drafted": self.drafted,
                "accepted": self.accepted, "acceptance": self.acceptance if self.drafted else None,
                "tokens_per_window": self.tokens / self.windows if self.windows else float("nan"),
                "union_per_layer": self.union_per_layer, "reads_per_token": self.reads_per_token,
                "urgent_per_token": self.urgent_per_token, "bytes_per_token": self.reads_per_token * slot_bytes}


def replay_windows(trace: Trace | ReplayInputs, config: LoopConfig, plan: WindowPlan, *,
                   warmup: int = 0) -> WindowReplay:
    """Replay `plan`'s windows through the closed loop under `config` (its window raised to the
    plan's longest)."""
    inputs = trace if isinstance(trace, ReplayInputs) else ReplayInputs(trace)
    tr = inputs.trace
    L = tr.n_layers
    config = replace(config, window=max(config.window, plan.max_positions))
    if tr.family_routing:
        check_family_routing(config)
    loop = ClosedLoop(config, tr.rule, L, tr.n_experts)
    ahead = config.prefetch_depth > 0
    g1 = inputs.guess_logits(1, config.pred_q8) if ahead else None
    g2 = inputs.guess_logits(2, config.pred_q8) if ahead and config.prefetch2 else None
    before = loop.totals()
    counted = [w for w in plan.windows if w.start >= warmup]
    unions = 0
    for w in plan.windows:
        if counted and w is counted[0]:
            before = loop.totals()
        rows = slice(w.start, w.start + w.positions)
        loop.begin_token()
        for layer in range(L):
            if tr.family_routing:  # a tier-2 trace: the family's own selections, their union in order
                union = list(dict.fromkeys(tr.selected[rows, layer].reshape(-1).tolist()))
                loop.take(layer, union)
            else:
                sels = loop.route_window(layer, tr.logits[rows, layer])
                union = {e for s in sels for e in s.experts.tolist()}
            if w.start >= warmup:
                unions += len(union)
            loop.after(layer, _mean(g1, rows, layer, L - 1), _mean(g2, rows, layer, L - 2))
    return WindowReplay(
        plan=plan.name, config=config, windows=len(counted), positions=sum(w.positions for w in counted),
        tokens=sum(w.tokens for w in counted), drafted=sum(w.positions - 1 for w in counted),
        accepted=sum(w.tokens - 1 for w in counted), stats=stats_delta(loop.totals(), before),
        union_per_layer=unions / (len(counted) * L) if counted else float("nan"))


def _mean(g: np.ndarray | None, rows: slice, layer: int, last: int) -> np.ndarray | None:
    """The window's guess logits for a layer ahead: one position's as is (bit for bit the
    per-token replay's), several positions' mean (the runtime's `Selector.guesses`)."""
    if g is None or layer >= last:
        return None
    z = g[rows, layer]  # [T, E]
    return z[0] if len(z) == 1 else z.mean(axis=0, dtype=np.float32)
