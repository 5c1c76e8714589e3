"""Test aids for PLE rows without the model: a stand-in n-gram hash, a stand-in forward that
uses PLE rows the way Qwen4-Exp does (rows of every head concatenated, projected into the
residual), and synthetic row stores of any size (written in shards, never whole)."""

from __future__ import annotations

import os
from typing import Mapping

import numpy as np

from strata.formats.ngram_rows_file import PAGE_BYTES, NgramRowsFile
from strata.formats.ngram_rows_writer import NgramRowsWriter, write_ngram_rows
from strata.formats.quant_types import QuantType
from strata.reference.ngram_rows import NgramRows

__all__ = ["StandInHash", "StandInForward", "write_synthetic_store"]

_MIX = (1_000_003, 7_919, 104_729)  # odd multipliers for the stand-in hash (any would do)


class StandInHash:
    """A stand-in for the model's n-gram hash (the model's: strata.reference.ngram_hash):
    `heads` ids per token per PLE layer, from the token and the one before it (0 before the
    first). A `RowIds`: (context [C], tokens [T]) -> layer -> int64 [T, heads]."""

    def __init__(self, rows: Mapping[int, int], heads: int) -> None:
        self.rows, self.heads = dict(rows), heads

    def __call__(self, context: np.ndarray, tokens: np.ndarray) -> dict[int, np.ndarray]:
        tokens = np.asarray(tokens, np.int64)
        prev = np.concatenate([np.asarray(context, np.int64)[-1:] if len(context) else [0], tokens[:-1]])
        out = {}
        for layer, n in self.rows.items():
            mixed = tokens[:, None] * _MIX[0] + prev[:, None] * _MIX[1] + (np.arange(self.heads) + layer) * _MIX[2]
            out[layer] = mixed % n  # [T, heads]
        return out


class StandInForward:
    """A tiny teacher-forced model over PLE rows: x = embed(token) + Σ_l W_l · concat(heads'
    rows), logits = x · embedᵀ. A `Forward`: (rows, tokens [T]) -> logits float32 [T, vocab]."""

    def __init__(self, *, widths: Mapping[int, int], rows: Mapping[int, int], heads: int, vocab: int = 256,
                 hidden: int = 64, seed: int = 0) -> None:
        rng = np.random.default_rng(seed)
        self.hash = StandInHash(rows, heads)
        self.embed = rng.standard_normal((vocab, hidden)).astype(np.float32)
        self.proj = {l: (rng.standard_normal((heads * w, hidden)) / np.sqrt(heads * w)).astype(np.float32)
                     for l, w in widths.items()}

    def __call__(self, rows: NgramRows, tokens: np.ndarray) -> np.ndarray:
        tokens = np.asarray(tokens, np.int64)
        x = self.embed[tokens]  # [T, hidden]
        for layer, ids in self.hash(np.zeros(0, np.int64), tokens).items():
            r = rows.rows(layer, ids)  # [T, heads, width]
            x = x + r.reshape(len(tokens), -1) @ self.proj[layer]
        return (x @ self.embed.T).astype(np.float32)


def write_synthetic_store(path: str | os.PathLike, *, shapes: Mapping[int, tuple[int, int]],
                          qtype: QuantType = QuantType.F16, seed: int = 0, shard_rows: int = 1 << 16,
                          page_bytes: int = PAGE_BYTES, scale: float = 0.02) -> NgramRowsFile:
    """A row store of random rows (normal, `scale`: an embedding's magnitude), written shard by
    shard: a full-size store needs one shard of memory, not a table's."""
    rng = np.random.default_rng(seed)
    with NgramRowsWriter(path, qtype=qtype, shapes=dict(shapes), page_bytes=page_bytes) as w:
        for layer, (rows, width) in sorted(shapes.items()):
            for a in range(0, rows, shard_rows):
                x = rng.standard_normal((min(shard_rows, rows - a), width), dtype=np.float32)
                w.write(layer, x * np.float32(scale))
    return NgramRowsFile.open(path)


def move_tables_to_store(cfg, dense: dict, path, qtype: QuantType) -> tuple:
    """A made PLE model's n-gram tables written into a row store at `path` (keyed by PLE index)
    and taken out of its dense weights: -> (cfg with ple_row_store, dense without the tables,
    the store's identity for the model file)."""
    from strata.model_config import TensorNames
    from strata.families.qwen4_exp import Qwen4Names, ple_layers

    names = [TensorNames.block(layer, Qwen4Names.ple_ngram) for layer in ple_layers(cfg)]
    tables = {i: np.asarray(dense[n], np.float32) for i, n in enumerate(names)}
    shapes = {i: t.shape for i, t in tables.items()}
    with write_ngram_rows(path, qtype=qtype, shapes=shapes, pieces=tables.items()) as store:
        identity = store.identity
    kept = {k: v for k, v in dense.items() if k not in set(names)}
    return cfg.with_fields(ple_row_store=True), kept, identity
