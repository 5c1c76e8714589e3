"""The prompt path: chunked prefill through the expert cache (SPEC §5, prompt processing).

The prompt is cut into chunks of `prefill_chunk` positions. Inside a held region
(`hold_region`: limbo is released at both edges, so prompt stream-ins cannot leak into decode)
each chunk is one window; per layer the cache gets the union of the chunk's selected experts.
When the union does not fit beside what is pinned, the cache closes a pass (a `Use`), the pass
is computed at once, and the next pass may reuse its slots. Read-ahead runs as in decode, on
the chunk's mean guess logits; in a prompt it is optional (skipped when the arena is full).
"""

from __future__ import annotations

import numpy as np

from strata.cache.types import Use
from strata.runtime.selector import union_in_rank_order

__all__ = ["prefill"]


def prefill(engine, tokens: np.ndarray) -> np.ndarray:
    """Process `tokens` after the cached positions; return the last position's logits [V].

    Shapes:
        tokens: int64 [T]  ->  float32 [V]
    """
    from strata.runtime.decode import slots_for

    s, c, sel, cfg = engine.streamer, engine.compute, engine.selector, engine.model.cfg
    chunk = engine.config.prefill_chunk
    s.hold_region(True)
    logits = None
    for start in range(0, len(tokens), chunk):
        s.begin_window()
        x = c.embed(tokens[start:start + chunk])
        for layer in range(cfg.n_layers):
            x = c.attention(layer, x)
            h = c.router_input(layer, x)
            selections = sel.select(layer, c.router_logits(layer, h), s.resident_mask(layer))
            parts = []

            def on_use(use: Use, layer=layer, h=h, selections=selections, parts=parts) -> None:
                slots, weights = slots_for(selections, use)  # this pass's experts only
                parts.append(c.routed(layer, h, slots, weights))

            s.at_layer(layer, union_in_rank_order(selections), on_use=on_use)
            engine._after_layer(layer, h)
            x = c.combine(x, parts, c.shared(layer, h))
        logits = c.head(x)
        engine._dump(logits)
    s.hold_region(False)  # not reached on an error: the engine is unusable after one anyway
    return logits[-1]
