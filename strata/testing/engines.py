"""Engines as the runtime tests want them: the numpy streaming engine whatever the machine has
(on a GPU host `Backend.AUTO` would pick MLX, whose arithmetic is not the reference's), and the
all-resident reference engine on the same products as that streaming engine."""

from __future__ import annotations

from strata.config import Backend, Config
from strata.engines import open_engine

__all__ = ["open_numpy_streaming", "open_numpy_reference"]


def open_numpy_streaming(model, config: Config, **kw):
    """`open_engine` streaming on the numpy backend (kw: plan, hook, keep_trace)."""
    return open_engine(model, config.replace(backend=Backend.NUMPY), stream=True, **kw)


def open_numpy_reference(model, config: Config):
    """The all-resident `ReferenceEngine` computing with the products `open_numpy_streaming(model,
    config)` computes with (the compiled CPU kernels under `config.cpu_kernels`, else the float32
    reference's): what a streaming engine at λ = 0 must equal bit for bit."""
    from strata.numpy_backend.engine import ReferenceEngine

    return ReferenceEngine.open(model, config.replace(backend=Backend.NUMPY))
