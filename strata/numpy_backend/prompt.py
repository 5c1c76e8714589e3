"""The numpy backend's all-resident prompt path: the reference's layers, with routed experts
grouped by expert and the head only where logits are returned.

`prompt_forward` is the reference forward itself (strata.reference.model.forward: its layer
loop and its residual strategy, so every layer kind and residual goes through the reference's
dispatch) with two differences: each selected expert is computed once over all the tokens that
chose it (strata.numpy_backend.grouped), and the prefill head runs on the last position alone.
Held to `forward` within FLOAT32_REORDER (tests/numpy_backend/test_numpy_prompt.py).
"""

from __future__ import annotations

import functools

import numpy as np

from strata.numpy_backend.grouped import grouped_terms, rank_sum
from strata.numpy_backend.quant_kernels import REFERENCE_OPS, CpuOps
from strata.reference import model as ref
from strata.reference.experts import expert_act
from strata.reference.routing import Selection

__all__ = ["prompt_forward"]


def _ids_and_weights(selections: list[Selection]) -> tuple[np.ndarray, np.ndarray]:
    """Each token's selected experts (-1: none at that rank) and weights, in rank order.
    -> int64 [T, k], float32 [T, k]"""
    k = max((len(s.experts) for s in selections), default=0)
    ids = np.full((len(selections), k), -1, np.int64)
    weights = np.zeros((len(selections), k), np.float32)
    for t, s in enumerate(selections):
        ids[t, :len(s.experts)] = s.experts
        weights[t, :len(s.weights)] = s.weights
    return ids, weights


def grouped_moe_output(params: ref.ModelParams, layer: int, h: np.ndarray, selections: list[Selection], *,
                       ops: CpuOps = REFERENCE_OPS) -> np.ndarray:
    """`ref.moe_output`, each expert computed once over its tokens. [T, D] -> [T, D]"""
    m = params.cfg.moe_index(layer)
    ids, weights = _ids_and_weights(selections)
    terms = grouped_terms(h, ids, weights, lambda e: params.experts.expert(m, e), expert_act(params.cfg),
                          expert=ops.expert, stack=ops.stack)
    return rank_sum(terms) + ref.shared_output(params, layer, h)


def prompt_forward(params: ref.ModelParams, state: ref.ModelState, tokens: np.ndarray, *,
                   select: ref.SelectFn | None = None, window: bool = False,
                   all_logits: bool = False, ops: CpuOps = REFERENCE_OPS) -> tuple[np.ndarray, ref.ModelState]:
    """Process `tokens` after the `state.length` cached positions, every layer held (no
    pipeline stage). Tokens are routed one at a time in order, as `ref.forward` routes them.
    `window`: a decode window (recurrent layers keep a snapshot per position). `ops`: the routed
    experts' products (the float32 reference's, or the compiled twins; the dense products are
    `params.dense.linear`'s, which the engine chose with the same ops).

    Shapes:
        tokens: [T] int -> logits float32 [1, vocab] (the last position), or [T, vocab] with all_logits
    """
    return ref.forward(params, state, tokens, select=select, window=window,
                       moe_output=functools.partial(grouped_moe_output, ops=ops), last_only=not all_logits)
