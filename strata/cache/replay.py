"""A minimal decode replay over a routing trace: one window per token, the cache machine
stepped exactly as the runtime steps it. The analysis kit's simulator (closed-loop MoCE,
capacity sweeps, Belady) builds on `step`; this driver is only the open-loop core.
"""

from __future__ import annotations

import numpy as np

from strata.cache.machine import CacheState, initial_state, step
from strata.cache.types import AfterLayer, AtLayer, BeginWindow, CacheConfig, Read, ReadDone

__all__ = ["replay"]


def replay(config: CacheConfig, selected: np.ndarray, guesses: np.ndarray | None = None,
           guesses2: np.ndarray | None = None, *, state: CacheState | None = None,
           read_aheads_land: bool = True) -> CacheState:
    """Replay tokens through the cache; return the final state (`.totals` has the counts).

    Shapes: selected [tokens, layers, k] (rank order); guesses [tokens, layers, G]: after
    layer l, ranked guesses for l+1; guesses2 likewise for l+2 (prefetch2).
    `read_aheads_land`: every read-ahead completes before the next layer's turn (ReadDone is
    sent for it), so `late_readaheads` stays 0; off, every claimed read-ahead counts as late.
    Decisions are the same either way.
    """
    s = state if state is not None else initial_state(config)
    n_tokens, n_layers = selected.shape[:2]
    sel = selected.tolist()
    gs = guesses[..., :config.prefetch_depth].tolist() if guesses is not None else None
    gs2 = guesses2[..., :config.prefetch_depth].tolist() if guesses2 is not None else None
    pending: list[ReadDone] = []
    for t in range(n_tokens):
        s, _ = step(s, BeginWindow())
        for layer in range(n_layers):
            for done in pending:
                s, _ = step(s, done)
            pending = []
            s, _ = step(s, AtLayer(layer, sel[t][layer]))
            g = gs[t][layer] if gs is not None else ()
            g2 = gs2[t][layer] if gs2 is not None else ()
            s, actions = step(s, AfterLayer(layer, g, g2))
            if read_aheads_land:
                pending = [ReadDone(a.slot, a.ticket) for a in actions if isinstance(a, Read)]
    return s
