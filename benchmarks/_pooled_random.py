"""Random weights and rows for full-size synthetic models, built in seconds instead of minutes.

`make_dense` draws every weight from a fresh normal stream: 3.9 G weights at the qwen4-seed
shape's 48 layers, ~2 minutes of `standard_normal` alone on one core (measured here: 45 s of
57 s for its 2-layer build). A benchmark that times decoding needs the shapes, the scales and
finite values, not fresh draws: `pooled_normals` makes `make_dense` take each tensor as a
window of one pool of normals (at a random offset, scaled), keeping its structure (norms, the
routers' popularity, DeltaNet's decays: what it draws outside `_normal`). `write_pooled_store`
writes a row store whose shards repeat one random shard (the row cache reads pages; their
values do not matter).
"""

from __future__ import annotations

import contextlib
import os
from typing import Iterator, Mapping

import numpy as np

from strata.formats.ngram_rows_file import NgramRowsFile
from strata.formats.ngram_rows_writer import NgramRowsWriter
from strata.formats.quant_types import QuantType

__all__ = ["pooled_normals", "write_pooled_store", "POOL_WEIGHTS"]

POOL_WEIGHTS = 1 << 24  # 64 MB of float32 normals: larger than any one row of a tensor, reused across tensors


def _windows(pool: np.ndarray, rng: np.random.Generator, n: int, std: float) -> np.ndarray:
    """n values: the pool from a random offset, wrapping, times std. -> float32 [n]"""
    out = np.empty(n, np.float32)
    at, i = int(rng.integers(0, pool.size)), 0
    while i < n:
        take = min(n - i, pool.size - at)
        np.multiply(pool[at:at + take], np.float32(std), out=out[i:i + take])
        i, at = i + take, 0
    return out


def _copies(pool: np.ndarray, rng: np.random.Generator, n: int) -> np.ndarray:
    """n values: the pool from a random offset, wrapping, copied. -> [n], the pool's dtype"""
    out = np.empty(n, pool.dtype)
    at, i = int(rng.integers(0, pool.size)), 0
    while i < n:
        take = min(n - i, pool.size - at)
        out[i:i + take] = pool[at:at + take]
        i, at = i + take, 0
    return out


@contextlib.contextmanager
def pooled_normals(seed: int = 0, *, f16_from: int | None = None) -> Iterator[None]:
    """Inside: strata.testing.models' `_normal` returns windows of one pool (module doc).
    f16_from: tensors of at least this many values come as float16 windows of a pool scaled once
    per std (write_model stores float16 as given: no float32 pass, no conversion; the 48-layer
    synthetic's 3.9 G weights were a 37 s step on the H200 host through float32)."""
    from strata.testing import models

    rng = np.random.default_rng([seed, 99])
    pool = rng.standard_normal(POOL_WEIGHTS, dtype=np.float32)
    scaled: dict[float, np.ndarray] = {}  # std -> the pool times std, float16
    original = models._normal

    def normal(_rng: np.random.Generator, shape: tuple[int, ...], std: float) -> np.ndarray:
        n = int(np.prod(shape, dtype=np.int64))
        if f16_from is not None and n >= f16_from:
            if std not in scaled:
                scaled[std] = (pool * np.float32(std)).astype(np.float16)
            return _copies(scaled[std], rng, n).reshape(shape)
        return _windows(pool, rng, n, std).reshape(shape)

    models._normal = normal
    try:
        yield
    finally:
        models._normal = original


def write_pooled_store(path: str | os.PathLike, *, shapes: Mapping[int, tuple[int, int]], qtype: QuantType,
                       seed: int = 0, shard_rows: int = 1 << 20, scale: float = 0.02) -> NgramRowsFile:
    """A row store of `shapes` (layer -> (rows, width)) whose shards repeat one random shard per
    width (normal, `scale`). -> the store, open"""
    rng = np.random.default_rng(seed)
    shards: dict[int, np.ndarray] = {}
    tallest = max(rows for rows, _ in shapes.values())
    with NgramRowsWriter(path, qtype=qtype, shapes=dict(shapes)) as w:
        for layer, (rows, width) in sorted(shapes.items()):
            if width not in shards:
                n = min(shard_rows, tallest)
                shards[width] = rng.standard_normal((n, width), dtype=np.float32) * np.float32(scale)
            for a in range(0, rows, shard_rows):
                w.write(layer, shards[width][: min(shard_rows, rows - a)])
    return NgramRowsFile.open(path)
