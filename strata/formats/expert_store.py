"""What the engines ask of an expert set, wherever its records are: the `ExpertStore` protocol.

Two implementations: `ExpertsFile` (strata.formats.experts_file: one aligned record per
(layer, expert), one read fills a slot, a CRC-32 per record in its header) and `PieceStore`
(strata.formats.expert_pieces: a llama.cpp GGUF's stacked experts read in place, each record put
together from several aligned reads, its CRC-32 kept from its first read). The resident engines
call `expert` / `read_record`; the streaming engines size their slots by `header.padded_bytes`
and compute each layer with `layer_layout`; the reader pool for each is chosen by
strata.runtime.piece_reader.reader_pool_for.
"""

from __future__ import annotations

from typing import Protocol

import numpy as np

from strata.formats.expert_record import ExpertWeights, RecordLayout
from strata.formats.experts_file import ExpertsHeader

__all__ = ["ExpertStore"]


class ExpertStore(Protocol):
    path: str  # named in messages (a PieceStore's first file)
    header: ExpertsHeader  # geometry: layers, experts, types, record and slot sizes
    identity: str  # names this expert set (what a model, trace or pipeline ties itself to)

    @property
    def files(self) -> tuple[str, ...]:
        """The files its records are read from (a split GGUF's parts; an `.experts` file itself)."""

    @property
    def reads_per_record(self) -> float:
        """Reads that fill one slot (1 for an `.experts` file)."""

    @property
    def multi_read_share(self) -> float:
        """The share of records that need more than one read."""

    @property
    def read_bytes_per_record(self) -> float:
        """Bytes those reads ask for (the mean over records)."""

    def layer_layout(self, layer: int) -> RecordLayout: ...

    def record_offset(self, layer: int, expert: int) -> int: ...

    def read_record(self, layer: int, expert: int, *, verify: bool = True,
                    out: np.ndarray | None = None) -> np.ndarray: ...

    def expert(self, layer: int, expert: int, *, verify: bool = True) -> ExpertWeights: ...

    def close(self) -> None: ...
