"""Which layers each pipeline stage owns: a contiguous range per rank, split by bytes or given.

A stage holds its layers' dense weights (as stored; counted here at float32's size, which scales
every matrix alike) and pages
its MoE layers' experts, so the split balances what each host must hold and stream: per layer
its dense bytes plus, for an MoE layer, its experts' bytes; the embedding goes to the first
stage, the final norm and head to the last. Among all contiguous splits the plan takes the one
whose largest stage is smallest (a small dynamic program: layers and stages are few).
"""

from __future__ import annotations

from dataclasses import dataclass

import numpy as np

from strata.errors import ConfigError
from strata.model_config import LayerRange, ModelConfig, TensorNames, dense_tensor_shapes

__all__ = ["PipelineOptions", "StagePlan", "layer_bytes", "plan_stages", "parse_stage_layers"]

FLOAT32_BYTES = 4  # every dense weight counted at float32's size: the split balances relative bytes
STOCK_TIMEOUT = 120.0  # seconds a rank waits for a neighbour before it calls the pipeline broken
STOCK_CONNECT_TIMEOUT = 60.0  # seconds the ranks may take to find each other at start


@dataclass(frozen=True)
class PipelineOptions:
    """How a pipeline run is laid out. stage_layers: layers per stage ("3,5"; empty: split by
    bytes); timeout: seconds any wait for a neighbour may take before every rank stops with an
    error (a dead or stuck rank is not a hang); connect_timeout: the same for the start."""

    stage_layers: str = ""
    timeout: float = STOCK_TIMEOUT
    connect_timeout: float = STOCK_CONNECT_TIMEOUT

    def __post_init__(self) -> None:
        if not self.timeout > 0 or not self.connect_timeout > 0:
            raise ConfigError(f"pipeline timeouts must be > 0 seconds, got {self.timeout}, {self.connect_timeout}")


@dataclass(frozen=True)
class StagePlan:
    """Every stage's layer range, in rank order, and the bytes each holds."""

    stages: tuple[LayerRange, ...]
    stage_bytes: tuple[int, ...]

    def describe(self) -> str:
        from strata.sizes import fmt_bytes

        return ", ".join(f"rank {r}: layers {s.start}-{s.stop - 1} ({fmt_bytes(b)})"
                         for r, (s, b) in enumerate(zip(self.stages, self.stage_bytes)))


def layer_bytes(cfg: ModelConfig, expert_bytes: int) -> tuple[np.ndarray, int, int]:
    """(bytes per layer [L], the first stage's extra bytes, the last stage's extra bytes):
    dense float32 tensors plus, for MoE layers, n_experts records of `expert_bytes`."""
    n = TensorNames
    per = np.zeros(cfg.n_layers, dtype=np.int64)
    first = last = 0
    for name, shape in dense_tensor_shapes(cfg).items():
        nbytes = int(np.prod(shape)) * FLOAT32_BYTES
        if name.startswith("blk."):
            per[int(name.split(".")[1])] += nbytes
        elif name == n.token_embd:
            first += nbytes
            last += nbytes if cfg.tie_embeddings else 0  # a tied head reads the embedding too
        else:
            last += nbytes
    for l in cfg.moe_layers:
        per[l] += cfg.n_experts * expert_bytes
    return per, first, last


def parse_stage_layers(text: str, n_layers: int, n_stages: int) -> tuple[int, ...]:
    """"3,5" -> (3, 5): layers per stage, which must add up to the model's."""
    try:
        counts = tuple(int(c) for c in text.split(","))
    except ValueError:
        raise ConfigError(f"stage_layers: want counts like 3,5, got {text!r}") from None
    if len(counts) != n_stages or min(counts) < 1 or sum(counts) != n_layers:
        raise ConfigError(f"stage_layers: {text!r} must be {n_stages} positive counts adding up to {n_layers} layers")
    return counts


def _balanced_counts(per: np.ndarray, first: int, last: int, n_stages: int) -> tuple[int, ...]:
    """Contiguous counts minimizing the largest stage's bytes (DP over cut points)."""
    L = len(per)
    prefix = np.concatenate([[0], np.cumsum(per)])

    def cost(a: int, b: int) -> int:  # layers [a, b) as one stage
        return int(prefix[b] - prefix[a]) + (first if a == 0 else 0) + (last if b == L else 0)

    inf = float("inf")
    best = [[inf] * (L + 1) for _ in range(n_stages + 1)]  # best[s][b]: s stages over layers [0, b)
    cut = [[0] * (L + 1) for _ in range(n_stages + 1)]
    best[0][0] = 0
    for s in range(1, n_stages + 1):
        for b in range(s, L + 1):
            for a in range(s - 1, b):
                c = max(best[s - 1][a], cost(a, b))
                if c < best[s][b]:
                    best[s][b], cut[s][b] = c, a
    bounds, b = [], L
    for s in range(n_stages, 0, -1):
        bounds.append(b - cut[s][b])
        b = cut[s][b]
    return tuple(reversed(bounds))


def plan_stages(cfg: ModelConfig, n_stages: int, *, expert_bytes: int, stage_layers: str = "") -> StagePlan:
    """Each of `n_stages` ranks' layer range: as `stage_layers` says, else balanced by bytes.
    Every stage must hold an MoE layer (its cache needs one)."""
    if not 1 <= n_stages <= cfg.n_layers:
        raise ConfigError(f"pipeline: {n_stages} stages for a model of {cfg.n_layers} layers")
    per, first, last = layer_bytes(cfg, expert_bytes)
    counts = (parse_stage_layers(stage_layers, cfg.n_layers, n_stages) if stage_layers
              else _balanced_counts(per, first, last, n_stages))
    stages, start = [], 0
    for c in counts:
        stages.append(LayerRange(start, start + c, cfg.n_layers))
        start += c
    for r, s in enumerate(stages):
        if not s.moe_layers(cfg):
            raise ConfigError(f"stage_layers: rank {r}'s layers {s.start}-{s.stop - 1} hold no MoE layer "
                              "(each stage streams its own experts); move a boundary")
    sizes = tuple(int(per[s.start:s.stop].sum()) + (first if s.embeds else 0) + (last if s.heads else 0)
                  for s in stages)
    return StagePlan(tuple(stages), sizes)
