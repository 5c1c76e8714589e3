"""What a float16 KV cache costs in quality (issue 19): the same text decoded one token at a time
twice through the reference forward, once with exact float32 caches and once with every attention
layer's cache stored at another precision (`reference.attention.KVPrecision`), scored in decode
order as the MoCE quality run is (tools/quality.py): the KLD of the next-token distributions,
KL(P_f32 || P_other), and the perplexity of the text under both.

Routing is the model's own rule in both runs, so any difference comes from the cache's rounding
(and from what it changes downstream, an expert picked differently included).
"""

from __future__ import annotations

from dataclasses import dataclass

import numpy as np

from strata.reference.attention import KVPrecision, LayerKV
from strata.reference.model import ModelParams, ModelState, forward
from strata.tools.quality import _perplexity, kld_rows

__all__ = ["KVQuality", "with_precision", "decode_logits", "kv_quality"]


@dataclass(frozen=True)
class KVQuality:
    """KLD(P_f32 || P_precision) over positions warmup.. (nats), and both perplexities."""

    precision: KVPrecision
    positions: int
    kld_mean: float
    kld_p90: float
    kld_p99: float
    kld_max: float
    ppl_f32: float
    ppl: float
    argmax_agree: float  # fraction of positions whose most likely next token is the same


def with_precision(state: ModelState, precision: KVPrecision) -> ModelState:
    """`state` with every attention layer's (empty) cache at `precision`; other layers as they are."""
    if any(isinstance(s, LayerKV) and s.length for s in state.layers):
        raise ValueError("with_precision: the caches must be empty (rounding is applied as positions are written)")
    return ModelState(tuple(LayerKV(s.keys, s.values, precision) if isinstance(s, LayerKV) else s
                            for s in state.layers))


def decode_logits(params: ModelParams, tokens, precision: KVPrecision) -> np.ndarray:
    """Every position's next-token logits, the text fed one token at a time (decode order).
    Shapes: tokens [T] -> [T, vocab] float32"""
    state = with_precision(ModelState.empty(params.cfg), precision)
    rows = []
    for tok in np.asarray(tokens):
        logits, state = forward(params, state, np.array([int(tok)]))
        rows.append(logits[-1])
    return np.stack(rows)


def kv_quality(params: ModelParams, tokens, precision: KVPrecision = KVPrecision.F16, *,
               warmup: int = 0) -> KVQuality:
    """KLD and perplexity of decoding `tokens` with caches at `precision` against float32."""
    tokens = np.asarray(tokens)
    if not 0 <= warmup < len(tokens):
        raise ValueError(f"kv_quality: warmup {warmup} must be below the text's {len(tokens)} tokens")
    ref = decode_logits(params, tokens, KVPrecision.F32)
    got = ref if precision is KVPrecision.F32 else decode_logits(params, tokens, precision)
    kld = kld_rows(ref[warmup:], got[warmup:])
    agree = float(np.mean(np.argmax(ref[warmup:], -1) == np.argmax(got[warmup:], -1)))
    return KVQuality(precision, len(kld), float(kld.mean()), float(np.quantile(kld, 0.9)),
                     float(np.quantile(kld, 0.99)), float(kld.max()), _perplexity(ref, tokens, warmup),
                     _perplexity(got, tokens, warmup), agree)
