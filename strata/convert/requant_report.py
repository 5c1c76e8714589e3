"""What requantizing a GGUF's (or an FP8 checkpoint's) experts cost: the mean KLD of the converted
model's next-token distribution against the same model with the source's own dequantized experts
(float32), on a fixed text. The reference forward holds every expert in float32, so the measurement runs only
where they fit under MAX_FLOAT32_EXPERT_BYTES (tiny and small models); above it the report says
so and names the tool that measures it on the streamed model (`strata quality`)."""

from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path

import numpy as np

from strata.formats.expert_record import ExpertWeights
from strata.formats.quant_types import QuantType
from strata.reference.quants import quantize

MAX_FLOAT32_EXPERT_BYTES = 2 << 30  # the dequantized experts held at once by the reference forward
TEXT_TOKENS = 64  # positions compared (the start of strata's held-out text)


@dataclass(frozen=True)
class RequantKld:
    source_types: tuple[str, ...]  # the source's expert tensor types
    kld: float | None  # mean nats over TEXT_TOKENS positions; None: not measured (too large)
    positions: int
    source: str = "the GGUF's"  # whose dequantized experts are the reference, for the line

    def line(self, expert_type: QuantType) -> str:
        src = "/".join(self.source_types)
        if self.kld is None:
            return (f"experts requantized {src} -> {expert_type.name}; KLD not measured (float32 experts exceed "
                    f"{MAX_FLOAT32_EXPERT_BYTES >> 30} GiB): run strata quality on the result")
        return (f"experts requantized {src} -> {expert_type.name}: mean KLD {self.kld:.4g} nats vs {self.source} "
                f"dequantized experts ({self.positions} positions)")


class _FloatExperts:
    """Every expert as the source dequantizes it (`experts.read`), held as F32 ExpertWeights."""

    def __init__(self, experts, n_layers: int, n_experts: int) -> None:
        self._w = {}
        for l in range(n_layers):
            for e in range(n_experts):
                self._w[(l, e)] = ExpertWeights(*(quantize(QuantType.F32, a) for a in experts.read(l, e)))

    def expert(self, layer: int, expert: int) -> ExpertWeights:
        return self._w[(layer, expert)]


def requantization_kld(model_path: Path, experts, source_types: tuple[str, ...], source: str) -> RequantKld:
    """The converted model at `model_path` against itself with `experts.read`'s float32 experts;
    source_types and source (e.g. "the GGUF's") name the source in the report's line."""
    from importlib import resources

    from strata.loader import load
    from strata.reference.model import ModelParams, ModelState, forward
    from strata.reference.sampling import log_softmax

    with load(model_path) as model:
        cfg = model.cfg
        n_moe = len(cfg.moe_layers)
        size = 4 * 3 * cfg.hidden_size * cfg.expert_ffn_size * cfg.n_experts * n_moe
        src = tuple(source_types)
        if size > MAX_FLOAT32_EXPERT_BYTES:
            return RequantKld(src, None, 0, source)
        text = resources.files("strata.data").joinpath("heldout.txt").read_text()
        tokens = np.asarray(model.tokenizer.encode(text)[:TEXT_TOKENS])
        params = model.resident_params()
        ours, _ = forward(params, ModelState.empty(cfg), tokens)
        ref_params = ModelParams(cfg, params.dense, _FloatExperts(experts, n_moe, cfg.n_experts), rows=params.rows)
        ref, _ = forward(ref_params, ModelState.empty(cfg), tokens)
    lp, lq = log_softmax(ref.astype(np.float64)), log_softmax(ours.astype(np.float64))
    return RequantKld(src, float(np.mean(np.sum(np.exp(lp) * (lp - lq), axis=-1))), len(tokens), source)
