"""Routed experts grouped by expert: each selected expert computed once over every token that
chose it (gather the rows, one matmul per projection), instead of once per token.

The numpy backend's prompt path and its streaming compute share this, so the two stay bit for
bit alike; against the reference's per-token `routed_experts` only the matmul's summation order
differs (a [n, D] matmul instead of n GEMVs). The terms are summed per token in rank order from
zero, as `routed_experts` does (a rank a token lacks adds an exact 0).
"""

from __future__ import annotations

from typing import Callable

import numpy as np

from strata.formats.expert_record import ExpertWeights
from strata.reference.experts import ExpertAct, swiglu_expert

__all__ = ["grouped_terms", "rank_sum"]


def grouped_terms(h: np.ndarray, ids: np.ndarray, weights: np.ndarray,
                  weights_of: Callable[[int], ExpertWeights], act: ExpertAct, *,
                  expert: Callable[..., np.ndarray] = swiglu_expert,
                  stack: Callable[..., np.ndarray] | None = None) -> np.ndarray:
    """weight[t, r] * expert_{ids[t, r]}(h[t]) for every selected (t, r); zeros where ids < 0.

    `ids` names an expert (or an arena slot: whatever `weights_of` takes); `expert` computes one
    (the reference's `swiglu_expert` or its compiled twin, strata.numpy_backend.quant_kernels);
    `stack`, where given, computes one token's experts in one call (decode: one row, k experts,
    each term still its own expert's output times its weight). A group of one row is
    computed on its [D] row, as the per-token path does, so decode's arithmetic is unchanged.

    Shapes:
        h: [T, D]; ids: int [T, k] (-1: none); weights: float32 [T, k] -> terms float32 [T, k, D]
    """
    terms = np.zeros((*ids.shape, h.shape[-1]), np.float32)
    if stack is not None and ids.shape[0] == 1:
        r = np.nonzero(ids[0] >= 0)[0]
        if len(r):
            ys = stack([weights_of(int(e)) for e in ids[0, r]], h[0], act)  # [n, D]
            terms[0, r] = weights[0, r][:, None] * ys
        return terms
    for e in np.unique(ids[ids >= 0]).tolist():
        t, r = np.nonzero(ids == e)
        w = weights_of(int(e))
        if len(t) == 1:
            terms[t[0], r[0]] = weights[t[0], r[0]] * expert(w, h[t[0]], act)
        else:
            terms[t, r] = weights[t, r][:, None] * expert(w, h[t], act)
    return terms


def rank_sum(terms: np.ndarray) -> np.ndarray:
    """Each token's terms summed in rank order from zero. [T, k, D] -> [T, D] float32"""
    out = np.zeros((terms.shape[0], terms.shape[2]), np.float32)
    for r in range(terms.shape[1]):
        out += terms[:, r]
    return out
