"""`strata trace` on a tier-2 model: the family's own selections, and the read-ahead scores its
gates gave, recorded from a real run.

Tier 2 leaves routing to mlx-lm's model file, so the trace cannot re-derive it from router
logits (strata.tools.trace's module doc). It records instead, at every MoE layer's turn
(`ExpertStream.observer`), what the streamed switch layer was handed: the family's selections
[.., k] (rank order, as mlx-lm's gate produced them) and the layer's input x, on which it
evaluates the read-ahead scorers of this layer (its own selection scores, `logits`) and of the
next two MoE layers (the guesses, exactly the runtime's `ExpertStream._guesses` inputs). The run
takes the arena the budget rule gives (routing does not depend on it: tier 2 is exact), in decode
order by default: one position per forward, as generation computes it, so a replay at the run's
arena makes the runtime's cache decisions (tests/tools/test_tier2_tools.py holds that).
"""

from __future__ import annotations

from collections.abc import Callable

import numpy as np

from strata.config import Config
from strata.errors import ConfigError
from strata.layer_kinds import RoutingOrder
from strata.reference.routing import RouterRule
from strata.tools.trace import Trace

__all__ = ["record_tier2_trace", "GUESS_AHEAD"]

GUESS_AHEAD = (1, 2)  # the read-ahead depths recorded: the next MoE layer, and two ahead (prefetch2)


class _Recorder:
    """Per MoE layer, the rows of every call in order: selections [n, k], own scores [n, E],
    guesses a layers ahead [n, E]."""

    def __init__(self, scorers: list, n_experts: int) -> None:
        self.scorers, self.E = scorers, n_experts
        L = len(scorers)
        self.selected = [[] for _ in range(L)]
        self.scores = [[] for _ in range(L)]
        self.guesses = {a: [[] for _ in range(L - a)] for a in GUESS_AHEAD if a < L}

    def _score(self, m: int, x, rows: int) -> np.ndarray:
        scorer = self.scorers[m]
        if scorer is None:  # a gate of a form tier 2 does not score: no read-ahead into it
            return np.full((rows, self.E), np.nan, np.float32)
        return scorer(x).reshape(rows, self.E)

    def __call__(self, m: int, x, idx: np.ndarray) -> None:
        k = idx.shape[-1]
        sel = idx.reshape(-1, k).astype(np.int64)
        self.selected[m].append(sel)
        self.scores[m].append(self._score(m, x, len(sel)))
        for a, per_layer in self.guesses.items():
            if m + a < len(self.scorers):
                per_layer[m].append(self._score(m + a, x, len(sel)))

    def trace(self, tokens: np.ndarray, top_k: int, meta: dict) -> Trace:
        T, L, E = len(tokens), len(self.scorers), self.E
        selected = np.stack([np.concatenate(s) for s in self.selected], axis=1)  # [T, L, k]
        if selected.shape[0] != T:
            raise RuntimeError(f"tier-2 trace: {selected.shape[0]} positions recorded for {T} tokens")
        guesses = {a: (np.stack([np.concatenate(g) for g in per], axis=1) if per else np.zeros((T, 0, E), np.float32))
                   for a, per in self.guesses.items()}
        return Trace(tokens=tokens, router_inputs=np.zeros((T, L, 0), np.float32),
                     routers=np.zeros((L, E, 0), np.float32),
                     logits=np.stack([np.concatenate(s) for s in self.scores], axis=1).astype(np.float32),
                     selected=selected, weights=np.full((T, L, top_k), np.nan, np.float32),
                     rule=RouterRule(top_k, RoutingOrder.TOPK_SOFTMAX), meta=meta, guesses=guesses,
                     family_routing=True)


def record_tier2_trace(model, tokens, *, decode_order: bool = True, meta: dict | None = None,
                       progress: Callable[[int], None] | None = None, config: Config | None = None) -> Trace:
    """Run the tier-2 `model` over `tokens` (the budget rule's arena, or `config`'s) and record its routing (module
    doc). decode_order off: one prompt pass over all of them (mlx-lm's prefill schedule; faster,
    rounds differently). `progress(n)`: tokens done so far.

    Shapes: tokens [T] -> Trace with T tokens, L MoE layers, E experts, width-0 router inputs
    """
    from strata.tier2.engine import Tier2Engine

    if config is not None and not config.moce_policy().exact:
        raise ConfigError("a tier-2 trace records the family's own routing: run `strata trace` with --moce-lambda 0 "
                          "(a replay then tries MoCE policies on a native model's trace)")
    tokens = np.asarray(tokens, dtype=np.int64)
    if tokens.ndim != 1 or tokens.size == 0:
        raise ValueError(f"a trace needs a non-empty token sequence, got shape {tokens.shape}")
    cfg = model.cfg
    recorder = _Recorder(model.scorers, cfg.n_experts)
    with Tier2Engine.open(model, config or Config()) as engine:
        engine.stream.observer = recorder
        if decode_order:
            for n, t in enumerate(tokens.tolist(), 1):
                engine.decode(t)
                if progress is not None:
                    progress(n)
        else:
            engine.prefill(tokens)
            if progress is not None:
                progress(len(tokens))
    return recorder.trace(tokens, cfg.n_experts_per_token, dict(meta or {}, tier=2, model_type=cfg.model_type))
