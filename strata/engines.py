"""What the generation loop drives: an engine that turns tokens into next-token logits.

`ReferenceEngine` runs the numpy reference with every expert resident. The streaming runtime
(strata.runtime) and the MLX backend provide engines with the same two methods.
"""

from __future__ import annotations

from typing import Protocol

import numpy as np

from strata.reference.model import ModelParams, ModelState, SelectFn, forward


class Engine(Protocol):
    def prefill(self, tokens: list[int]) -> np.ndarray:
        """Process the prompt; return the last position's logits [vocab]."""

    def decode(self, token: int) -> np.ndarray:
        """Process one generated token; return its logits [vocab]."""

    @property
    def length(self) -> int:
        """Positions processed so far."""


class ReferenceEngine:
    """The pure-numpy forward, all experts resident: the definition of correct output."""

    def __init__(self, params: ModelParams, *, select: SelectFn | None = None) -> None:
        self.params = params
        self.select = select
        self.state = ModelState.empty(params.cfg)

    @property
    def length(self) -> int:
        return self.state.length

    def prefill(self, tokens: list[int]) -> np.ndarray:
        logits, self.state = forward(self.params, self.state, np.asarray(tokens), select=self.select)
        return logits[-1]

    def decode(self, token: int) -> np.ndarray:
        logits, self.state = forward(self.params, self.state, np.asarray([token]), select=self.select)
        return logits[-1]
