"""What a lossy row type costs: the KLD of a model's next-token distributions with its PLE
n-gram rows stored Q8_0 or 4-bit (Q4_0) against the same model with F16 rows (the checkpoint's
own precision for Qwen4-Exp's bfloat16 tables is closest to F16 of the row types).

The model enters as a forward function over a row source, `forward(rows, tokens) -> logits
[T, V]` (teacher-forced: every position's logits), so the measurement needs nothing of the
model's code: the real Qwen4-Exp forward with `NgramRows` plumbed in, or a stand-in
(tests/tools/test_tools_ngram_rows_quality.py). The sources are any `NgramRows`: resident tables
quantized in memory (`stored_rows`, small models) or row stores on disk written in each type
(`StreamedNgramRows` / `NgramRowsFile`, the full-size tables).
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Callable, Mapping

import numpy as np

from strata.formats.ngram_row_types import decode_rows, encode_rows
from strata.formats.quant_types import QuantType
from strata.reference.ngram_rows import NgramRows, ResidentNgramRows
from strata.tools.quality import kld_rows

__all__ = ["Forward", "RowTypeKld", "stored_rows", "row_source_kld", "row_type_kld", "model_forward", "model_tables"]

Forward = Callable[[NgramRows, np.ndarray], np.ndarray]  # (rows, tokens [T]) -> logits [T, V]
LOSSY_ROW_TYPES = (QuantType.Q8_0, QuantType.Q4_0)


@dataclass(frozen=True)
class RowTypeKld:
    """KL(P_f16 || P_candidate) over `positions` positions, and how often the argmax agrees."""

    name: str
    positions: int
    kld_mean: float
    kld_p99: float
    kld_max: float
    top1_agreement: float

    def line(self) -> str:
        return (f"{self.name}: KLD mean {self.kld_mean:.3g}, p99 {self.kld_p99:.3g}, max {self.kld_max:.3g} over "
                f"{self.positions} positions; argmax agrees {100 * self.top1_agreement:.1f}%")


def stored_rows(tables: Mapping[int, np.ndarray], qtype: QuantType) -> ResidentNgramRows:
    """Resident rows holding exactly what a row store of `qtype` returns for these tables.
    Shapes: tables layer -> [rows, width]"""
    return ResidentNgramRows({l: decode_rows(qtype, encode_rows(qtype, t), t.shape[1]) for l, t in tables.items()})


def row_source_kld(forward: Forward, reference: NgramRows, candidates: Mapping[str, NgramRows],
                   tokens: np.ndarray, *, warmup: int = 0) -> list[RowTypeKld]:
    """Each candidate source's KLD against `reference`, positions from `warmup` on.
    Shapes: tokens [T]"""
    tokens = np.asarray(tokens)
    ref = np.asarray(forward(reference, tokens), np.float32)[warmup:]
    out = []
    for name, rows in candidates.items():
        logits = np.asarray(forward(rows, tokens), np.float32)[warmup:]
        kl = kld_rows(ref, logits)
        agree = float(np.mean(ref.argmax(-1) == logits.argmax(-1)))
        out.append(RowTypeKld(name, len(kl), float(kl.mean()), float(np.percentile(kl, 99)), float(kl.max()), agree))
    return out


def row_type_kld(forward: Forward, tables: Mapping[int, np.ndarray], tokens: np.ndarray, *,
                 qtypes=LOSSY_ROW_TYPES, warmup: int = 0) -> list[RowTypeKld]:
    """The KLD of each lossy row type against F16 rows of the same tables (held in memory)."""
    reference = stored_rows(tables, QuantType.F16)
    candidates = {QuantType(q).name: stored_rows(tables, q) for q in qtypes}
    return row_source_kld(forward, reference, candidates, tokens, warmup=warmup)


def model_forward(params) -> Forward:
    """The real model's teacher-forced forward over a row source: the reference `forward` of a
    PLE model's params (strata.reference.model.ModelParams, every expert resident) from an empty
    state, `rows` passed through. -> Forward"""
    from strata.reference.model import ModelState, forward

    def run(rows: NgramRows, tokens: np.ndarray) -> np.ndarray:
        return forward(params, ModelState.empty(params.cfg), np.asarray(tokens), rows=rows)[0]

    return run


def model_tables(model) -> dict[int, np.ndarray]:
    """A loaded model's n-gram tables by PLE index, float32 (read whole: for models whose tables
    fit in memory; the full-size ones are measured from row stores on disk, `row_source_kld`)."""
    if model.ngrams_file is not None:
        store = model.ngrams_file
        return {layer: store.rows(layer, np.arange(t.rows)) for layer, t in store.tables.items()}
    from strata.reference.ple import ple_table_items

    return {i: np.asarray(t, np.float32) for i, t in ple_table_items(model.cfg, model.dense)}
