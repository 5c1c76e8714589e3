"""Where a PLE layer's n-gram embedding rows come from.

A PLE (per-layer n-gram embedding) layer looks up, for every token, one row per
hashed n-gram head in that layer's table. The tables are the largest tensors of
such a checkpoint (tens of GB), so the model never assumes they are in memory:
it asks a row source for the rows it needs. The reference holds them resident;
the streaming runtime reads them from a row store on disk into a small cache,
issuing the reads as soon as a token is known (the ids depend only on tokens).

Both sources return the same float32 values for the same ids: the streamed
rows are bit-identical to resident ones.
"""

from __future__ import annotations

from typing import Protocol

import numpy as np


class NgramRows(Protocol):
    """A source of PLE embedding rows, keyed by (PLE layer, row id)."""

    def rows(self, layer: int, row_ids: np.ndarray) -> np.ndarray:
        """The rows `row_ids` (int64, any shape S) of `layer`'s table: float32 (*S, width)."""
        ...


class ResidentNgramRows:
    """Every table in memory: `tables[layer]` is (rows, width), any float dtype."""

    def __init__(self, tables: dict[int, np.ndarray]):
        self.tables = tables

    def rows(self, layer: int, row_ids: np.ndarray) -> np.ndarray:
        return np.asarray(self.tables[layer][row_ids], dtype=np.float32)
