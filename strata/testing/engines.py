"""Engines as the runtime tests want them: the numpy streaming engine whatever the machine has
(on a GPU host `Backend.AUTO` would pick MLX, whose arithmetic is not the reference's)."""

from __future__ import annotations

from strata.config import Backend, Config
from strata.engines import open_engine

__all__ = ["open_numpy_streaming"]


def open_numpy_streaming(model, config: Config, **kw):
    """`open_engine` streaming on the numpy backend (kw: plan, hook, keep_trace)."""
    return open_engine(model, config.replace(backend=Backend.NUMPY), stream=True, **kw)
