"""Where each strata tensor of a family comes from, when that is not one checkpoint tensor under
the Llama names (`convert.common.dense_sources`): a `TensorPlan` a family builds itself.

A dense tensor is either a checkpoint tensor name or a `Derived` tensor: the checkpoint tensors
it is computed from (name and expected shape, checked before anything is written) and a pure
function of their float32 values (a de-interleave of a fused projection, +1 folded into a
zero-centred norm, -exp of a log parameter). `skipped` names the checkpoint tensors left out on
purpose (a vision tower, a multi-token-prediction head), `notes` say so to the user; any other
tensor the plan does not consume is still refused by `check_unused`.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Callable

import numpy as np

from strata.convert.safetensors_reader import Checkpoint
from strata.errors import FormatError

__all__ = ["Derived", "TensorPlan", "source_names"]


@dataclass(frozen=True)
class Derived:
    """A strata tensor computed from checkpoint tensors: make(*float32 inputs) -> array."""

    inputs: tuple[tuple[str, tuple[int, ...]], ...]  # (checkpoint name, expected shape)
    make: Callable[..., np.ndarray] = field(repr=False)
    what: str = ""  # for messages: how it is derived

    def read(self, ckpt: Checkpoint) -> np.ndarray:
        return np.asarray(self.make(*(ckpt.read(name) for name, _ in self.inputs)), np.float32)

    def __str__(self) -> str:
        return f"{self.what} of {', '.join(n for n, _ in self.inputs)}"


@dataclass(frozen=True, eq=False)
class TensorPlan:
    experts: object  # convert.common.ExpertTensors (read(layer, e), consumed)
    sources: dict[str, str | Derived]
    skipped: tuple[str, ...] = ()
    notes: tuple[str, ...] = ()

    def check(self, ckpt: Checkpoint, shapes: dict[str, tuple[int, ...]]) -> None:
        """Every derived tensor's inputs exist with their expected shapes and a readable dtype."""
        for name, src in self.sources.items():
            if not isinstance(src, Derived):
                continue
            for inp, want in src.inputs:
                if inp not in ckpt:
                    raise FormatError(f"{ckpt.directory}: checkpoint has no tensor {inp} (for {name})")
                if tuple(ckpt.shape(inp)) != tuple(want):
                    raise FormatError(f"{ckpt.directory}: tensor {inp}: shape {list(ckpt.shape(inp))}, "
                                      f"expected {list(want)}")
                ckpt.check_dtype(inp)


def source_names(sources: dict[str, str | Derived]) -> set[str]:
    """Every checkpoint tensor the sources read."""
    out: set[str] = set()
    for src in sources.values():
        out.update(n for n, _ in src.inputs) if isinstance(src, Derived) else out.add(src)
    return out
