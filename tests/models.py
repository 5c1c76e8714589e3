"""In-memory models for tests (no files): the made model's weights held in dicts."""

from __future__ import annotations


from strata.formats.quant_types import QuantType
from strata.reference.model import ModelParams
from strata.testing.models import SHAPES, make_dense, make_expert


class DictExperts:
    def __init__(self, experts: dict) -> None:
        self._experts = experts

    def expert(self, layer: int, expert: int):
        return self._experts[(layer, expert)]


def tiny_params(seed: int = 0, qtype: QuantType = QuantType.Q2_0, **overrides) -> ModelParams:
    cfg = SHAPES["tiny"].with_fields(**overrides) if overrides else SHAPES["tiny"]
    experts = {(l, e): make_expert(cfg, seed, l, e, qtype) for l in range(cfg.n_layers) for e in range(cfg.n_experts)}
    return ModelParams(cfg, make_dense(cfg, seed), DictExperts(experts))
