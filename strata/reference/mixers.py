"""The reference's token mixers, one table keyed by the mixer kind (`Mixer`).

Each entry says what a layer of that kind keeps (its empty state) and how it mixes: the normed
input h [T, D] of layer `layer` and its state in, the mixer's output [T, D] and the new state out.
The forward pass (model.py, whatever its residual strategy) looks a layer's mixer up
here instead of branching on its kind, so a new mixer is its reference file, its twins in the
backends (numpy_backend reuses this table; mlx_backend/mixers.py) and one entry in each table.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Callable

import numpy as np

from strata.model_config import Mixer, ModelConfig
from strata.reference.attention import LayerKV, attention
from strata.reference.deltanet import DeltaNetState, deltanet
from strata.reference.indexed_attention import IndexedKV, indexed_attention
from strata.reference.mla import LatentKV, mla

# per-layer state, by mixer kind: attention's is its KV cache, DeltaNet's its conv and recurrent
# state, MLA's its compressed latent + rope key cache, indexed attention's its KV and indexer keys
MixerState = LayerKV | DeltaNetState | LatentKV | IndexedKV


@dataclass(frozen=True)
class ReferenceMixer:
    """empty_state(cfg) -> the state a layer starts from;
    compute(cfg, dense, layer, state, h, *, window) -> (out [T, D], new state). window: the
    positions are a decode window (a recurrent mixer keeps a snapshot after each)."""

    empty_state: Callable[[ModelConfig], MixerState]
    compute: Callable[..., tuple[np.ndarray, MixerState]]


def _attention(cfg: ModelConfig, dense, layer: int, kv: LayerKV, h: np.ndarray, *, window: bool = False):
    return attention(cfg, dense, layer, kv, h)  # every position kept: a sliding window is a mask


def _mla(cfg: ModelConfig, dense, layer: int, kv: LatentKV, h: np.ndarray, *, window: bool = False):
    return mla(cfg, dense, layer, kv, h)


def _indexed(cfg: ModelConfig, dense, layer: int, kv: IndexedKV, h: np.ndarray, *, window: bool = False):
    return indexed_attention(cfg, dense, layer, kv, h)


MIXERS: dict[Mixer, ReferenceMixer] = {
    Mixer.ATTENTION: ReferenceMixer(LayerKV.empty, _attention),
    Mixer.SLIDING_ATTENTION: ReferenceMixer(LayerKV.empty, _attention),
    Mixer.DELTANET: ReferenceMixer(DeltaNetState.empty, deltanet),
    Mixer.MLA: ReferenceMixer(LatentKV.empty, _mla),
    Mixer.INDEXED_ATTENTION: ReferenceMixer(IndexedKV.empty, _indexed),
}


def mixer_for(kind: Mixer) -> ReferenceMixer:
    """The table's entry, or a NotImplementedError naming the kind."""
    try:
        return MIXERS[kind]
    except KeyError:
        raise NotImplementedError(f"no reference mixer {kind.value}") from None
