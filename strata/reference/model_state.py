"""The state a forward pass carries between calls: every layer's, by its mixer kind.

A layer starts from its mixer's empty state (mixers.py's table), as the model's residual strategy
says (residual.py: under hyper-connections a PLE layer, reference/ple.py, keeps its PLE module's
state beside its DeltaNet's).
"""

from __future__ import annotations

from dataclasses import dataclass

from strata.model_config import LayerRange, ModelConfig
from strata.reference.deltanet import kept_position
from strata.reference.mixers import MixerState
from strata.reference.ple import PleLayerState
from strata.reference.residual import RESIDUALS

# a layer's state: its mixer's (mixers.py), or on a PLE layer the DeltaNet's and its PLE module's
LayerState = MixerState | PleLayerState


def empty_layer_state(cfg: ModelConfig, layer: int) -> LayerState:
    """The state layer `layer` starts from, chosen by its mixer kind and the residual's strategy."""
    return RESIDUALS[cfg.residual].empty_layer_state(cfg, layer)


@dataclass(frozen=True)
class ModelState:
    """Every layer's state (by mixer kind); `length` positions have been processed.

    A pipeline stage holds only its own layers' states: the others are None (another stage
    holds them), and length, trim and kept_position are over the held layers only (an empty
    recurrent layer of another stage would otherwise pin kept_position to 0)."""

    layers: tuple[LayerState | None, ...]

    @staticmethod
    def empty(cfg: ModelConfig, layers: LayerRange | None = None) -> "ModelState":
        """No positions; `layers`: hold only that range's (a pipeline stage's; default all)."""
        held = range(cfg.n_layers) if layers is None else layers.layers
        return ModelState(tuple(empty_layer_state(cfg, l) if l in held else None for l in range(cfg.n_layers)))

    @property
    def held(self) -> tuple[LayerState, ...]:
        """The states this process holds (every layer's, except on a pipeline stage)."""
        return tuple(s for s in self.layers if s is not None)

    @property
    def length(self) -> int:
        held = self.held  # every held layer has processed the same positions
        return held[0].length if held else 0

    def trim(self, n: int) -> "ModelState":
        """The state after the first n positions. Attention layers truncate their KV cache, so
        every n in [0, length] is restorable; a recurrent (DeltaNet) layer restores a kept
        snapshot, and raises where it has none (trim to `kept_position(n)`)."""
        if not 0 <= n <= self.length:
            raise ValueError(f"trim: n must be in [0, {self.length}], got {n}")
        return ModelState(tuple(None if s is None else s.trim(n) for s in self.layers))

    def kept_position(self, n: int) -> int:
        """The largest m <= n every held layer can restore (n itself when none is recurrent)."""
        # a PLE module keeps snapshots where its DeltaNet does
        held = tuple(s.mixer if isinstance(s, PleLayerState) else s for s in self.held)
        return kept_position(held, max(0, min(int(n), self.length)))
