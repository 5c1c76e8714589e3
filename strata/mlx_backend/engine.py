"""Engines on the MLX backend (`Config.backend = mlx`).

- `MlxEngine`: every expert resident in one MLX arena (slot m*E + e), routing on the GPU by the
  model's own rule (with all experts resident MoCE's bonus lifts every logit alike, so the
  selection is the model's): one host round trip per token, six launches per layer. On the GPU
  the decode step is compiled (compiled.py: traced once, replayed from C++) unless
  `compiled=False` or its kernel plan's compiled_decode is off; prefill stays uncompiled.
- streaming: `streaming_parts` gives an `MlxArena` and `MlxCompute`; strata.engines puts them
  in the runtime's StreamingEngine with a reader pool, as it does the numpy ones.
- both serve every residual kind (residual.py: the plain stream, or Qwen4-Exp's
  hyper-connections, MLX ops only); for a PLE model the all-resident engine owns the row source
  and asks it for a call's rows before layer 0, the streaming compute reads the one it is given.

strata.engines.open_engine picks between them by the arena plan (design §7).
"""

from __future__ import annotations

import warnings
from dataclasses import replace

import numpy as np

from strata.config import Config
from strata.mlx_backend import compiled as compiled_step
from strata.mlx_backend import kernel_plan
from strata.mlx_backend.kernel_plan import KernelPlan, using_plan
from strata.mlx_backend.arena import MlxArena, load_resident_arena, record_layouts
from strata.mlx_backend.compute import MlxCompute
from strata.mlx_backend.kernels.launch import current_path
from strata.mlx_backend.model import MlxModelState, MlxParams, dense_nbytes, forward, to_mlx_params
from strata.mlx_backend.residual import RESIDUALS
from strata.mlx_backend.device_pipeline import DevicePipeline
from strata.mlx_backend.prompt import prompt_forward, uses_prompt_path
from strata.reference.attention import KVPrecision
from strata.runtime.memory import wire_mlx
from strata.runtime.ngram_source import RowCacheOwner, ple_rows_for
from strata.session import StateEngine

__all__ = ["MlxEngine", "open_resident", "streaming_parts", "load_resident_arena"]


