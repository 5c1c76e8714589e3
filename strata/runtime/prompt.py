"""The prompt path: chunked prefill through the expert cache (design §5, prompt processing).

The prompt is cut into chunks of `prefill_chunk` positions. Inside a held region
(`hold_region`: limbo is released at both edges, so prompt stream-ins cannot leak into decode)
each chunk is one window; per MoE layer the cache gets the union of the chunk's selected
experts. When the union does not fit beside what is pinned, the cache closes a pass (a `Use`),
the pass is computed at once, and the next pass may reuse its slots. Read-ahead runs as in
decode, on the chunk's mean guess logits; in a prompt it is optional (skipped when the arena is
full). Dense FFN layers are computed whole, with no cache turn.

Only the last chunk's head is computed (its last position, or every position for
`all_logits`), unless every position's logits are being dumped (`Config.logpos`); the last
position's head is computed alone either way, so dumping cannot change the returned logits.
"""

from __future__ import annotations

import numpy as np

from strata.cache.types import Use
from strata.model_config import Ffn
from strata.runtime.selector import slots_for, union_in_rank_order

__all__ = ["prefill_chunks"]


def prefill_chunks(engine, tokens: np.ndarray, *, all_logits: bool = False) -> np.ndarray:
    """Process `tokens` after the held positions (`engine`: a runtime StreamingEngine). A
    pipeline stage that does not embed takes the hidden state as `tokens`; one that does not
    head returns every position's hidden state (the next stage needs them all).

    Shapes:
        tokens: int64 [T]  ->  float32 [V] (the last position), or [T, V] with all_logits
        (a stage: hidden [T, D] in, hidden [T, D] out)
    """
    s, c, sel, cfg, stage = engine.streamer, engine.compute, engine.selector, engine.model.cfg, engine.stage
    chunk = engine.config.prefill_chunk
    window = all_logits  # the caller's: a long decode window (recurrent layers keep a snapshot per position)
    all_logits = all_logits or not stage.heads  # a middle stage passes every position's hidden state on
    s.hold_region(True)
    rows = []
    for start in range(0, len(tokens), chunk):
        last = start + chunk >= len(tokens)
        s.begin_window()
        if engine.ngram_rows is not None:  # PLE: the chunk's rows read ahead before layer 0
            engine.ngram_rows.read_ahead(np.concatenate([np.asarray(engine.tokens, np.int64), tokens[:start]]),
                                         tokens[start:start + chunk])
        x = c.embed(tokens[start:start + chunk]) if stage.embeds else tokens[start:start + chunk]
        moe = 0
        for layer in stage.layers:
            kind = cfg.kinds[layer]
            x = c.mixer(layer, x, window=window)
            if kind.ffn is Ffn.DENSE:
                x = c.dense_ffn(layer, x)
                continue
            m, moe = moe, moe + 1
            h = c.router_input(layer, x)
            selections = sel.select(m, c.router_logits(layer, h), s.resident_mask(m))
            parts = []

            def on_use(use: Use, layer=layer, h=h, selections=selections, parts=parts) -> None:
                slots, weights = slots_for(selections, use)  # this pass's experts only
                parts.append(c.routed(layer, h, slots, weights))

            s.at_layer(m, union_in_rank_order(selections), on_use=on_use)
            engine.after_layer(m, h)
            x = c.combine(x, parts, c.shared(layer, h))
        if not stage.heads:
            rows.append(x)
        elif engine.dumping or all_logits or last:
            logits = c.head(x) if all_logits else _last_head(c, x, engine.dumping)
            engine.dump(logits)
            rows.append(logits)
    s.hold_region(False)  # not reached on an error: the engine is unusable after one anyway
    return np.concatenate(rows) if all_logits else rows[-1][-1]


def _last_head(c, x, dumping: bool) -> np.ndarray:
    """The head on the last position alone, after the others' when dumping (every position's
    logits are written). [T, D] -> [1, V], or [T, V] when dumping"""
    last = c.head(x[-1:])
    return np.concatenate([c.head(x[:-1]), last]) if dumping and len(x) > 1 else last
