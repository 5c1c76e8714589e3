"""Which PLE row source an engine gets: the tables resident, or the row cache over the store.

A PLE model (Qwen4-Exp) looks up, per token and PLE layer, one row per n-gram head. Where the
tables live decides the source:

- in the model file (the made test models; `cfg.qwen4.ple_row_store` False): the dense tables,
  resident already (`resident_rows`);
- in the row store (`<name>.ngrams`, what `strata convert` writes): an all-resident engine may
  read the tables whole only when they fit what the budget rule leaves after the experts
  (`resident_room`); otherwise, and always for a streaming engine, one `StreamedNgramRows`:
  `ple_reserve`'s pages (`open_row_cache`), the model's hash as its `row_ids`, so the
  streaming engine reads every PLE layer's rows ahead before layer 0. The same object is the
  compute's row source (`rows=`) and the engine's `ngram_rows=`: the reads it issues are the
  pages the PLE layers then find.

Never the whole store in memory when it does not fit: the cache is the reserve's pages.
"""

from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path

import numpy as np

from strata.families.qwen4_exp import ngram_heads, ple_layers
from strata.reference.ngram_hash import NgramHash, initial_ngram_context, ngram_context_after, ngram_row_ids
from strata.reference.ngram_rows import NgramRows, ResidentNgramRows
from strata.runtime.ngram_budget import RowCachePlan, open_row_cache, plan_row_cache
from strata.runtime.ngram_rows import StreamedNgramRows
from strata.sizes import fmt_bytes

__all__ = ["PleRows", "RowCacheOwner", "ModelRowIds", "rows_per_position", "row_cache_bytes", "resident_table_bytes",
           "resident_room", "ple_rows_for"]


class ModelRowIds:
    """The model's n-gram hash as the row cache's `row_ids` (a `RowIds`): (the last ngram_size - 1
    tokens before a window, the window's tokens [T]) -> PLE index -> int64 [T, heads]. The same
    ids the PLE layers compute from their own state (reference/ple.py), so the read-ahead is exact."""

    def __init__(self, cfg) -> None:
        self.hashes = [NgramHash.of(cfg, i) for i in range(len(ple_layers(cfg)))]
        self.context_tokens = cfg.qwen4.ngram_size - 1

    def __call__(self, context: np.ndarray, tokens: np.ndarray) -> dict[int, np.ndarray]:
        out = {}
        for i, h in enumerate(self.hashes):
            before = ngram_context_after(h, initial_ngram_context(h), np.asarray(context, np.int64))
            out[i] = ngram_row_ids(h, before, tokens)
        return out


@dataclass(frozen=True, eq=False)
class PleRows:
    """The row source an engine got. rows: what the PLE layers read; streamed: the row cache (the
    streaming engine's `ngram_rows`, read ahead every window), None when resident; plan: its
    pages (`plan.nbytes` is the arena rule's ple_reserve); reason: one line, for the notes."""

    rows: NgramRows
    streamed: StreamedNgramRows | None
    plan: RowCachePlan | None
    reason: str

    def close(self) -> None:
        """Close the row cache (a resident source holds nothing to close)."""
        if self.streamed is not None:
            self.streamed.close()


class RowCacheOwner:
    """Mixin for an all-resident session engine given a PleRows: it owns the row cache (`streamed`,
    None when the rows are resident), asks it for a call's rows before layer 0 (`_read_ahead`,
    with the session's tokens so far as the n-gram context) and closes it with the engine."""

    _row_cache: StreamedNgramRows | None = None

    def _own_row_cache(self, ple: PleRows | None) -> None:
        self._row_cache = None if ple is None else ple.streamed

    def _read_ahead(self, tokens) -> None:
        """Every PLE layer's rows of these tokens asked for before layer 0 (a streamed cache only)."""
        if self._row_cache is not None:
            self._row_cache.read_ahead(self._tokens, tokens)

    def close(self) -> None:
        cache, self._row_cache = self._row_cache, None
        if cache is not None:
            cache.close()
        super().close()


def rows_per_position(cfg) -> int:
    """Rows one token reads over every PLE layer: n-gram heads x PLE layers."""
    return ngram_heads(cfg) * len(ple_layers(cfg))


def row_cache_bytes(model, config) -> int | None:
    """A PLE model's row cache (ple_reserve's pages) for the budget rule; None without a row store."""
    if model.ngrams_file is None:
        return None
    return plan_row_cache(config, model.ngrams_file, rows_per_position=rows_per_position(model.cfg)).nbytes


def resident_table_bytes(store) -> int:
    """The store's tables decoded to float32, as a resident source holds them."""
    return sum(t.rows * t.width * 4 for t in store.tables.values())


def resident_room(model, config) -> int:
    """What the budget rule leaves for resident tables once every expert is resident: the
    budget with no row cache reserved, less the expert records."""
    from strata.runtime.budget import budget_bytes

    files = tuple(dict.fromkeys(Path(p) for p in (model.model_path, model.experts_file.path,
                                                  model.ngrams_file.path)))  # one file, read in place: once
    budget, _ = budget_bytes(config, model_files=files, ple_bytes=0)
    h = model.experts_file.header
    return budget - h.n_records * h.padded_bytes


def _read_whole(store) -> ResidentNgramRows:
    return ResidentNgramRows({layer: store.rows(layer, np.arange(t.rows)) for layer, t in store.tables.items()})


def ple_rows_for(model, config, *, stream: bool | None = None, hook=None, latency=None,
                 reader: str = "auto") -> PleRows | None:
    """The row source for `model` under `config` (module doc); None for a model without PLE.
    stream: True always streams from the store; False or None reads the tables whole when they
    fit `resident_room` (None: the caller is an all-resident engine; a streaming engine passes
    True). hook, latency: faults on the row reads (tests: an IOHook; the advised reader's latency)."""
    cfg = model.cfg
    if not ple_layers(cfg):
        return None
    store = model.ngrams_file
    if store is None:
        from strata.reference.ple import resident_rows

        return PleRows(resident_rows(cfg, model.dense), None, None, "PLE rows resident (in the model file)")
    if not stream:
        need, room = resident_table_bytes(store), resident_room(model, config)
        if need <= room:
            return PleRows(_read_whole(store), None, None,
                           f"PLE rows resident ({fmt_bytes(need)} of tables within {fmt_bytes(room)})")
    rows, plan = open_row_cache(store, config, rows_per_position=rows_per_position(cfg), row_ids=ModelRowIds(cfg),
                                context_tokens=cfg.qwen4.ngram_size - 1, hook=hook, reader=reader,
                                latency=latency)
    return PleRows(rows, rows, plan, f"PLE rows streamed: {plan.reason}")
