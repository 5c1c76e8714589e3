"""A pipeline stage's view of the `.experts` file: its MoE layers only, as local indices.

The stage's cache machine counts its own MoE layers (local index i is the file's MoE layer
moe_start + i), and the reader pool computes a record's offset from the header's geometry, so the
view shifts the data offset by the records before the stage and shows only its layers. The
records are the file's own: every rank keeps a whole copy of the model files and reads its part.
"""

from __future__ import annotations

import dataclasses

from strata.formats.experts_file import ExpertsFile

__all__ = ["StageExperts"]


class StageExperts:
    """MoE layers [moe_start, moe_start + n_layers) of `experts`, as layers 0..n_layers-1."""

    def __init__(self, experts: ExpertsFile, moe_start: int, n_layers: int) -> None:
        h = experts.header
        if not (0 <= moe_start and moe_start + n_layers <= h.n_layers and n_layers > 0):
            raise ValueError(f"{experts.path}: no MoE layers [{moe_start}, {moe_start + n_layers}) "
                             f"in a file of {h.n_layers}")
        self.file, self.moe_start = experts, moe_start
        self.header = dataclasses.replace(
            h, n_layers=n_layers, data_offset=h.data_offset + moe_start * h.n_experts * h.padded_bytes)
        self.path, self.layout = experts.path, experts.layout

    def _check(self, layer: int) -> None:
        if not 0 <= layer < self.header.n_layers:
            raise ValueError(f"{self.path}: this stage holds MoE layers 0..{self.header.n_layers - 1} "
                             f"(file layers {self.moe_start}..), not {layer}")

    def record_offset(self, layer: int, expert: int) -> int:
        self._check(layer)
        return self.file.record_offset(self.moe_start + layer, expert)

    def checksum(self, layer: int, expert: int) -> int:
        self._check(layer)
        return self.file.checksum(self.moe_start + layer, expert)

    def fileno(self) -> int:
        return self.file.fileno()
