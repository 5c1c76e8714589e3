"""The streamed expert layer: mlx-lm's switch layer over arena slots, and the cache turn it takes.

`StreamedSwitch` stands where a family's `SwitchGLU` (or non-gated `SwitchMLP`: Nemotron-H's)
stood and is called as it was, with the hidden state x and the expert indices the family's own
router chose. Its MoE layer's turn:

    indices -> host; the experts they name, once, in order of first appearance (token, rank)
    at_layer(m, experts): hits, read-ahead claims, urgent reads, wait -> Use(slots) per pass
    per pass: the original switch layer (its projections now read the arena) on slot indices
    after_layer(m, guesses from the next MoE layer's gate on x): retire, release limbo, read ahead

A slot index selects the same bytes the expert index selected in the stacked tensors, and every
row of mlx-lm's gather_qmm reads only its own expert, so the output is mlx-lm's bit for bit.
In a prompt chunk (a held region) a layer whose union of experts does not fit is run in several
passes: each pass computes every (token, rank) entry on a slot of that pass, keeps its own
entries (`mx.where`), and is evaluated before the cache may reuse its slots; a decode window
has one pass and stays lazy (its slots are pinned for the whole window).
"""

from __future__ import annotations

import mlx.core as mx
import mlx.nn as nn
import numpy as np

from strata.cache.types import Use
from strata.runtime.selector import top_k_experts
from strata.runtime.streamer import Streamer

__all__ = ["StreamedSwitch", "ExpertStream"]


class ExpertStream:
    """The turns of every streamed layer of one model, in MoE-layer order, through one Streamer.

    scorers: per MoE layer, its gate's read-ahead scorer (strata.tier2.guesses) or None.
    `held` is set by the engine while a prompt chunk runs (several passes may come).
    `observer(m, x, indices)`, where set, sees every layer's input and the family's own
    selections (host int array [..., k]) before its turn: `strata trace` records them."""

    def __init__(self, streamer: Streamer, scorers: list, *, prefetch: int, prefetch2: bool,
                 split_turn: bool) -> None:
        self.streamer = streamer
        self.scorers = scorers
        self.prefetch, self.prefetch2, self.split_turn = prefetch, prefetch2, split_turn
        self.held = False
        self.split_layers = 0  # layer turns that ran in more than one pass (prompt chunks on a small arena)
        self.observer = None

    def routed(self, m: int, inner: nn.Module, x: mx.array, indices: mx.array) -> mx.array:
        """The switch layer's output on arena slots (mlx-lm's shapes: x [..., D], indices
        [..., k] -> [..., k, D])."""
        idx = np.array(indices)  # [..., k]: the family's own selections (a host sync, as every streamer's)
        if self.observer is not None:
            self.observer(m, x, idx)
        selected = tuple(dict.fromkeys(idx.reshape(-1).tolist()))
        passes: list[tuple[np.ndarray, mx.array]] = []

        def on_use(use: Use) -> None:
            table = np.zeros(max(idx.max() + 1, max(use.experts) + 1), np.int32)
            table[list(use.experts)] = use.slots
            mine = np.isin(idx, use.experts)
            slots = np.where(mine, table[idx], use.slots[0]).astype(np.int32)
            y = inner(x, mx.array(slots))
            if self.held:  # the cache may reuse these slots for the next pass or layer
                mx.eval(y)
            passes.append((mine, y))

        s = self.streamer
        s.at_layer(m, selected, on_use=on_use)
        out = passes[0][1]
        self.split_layers += len(passes) > 1
        for mine, y in passes[1:]:  # each entry belongs to exactly one pass
            out = mx.where(mx.array(mine)[..., None], y, out)
        g1 = self._guesses(m + 1, x)
        g2 = self._guesses(m + 2, x) if self.prefetch2 else ()
        s.after_layer(m, g1, g2, in_turn=not self.split_turn)
        return out

    def _guesses(self, m: int, x: mx.array) -> tuple[int, ...]:
        if not self.prefetch or m >= len(self.scorers) or self.scorers[m] is None:
            return ()
        z = self.scorers[m](x)  # [T, E]
        z = z[0] if len(z) == 1 else z.mean(axis=0, dtype=np.float32)
        return top_k_experts(z, min(self.prefetch, z.shape[-1]))


class StreamedSwitch(nn.Module):
    """A family's SwitchGLU / SwitchMLP whose stacked expert tensors are the arena's (strata.tier2.arena):
    called like it, `(x, indices)`, it takes MoE layer `moe_index`'s cache turn first."""

    def __init__(self, inner: nn.Module, moe_index: int, stream: ExpertStream) -> None:
        super().__init__()
        self.inner = inner
        self.moe_index = moe_index
        self.stream = stream

    def __call__(self, x: mx.array, indices: mx.array) -> mx.array:
        return self.stream.routed(self.moe_index, self.inner, x, indices)
