"""`MlxHyperEngine`: the Engine protocol over the MLX twin of a hyper-connection model (Qwen4-Exp),
every expert resident (mlx_backend/hyper_model.py: MLX ops, the model's routing on the device).
No compiled decode yet: each call runs the ops forward. PLE rows come from the model's row source
(the resident tables by default)."""

from __future__ import annotations

import numpy as np

from strata.config import Config
from strata.mlx_backend.arena import load_resident_arena, record_layouts
from strata.mlx_backend.hyper_model import HyperMlxParams, empty_hyper_state, hyper_forward, to_hyper_params
from strata.reference.ple import resident_rows
from strata.reference.ngram_rows import NgramRows
from strata.runtime.ngram_source import RowCacheOwner
from strata.session import StateEngine

__all__ = ["MlxHyperEngine"]


class MlxHyperEngine(RowCacheOwner, StateEngine):
    kind = "mlx resident"

    def __init__(self, params: HyperMlxParams, rows: NgramRows, *, model=None, config=None,
                 expert_reads: int = 0) -> None:
        super().__init__(model, config)
        self.params, self.rows = params, rows
        self.state = empty_hyper_state(params.cfg)
        self._reads = expert_reads

    @classmethod
    def open(cls, model, config: Config, *, ple=None) -> "MlxHyperEngine":
        """Every expert of `model` (a strata.loader.Model) read once into an MLX arena. ple: the
        row source (strata.runtime.ngram_source.PleRows; the engine closes its cache)."""
        xf = model.experts_file
        arena = load_resident_arena(xf, verify=config.verify_reads)
        rec, layer_recs = record_layouts(xf)
        params = to_hyper_params(model.cfg, model.dense, arena=arena, rec=rec, layer_recs=layer_recs)
        rows = ple.rows if ple is not None else resident_rows(model.cfg, model.dense)
        engine = cls(params, rows, model=model, config=config, expert_reads=xf.header.n_records)
        engine._own_row_cache(ple)
        return engine

    def _run(self, tokens: np.ndarray, *, window: bool = False) -> np.ndarray:
        self._read_ahead(tokens)
        logits, self.state = hyper_forward(self.params, self.state, tokens, self.rows, window=window)
        return np.array(logits, dtype=np.float32)

    def _prefill(self, tokens: np.ndarray) -> np.ndarray:
        return self._run(tokens)[-1]

    def _decode(self, token: int) -> np.ndarray:
        return self._run(np.asarray([token]))[-1]

    def _window(self, tokens: np.ndarray) -> np.ndarray:
        return self._run(tokens, window=True)

    def _expert_reads(self) -> int:
        return self._reads
