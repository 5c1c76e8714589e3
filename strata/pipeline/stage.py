"""A pipeline stage's engine: the runtime's StreamingEngine over one layer range.

The same loop as one host (strata.runtime.decode, .prompt) iterates the stage's layers; the
stage loads only the dense tensors they use (`loader.load(layers=...)`), its cache machine
counts only its MoE layers, and its reader pool reads only their records (StageExperts). A
stage always streams: where every local expert fits, its arena holds them all, which is what the
all-resident engine would compute (λ = 0: routing does not depend on residency).
"""

from __future__ import annotations

from strata.config import Backend, Config
from strata.errors import ConfigError
from strata.model_config import LayerRange
from strata.pipeline.experts import StageExperts
from strata.runtime.budget import ArenaPlan

__all__ = ["open_stage", "stage_arena", "backend_note"]

SMALLEST = "min"  # an arena size meaning: the smallest legal arena for the stage


def stage_arena(model, config: Config, stage: LayerRange, arena: str = "") -> ArenaPlan:
    """The stage's arena: `arena` ("min", a size like 300slots; default the config's `--arena`
    or the budget rule), at most one slot per local expert."""
    from dataclasses import replace

    from strata.runtime.decode import arena_plan_for, cache_config_for

    n_local = len(stage.moe_layers(model.cfg)) * model.cfg.n_experts
    if arena == SMALLEST:
        arena = f"{cache_config_for(model, config, 1, stage).min_capacity}slots"
    plan = arena_plan_for(model, config.replace(arena=arena) if arena else config, stage)
    return plan if plan.streaming else replace(plan, streaming=True, slots=n_local)


def backend_note(model, config: Config) -> str | None:
    """The line that says a stage runs numpy where `--backend auto` would give one host MLX
    (a GPU and Q2_0 experts), else None: a pipeline is slower than one host there, not silently."""
    from strata.engines import resolve_backend

    if config.backend is not Backend.AUTO or resolve_backend(model, config) is not Backend.MLX:
        return None
    return "backend auto: this stage runs on numpy although MLX has a GPU here (MLX stages are not built yet)"


def open_stage(model, config: Config, stage: LayerRange, *, arena: str = "", hook=None, keep_trace: bool = False):
    """The StreamingEngine of `stage` over `model` (loaded with `layers=stage`). numpy only: the
    MLX backend's weights are built for every layer at once (docs/pipeline.md)."""
    from strata.numpy_backend.engine import streaming_parts
    from strata.runtime.decode import StreamingEngine
    from strata.runtime.io import ReaderPool

    if config.backend is Backend.MLX:
        raise ConfigError("backend: a pipeline stage runs on the numpy backend (MLX stages are not built yet)")
    plan = stage_arena(model, config, stage, arena)
    arena_, compute, notes = streaming_parts(model, config, plan, layers=stage)
    note = backend_note(model, config)
    notes = notes + ((note,) if note else ())  # in the stage's stream report (io)
    view = StageExperts(model.experts_file, stage.moe_start(model.cfg), len(stage.moe_layers(model.cfg)))
    pool = ReaderPool(view, arena_, threads=config.io_threads, direct=config.direct_io, verify=config.verify_reads,
                      timeout=config.io_timeout, hook=hook, switch_interval=config.io_switch_ms / 1e3)
    try:
        return StreamingEngine(model, config, arena_, compute, pool, keep_trace=keep_trace, notes=notes,
                               kind="numpy streaming stage", stage=stage)
    except BaseException:
        pool.close()
        raise
