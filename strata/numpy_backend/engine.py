"""Engines on numpy: `ReferenceEngine` (the reference forward, every expert resident) and the
parts a numpy streaming engine is assembled from (`streaming_parts`: arena and compute; the
runtime adds the reader pool and the loop, strata.engines puts them together)."""

from __future__ import annotations

import dataclasses
import warnings

import numpy as np

from strata.formats.dense_weights import as_dense_weights
from strata.numpy_backend.prompt import prompt_forward
from strata.formats.quant_types import QuantType
from strata.numpy_backend.quant_kernels import COMPILED_TYPES, REFERENCE_OPS, CpuOps, compiled_ops
from strata.reference.model import ModelParams, ModelState, SelectFn, forward
from strata.runtime.ngram_source import RowCacheOwner, ple_rows_for
from strata.threads import kernel_threads
from strata.session import StateEngine

__all__ = ["ReferenceEngine", "open_resident", "streaming_parts"]


class ReferenceEngine(RowCacheOwner, StateEngine):
    """The pure-numpy forward, all experts resident: the definition of correct output.
    `select` routes each token (default: the model's own rule). Decode runs the reference
    `forward` itself; a prompt or a window runs `prompt_forward` (the same layers, experts
    grouped over the tokens that chose them, the prefill head on the last position only).
    `ops`: the routed experts' and the head's products. Built directly the engine keeps the
    float32 reference's; `open` (what open_engine uses) takes the compiled twins under
    `Config.cpu_kernels` (strata.numpy_backend.quant_kernels), and then decodes through
    `prompt_forward` too, which on one token is `forward`'s arithmetic with those products."""

    kind = "reference"
    takes_snapshots = True  # its ModelState is frozen: a forward returns a new one (strata/sharing.py)

    def __init__(self, params: ModelParams, *, select: SelectFn | None = None, model=None, config=None,
                 expert_reads: int = 0, ops: CpuOps = REFERENCE_OPS) -> None:
        super().__init__(model, config)
        self.params = dataclasses.replace(params, dense=ops.dense(params.dense))  # its `linear`: the dense products
        self.ops = ops
        self.select = select
        self.state = ModelState.empty(params.cfg)
        self._reads = expert_reads

    @classmethod
    def open(cls, model, config=None, *, ple=None) -> "ReferenceEngine":
        """Every expert of `model` (a strata.loader.Model) read once into memory. ple: a PLE
        model's row source (strata.runtime.ngram_source.PleRows; the engine closes its cache)."""
        params = model.resident_params()
        if ple is not None:
            params = dataclasses.replace(params, rows=ple.rows)
        engine = cls(params, model=model, config=config, expert_reads=model.experts_file.header.n_records,
                     ops=cpu_ops(config))
        engine._own_row_cache(ple)
        return engine

    def _forward(self, tokens: np.ndarray, *, window: bool = False) -> np.ndarray:
        self._read_ahead(tokens)
        if self.ops is REFERENCE_OPS:
            logits, self.state = forward(self.params, self.state, tokens, select=self.select, window=window)
        else:
            logits, self.state = prompt_forward(self.params, self.state, tokens, select=self.select, window=window,
                                                all_logits=True, ops=self.ops)
        return logits

    def _prefill(self, tokens: np.ndarray) -> np.ndarray:
        self._read_ahead(tokens)
        logits, self.state = prompt_forward(self.params, self.state, tokens, select=self.select, ops=self.ops)
        return logits[-1]

    def _decode(self, token: int) -> np.ndarray:
        return self._forward(np.asarray([token]))[-1]

    def _window(self, tokens: np.ndarray) -> np.ndarray:
        self._read_ahead(tokens)
        logits, self.state = prompt_forward(self.params, self.state, tokens, select=self.select, window=True,
                                            all_logits=True, ops=self.ops)
        return logits

    def _expert_reads(self) -> int:
        return self._reads

    def snapshot(self) -> tuple[tuple[int, ...], ModelState]:
        return self.tokens, self.state

    def restore(self, snapshot: tuple[tuple[int, ...], ModelState]) -> None:
        tokens, self.state = snapshot
        self._tokens = list(tokens)
        self.version += 1


def open_resident(model, config, *, row_faults: dict | None = None) -> ReferenceEngine:
    """The all-resident numpy engine over `model`, with its PLE row source where it has one
    (strata.runtime.ngram_source: the tables whole where they fit, else a row cache the engine
    owns; row_faults: hook and latency faults on its reads)."""
    ple = ple_rows_for(model, config, **(row_faults or {}))
    try:
        return ReferenceEngine.open(model, config, ple=ple)
    except BaseException:
        if ple is not None:
            ple.close()
        raise


def cpu_ops(config) -> CpuOps:
    """The products a numpy engine computes with under `config`: the compiled twins where
    `cpu_kernels` is on (the default) and they build here, on the threads strata.threads chooses
    for them (kernel_threads: the idle cores under auto), else the float32 reference's. Where
    they were asked for and cannot build, one warning says why (once per process and place)."""
    if config is not None and not config.cpu_kernels:
        return REFERENCE_OPS
    ops = compiled_ops(kernel_threads(config.threads if config is not None else 0))
    if ops.note:
        warnings.warn(ops.note, RuntimeWarning, stacklevel=2)
    return ops


def expert_type_note(ops: CpuOps, header) -> str:
    """One line where compiled products are in use but some of the experts' types have none ("" else).
    `header`: the `.experts` file's (one type, or a type per layer and projection)."""
    types = {q for t in header.layer_qtypes for q in t} if header.mixed else {QuantType(header.qtype)}
    slow = sorted((q for q in types if q not in COMPILED_TYPES), key=int)
    if not ops.compiled or not slow:
        return ""
    return (f"{', '.join(q.name for q in slow)} experts on numpy's float32 products (compiled CPU kernels: "
            f"{', '.join(sorted(q.name for q in COMPILED_TYPES))})")


class _NoResidentExperts:
    """Streaming params carry no expert store: experts come from arena slots only."""

    def expert(self, layer: int, expert: int):
        raise RuntimeError("the streaming engine reads experts from the arena, never from params")


def streaming_parts(model, config, plan, *, layers=None, rows=None) -> tuple:
    """(arena, compute, notes) of a numpy streaming engine: a NumpyArena of `plan.slots` slots
    and NumpyCompute over the model's dense weights (`layers`: a pipeline stage's LayerRange;
    `rows`: a PLE model's row source)."""
    from strata.numpy_backend.arena import NumpyArena, mlock_buffer
    from strata.numpy_backend.compute import NumpyCompute

    notes = []
    arena = NumpyArena(plan.slots, model.experts_file.header.padded_bytes, wire=config.wire_arena)
    if config.wire_arena:
        notes.append("arena wired" if arena.wired else "arena NOT wired (mlock refused)")
    if config.mlock_dense:
        ok = all(mlock_buffer(a) for a in as_dense_weights(model.dense).arrays())  # the stored buffers
        notes.append("dense wired" if ok else "dense NOT wired (mlock refused)")
    params = ModelParams(model.cfg, model.dense, _NoResidentExperts())
    xf, cfg = model.experts_file, model.cfg
    layouts = lambda layer: xf.layer_layout(cfg.moe_index(layer))  # noqa: E731 - a layer's own types
    ops = cpu_ops(config)
    note = ops.note or expert_type_note(ops, model.experts_file.header)
    if note:
        notes.append(note)  # in the stream report
    compute = NumpyCompute(params, arena, layouts, pred_q8=config.pred_q8, layers=layers, rows=rows, ops=ops)
    return arena, compute, tuple(notes)
