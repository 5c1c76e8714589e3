"""The row cache's counters: one PLE layer's row traffic, and a cache's totals over its layers.

`StreamedNgramRows.stats()` returns a `RowStats`; the streaming engine's ledger keeps the decode
windows' (`plus` / `minus`), and the stream report takes `report_args()`.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Mapping

__all__ = ["RowCounts", "RowStats"]


@dataclass(frozen=True)
class RowCounts:
    """One PLE layer's row traffic."""

    rows_read: int = 0  # requested rows whose page was read for the request
    rows_hit: int = 0  # requested rows whose page was already cached
    pages_read: int = 0
    bytes_read: int = 0
    wait_s: float = 0.0  # blocked in `rows` for this layer's pages

    def plus(self, o: "RowCounts") -> "RowCounts":
        return RowCounts(self.rows_read + o.rows_read, self.rows_hit + o.rows_hit, self.pages_read + o.pages_read,
                         self.bytes_read + o.bytes_read, self.wait_s + o.wait_s)

    def minus(self, o: "RowCounts") -> "RowCounts":
        return RowCounts(self.rows_read - o.rows_read, self.rows_hit - o.rows_hit, self.pages_read - o.pages_read,
                         self.bytes_read - o.bytes_read, self.wait_s - o.wait_s)


@dataclass(frozen=True)
class RowStats:
    """Totals of a row cache: `positions` decoded or prefilled, `layers` PLE layer -> counts."""

    positions: int = 0
    layers: Mapping[int, RowCounts] = field(default_factory=dict)

    @property
    def total(self) -> RowCounts:
        out = RowCounts()
        for c in self.layers.values():
            out = out.plus(c)
        return out

    def plus(self, other: "RowStats") -> "RowStats":
        layers = dict(self.layers)
        for l, c in other.layers.items():
            layers[l] = layers.get(l, RowCounts()).plus(c)
        return RowStats(self.positions + other.positions, layers)

    def minus(self, since: "RowStats") -> "RowStats":
        return RowStats(self.positions - since.positions,
                        {l: c.minus(since.layers.get(l, RowCounts())) for l, c in self.layers.items()})

    def report_args(self) -> dict:
        """The stream report's PLE arguments (strata.runtime.report.build_report)."""
        t = self.total
        return dict(ple_rows_read=t.rows_read, ple_rows_hit=t.rows_hit, ple_bytes=t.bytes_read, ple_wait_s=t.wait_s)