class MlxEngine(RowCacheOwner, StateEngine):
    """The Engine protocol over MlxParams with resident experts.

    plan: the kernel plan its kernels follow (kernel_plan.py; None: the plan in force where it
    is called, the backend's by default). compiled: decode through a `CompiledDecode` where it can
    run (the GPU kernel path); None: the plan's compiled_decode. If its first (tracing) call raises, the engine warns once,
    keeps the reason in `compile_error` and decodes uncompiled from then on. `trim` trims the
    state (StateEngine): the same KV buffers, so the compiled step stays bound. rows: a PLE
    model's row source (residual.py; None for the plain stream)."""

    kind = "mlx resident"

    def __init__(self, params: MlxParams, *, compiled: bool | None = None, plan: KernelPlan | None = None,
                 model=None, config=None, expert_reads: int = 0, rows=None) -> None:
        super().__init__(model, config)
        if params.arena is None:
            raise ValueError("MlxEngine needs every expert resident (MlxParams.arena)")
        self.params, self.rows = params, rows
        self.state = MlxModelState.empty(params.cfg, config.kv_cache if config is not None else KVPrecision.F32)
        self.plan = plan
        self._compiled = compiled
        self.compile_error: str | None = None
        self.prompt_error: str | None = None  # why the prompt path failed (it is then off)
        self._step: compiled_step.CompiledDecode | None = None
        self._reads = expert_reads

    @classmethod
    def open(cls, model, config: Config, *, ple=None) -> "MlxEngine":
        """Every expert of `model` (a strata.loader.Model) read once into an MLX arena. ple: a PLE
        model's row source (strata.runtime.ngram_source.PleRows; the engine closes its cache)."""
        xf = model.experts_file
        params = to_mlx_params(model.cfg, model.dense, pred_q8=False)
        wire_mlx(xf.header.n_records * xf.header.padded_bytes + dense_nbytes(params))  # Metal: within its ceiling
        rec, layer_recs = record_layouts(xf)
        params = replace(params, arena=load_resident_arena(xf, verify=config.verify_reads), rec=rec,
                         layer_recs=layer_recs)
        rows = RESIDUALS[model.cfg.residual].rows_for(model.cfg, model.dense, ple.rows if ple is not None else None)
        engine = cls(params, model=model, config=config, expert_reads=xf.header.n_records, rows=rows)
        engine._own_row_cache(ple)
        return engine

    def _expert_reads(self) -> int:
        return self._reads

    def _prefill(self, tokens: np.ndarray) -> np.ndarray:
        self._read_ahead(tokens)
        with using_plan(self.plan):
            out = self._prompt(tokens, all_logits=False)
            if out is not None:
                return out[-1]
            logits, self.state = forward(self.params, self.state, tokens, eval_every=kernel_plan.current().eval_every,
                                         rows=self.rows)
            return np.array(logits[-1], dtype=np.float32)

    def _window(self, tokens: np.ndarray) -> np.ndarray:
        self._read_ahead(tokens)
        with using_plan(self.plan):
            out = self._prompt(tokens, all_logits=True)
            if out is not None:
                return out
            logits, self.state = forward(self.params, self.state, tokens, window=True,
                                         eval_every=kernel_plan.current().eval_every, rows=self.rows)
            return np.array(logits, dtype=np.float32)

    def _prompt(self, tokens: np.ndarray, *, all_logits: bool) -> np.ndarray | None:
        """The prompt path's logits (prompt.py: a prompt on the matrix units), or None where it does
        not apply or failed before. A failure (an op this MLX build lacks) warns once and leaves the
        state as it was: `forward` then writes the same cache positions again."""
        if self.prompt_error is not None or not uses_prompt_path(self.params, len(tokens)):
            return None
        try:
            logits, state = prompt_forward(self.params, self.state, tokens, all_logits=all_logits)
            out = np.array(logits, dtype=np.float32)
        except Exception as exc:  # noqa: BLE001 - any failure: the decode kernels' forward from now on
            self.prompt_error = f"{type(exc).__name__}: {exc}"
            warnings.warn(f"MlxEngine: the prompt path failed ({self.prompt_error}); prompts take the decode "
                          "kernels from now on", RuntimeWarning, stacklevel=3)
            return None
        self.state = state
        return out

    def _decode(self, token: int) -> np.ndarray:
        self._read_ahead(np.asarray([token]))
        with using_plan(self.plan):
            return self._decode_planned(token)

    def _decode_planned(self, token: int) -> np.ndarray:
        step = self._compiled_step()
        if step is not None:
            compiled_step.check_decode(self.params, self.state, int(token))  # raises like forward
            first = step.calls == 0
            try:
                logits, state = step(self.state, int(token))
                out = np.array(logits[-1], dtype=np.float32)
            except Exception as exc:  # any failure of the trace: decode uncompiled
                if not first:
                    raise
                self._give_up(f"{type(exc).__name__}: {exc}")
            else:
                self.state = state
                return out
        logits, self.state = forward(self.params, self.state, np.asarray([token]),
                                     eval_every=kernel_plan.current().eval_every, rows=self.rows)
        return np.array(logits[-1], dtype=np.float32)

    def greedy_pipeline(self) -> DevicePipeline | None:
        """Greedy decoding with each next token chosen on the device (device_pipeline.py), unless
        the plan's pipelined is off or the residual runs MLX ops only (residual.py)."""
        if RESIDUALS[self.params.cfg.residual].ops_only is not None:
            return None
        with using_plan(self.plan):
            return DevicePipeline(self) if kernel_plan.current().pipelined else None

    @property
    def compiled(self) -> bool:
        """Whether decode goes through the compiled step: `compiled`, else the plan's compiled_decode."""
        if self._compiled is not None:
            return self._compiled
        with using_plan(self.plan):
            return kernel_plan.current().compiled_decode

    def _commit(self, state: MlxModelState, token: int) -> None:
        """A step the greedy pipeline enqueued becomes the session's next position (as `decode`)."""
        self.state = state
        self._tokens.append(int(token))
        self._decode_tokens += 1
        self.version += 1  # a change to the positions held, as decode's (strata/sharing.py)

    def _compiled_step(self) -> compiled_step.CompiledDecode | None:
        """The compiled step bound to this state's KV buffers (built on first use), or None where
        it is off, failed before, or cannot run here (the ops and emulated paths: quietly)."""
        if not self.compiled or self.compile_error is not None:
            return None
        step = self._step
        if step is not None and step.path is current_path() and step.bound_to(self.state):
            return step  # the per-token case: no per-layer eligibility check (~2 us a layer)
        if compiled_step.unsupported(self.params) is not None:
            return None
        try:
            self._step = compiled_step.CompiledDecode(self.params, self.state)
        except Exception as exc:  # a constructor failure counts as a failed compile
            self._give_up(f"{type(exc).__name__}: {exc}")
            return None
        return self._step

    def _give_up(self, reason: str) -> None:
        self.compile_error = reason
        self._step = None
        warnings.warn(f"MlxEngine: the compiled decode step failed ({reason}); decoding uncompiled from now on",
                      RuntimeWarning, stacklevel=3)



def open_resident(model, config: Config, *, row_faults: dict | None = None):
    """The all-resident MLX engine for `model`; a model with PLE rows opens its row source here
    (strata.runtime.ngram_source; row_faults: hook and latency faults on its reads)."""
    ple = ple_rows_for(model, config, **(row_faults or {}))
    try:
        return MlxEngine.open(model, config, ple=ple)
    except BaseException:
        if ple is not None:
            ple.close()
        raise


def streaming_parts(model, config: Config, plan, *, rows=None) -> tuple:
    """(arena, compute, notes) of an MLX streaming engine: an MlxArena of `plan.slots` slots and
    an MlxCompute over the dense weights (strata.engines adds the pool and the loop). rows: a PLE
    model's row source (default: the tables in the model file)."""
    xf = model.experts_file
    params = to_mlx_params(model.cfg, model.dense, pred_q8=config.pred_q8)
    wire_mlx(plan.slots * xf.header.padded_bytes + dense_nbytes(params))  # Metal: within its ceiling
    arena = MlxArena(plan.slots, xf.header.padded_bytes)
    rows = RESIDUALS[model.cfg.residual].rows_for(model.cfg, model.dense, rows)
    rec, layer_recs = record_layouts(xf)
    compute = MlxCompute(params, arena, rec, pred_q8=config.pred_q8, kv_precision=config.kv_cache, rows=rows,
                         layer_layouts=layer_recs)
    return arena, compute, ("mlx backend",)

