"""DeepSeek-V3's multi-token-prediction ("nextn") layer: the next-next token's logits.

DeepSeek-V3 / Kimi-K2 / GLM-4.7-Flash and GLM-4.5 checkpoints carry `num_nextn_predict_layers` =
1 extra layer (model.layers.{n}) that predicts the token after the next one from the target's last
hidden state h_t (after its final norm) and the embedding of the token at t + 1:

    x_t = eh_proj([enorm(embed(token_{t+1})) ; hnorm(h_t)])     eh_proj: [D, 2D]
    y   = decoder_layer(x)                                      the model's MoE layer kind, causal
    logits_t = shared_head.head(shared_head.norm(y_t))

as DeepSeek-V3's technical report (§2.2) and the published serving code (vLLM's
`deepseek_mtp.py`) compute it; transformers computes the target only and drops the layer. The
decoder layer is one of the model's own MoE layer kind (MLA + MoE for DeepSeek-V3, attention +
MoE for GLM-4.5), so it is computed by the reference's pieces (layers.py) as layer 0 of a
one-layer model over the kept tensors (`nextn_params`; names in strata/families/deepseek.py);
its attention attends over its own earlier positions.
"""

from __future__ import annotations

import dataclasses
from typing import Mapping

import numpy as np

from strata.families.deepseek import NEXTN_NAMES, NEXTN_PREFIX, nextn_expert_name
from strata.formats.expert_record import ExpertWeights
from strata.formats.quant_types import QuantType
from strata.model_config import ModelConfig
from strata.reference.attention import rms_norm
from strata.reference.layers import (ModelParams, layer_router_logits, layer_selections, mixer_block, moe_output,
                                     plain_select, router_input)
from strata.reference.mixers import mixer_for
from strata.reference.quants import quantize

__all__ = ["NextnLayer", "nextn_params"]


class _NextnExperts:
    """The nextn layer's routed experts (dense tensors, one per expert and projection) as the
    one-layer model's MoE layer 0, widened to float32 when a token routes to them."""

    def __init__(self, dense: Mapping[str, np.ndarray]) -> None:
        self._dense = dense

    def expert(self, layer: int, expert: int) -> ExpertWeights:
        widen = lambda p: np.asarray(self._dense[nextn_expert_name(p, expert)], np.float32)  # noqa: E731
        return ExpertWeights(*(quantize(QuantType.F32, widen(p)) for p in ("gate", "up", "down")))


def nextn_params(cfg: ModelConfig, dense: Mapping[str, np.ndarray]) -> ModelParams:
    """The nextn layer's decoder layer as a one-layer model (its `nextn.blk.0.*` tensors as `blk.0.*`)."""
    one = dataclasses.replace(cfg, n_layers=1, layer_types=(cfg.kinds[cfg.moe_layers[0]],),
                              sigmoid=dataclasses.replace(cfg.sigmoid, nextn_layers=0))
    layer = {name[len(NEXTN_PREFIX):]: np.asarray(dense[name], np.float32) for name in dense
             if name.startswith(NEXTN_PREFIX + "blk.0.")}
    return ModelParams(one, layer, _NextnExperts(dense))


class NextnLayer:
    """The kept nextn layer of a model (`cfg.sigmoid.nextn_layers` = 1), float32."""

    def __init__(self, cfg: ModelConfig, dense: Mapping[str, np.ndarray]) -> None:
        get = lambda key: np.asarray(dense[NEXTN_NAMES[key]], np.float32)  # noqa: E731
        self.eps = cfg.rms_norm_eps
        self.eh_proj, self.enorm, self.hnorm = get("eh_proj"), get("enorm"), get("hnorm")
        self.head_norm, self.head = get("shared_head_norm"), get("shared_head_head")
        self.params = nextn_params(cfg, dense)

    def logits(self, hidden: np.ndarray, next_embeddings: np.ndarray) -> np.ndarray:
        """Logits for the token after next at every position 0..T-1 (the layer attends causally
        over them). Shapes: hidden [T, D] (the target's final-normed hidden states);
        next_embeddings [T, D] (embed(token at t + 1)) -> [T, V]"""
        p = self.params
        x = np.concatenate([rms_norm(np.asarray(next_embeddings, np.float32), self.enorm, self.eps),
                            rms_norm(np.asarray(hidden, np.float32), self.hnorm, self.eps)], -1) @ self.eh_proj.T
        x, _ = mixer_block(p, 0, mixer_for(p.cfg.kinds[0].mixer).empty_state(p.cfg), x)
        h = router_input(p, 0, x)
        selections = layer_selections(p.cfg, plain_select(p.cfg, p.dense), 0, layer_router_logits(p, 0, h))
        x = x + moe_output(p, 0, h, selections)
        return rms_norm(x, self.head_norm, self.eps) @ self.head.T
