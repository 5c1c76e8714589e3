"""A checkpoint's PLE n-gram embedding tables into a row store (docs/formats.md §7), streamed.

Qwen4-Exp keeps one table per PLE layer, `[layers.{i}.]ple.ple_embedding.ngram_embedding.weight`
of [padded n-gram vocab, ple_embed_dim / n-gram heads], saved in `split_ngram_parts` shards
`...ngram_embedding.shard_{k}.weight` that transformers concatenates along rows in k order
(its conversion mapping: "~95 GiB, so we cannot afford to perform the Cat on device"). Here no
table and no shard is ever in memory whole: rows are read ROWS_PER_READ at a time from the
safetensors bytes and written on (strata.formats.ngram_rows_writer). The family's converter
(strata/convert/qwen4_exp) finds the tables with `find_ngram_tables` and calls
`write_ngram_tables`; the model file records the store's identity as it does the experts'.
"""

from __future__ import annotations

import os
import re
import sys
from dataclasses import dataclass

import numpy as np

from strata.convert.fp8_checkpoint import Fp8Checkpoint
from strata.convert.gguf_checkpoint import GgufCheckpoint
from strata.convert.safetensors_reader import DTYPES, Checkpoint, bf16_bits_to_f32
from strata.errors import FormatError
from strata.formats.ngram_rows_file import PAGE_BYTES, NgramRowsFile
from strata.formats.ngram_rows_writer import NgramRowsWriter
from strata.formats.quant_types import QuantType

__all__ = ["NgramTable", "find_ngram_tables", "write_ngram_tables", "ROWS_PER_READ"]

TABLE_KEY = re.compile(r"^(?P<prefix>(?:.*\.)?)layers\.(?P<layer>\d+)\.ple\.ple_embedding\.ngram_embedding\."
                       r"(?:shard_(?P<shard>\d+)\.)?weight$")
ROWS_PER_READ = 1 << 16  # 32 MiB of float32 at Qwen4-Exp's 128 values a row: the converter's whole working set


@dataclass(frozen=True)
class NgramTable:
    """One PLE layer's table: its tensors in row order (one, or the shards), rows, width."""

    layer: int  # the decoder layer (0-based, as in the tensor names)
    keys: tuple[str, ...]
    rows: int
    width: int


def find_ngram_tables(ckpt: Checkpoint, *, prefix: str | None = None) -> dict[int, NgramTable]:
    """Every PLE table of the checkpoint, by decoder layer. prefix: only tensors under it (the
    text model's, `model.` or `model.language_model.`); None: any single prefix (two are refused)."""
    found: dict[tuple[str, int], dict[int | None, str]] = {}
    for name in ckpt.tensors:
        m = TABLE_KEY.match(name)
        if m is None or (prefix is not None and m["prefix"] != prefix):
            continue
        shards = found.setdefault((m["prefix"], int(m["layer"])), {})
        shards[None if m["shard"] is None else int(m["shard"])] = name
    prefixes = sorted({p for p, _ in found})
    if len(prefixes) > 1:
        raise FormatError(f"{ckpt.directory}: n-gram tables under several prefixes {prefixes}: name the text model's")
    out = {}
    for (_, layer), shards in sorted(found.items()):
        if None in shards and len(shards) > 1:
            raise FormatError(f"{ckpt.directory}: layer {layer}'s n-gram table is both whole and in shards")
        order = [None] if None in shards else sorted(shards)
        if order != [None] and order != list(range(len(order))):
            missing = sorted(set(range(max(order) + 1)) - set(order))
            raise FormatError(f"{ckpt.directory}: layer {layer}'s n-gram table lacks shard(s) {missing[:4]}")
        keys = tuple(shards[k] for k in order)
        shapes = [ckpt.shape(k) for k in keys]
        widths = {s[1] for s in shapes if len(s) == 2}
        if len(widths) != 1 or any(len(s) != 2 for s in shapes):
            raise FormatError(f"{ckpt.directory}: layer {layer}'s n-gram table shards have shapes {shapes[:3]}...")
        for k in keys:
            ckpt.check_dtype(k)
        out[layer] = NgramTable(layer, keys, sum(s[0] for s in shapes), widths.pop())
    return out


def _rows(ckpt: Checkpoint, name: str, start: int, stop: int) -> np.ndarray:
    """Rows [start, stop) of a 2-D tensor as float32, read from disk alone. Shapes: -> [stop - start, width]"""
    if isinstance(ckpt, Fp8Checkpoint) and name in ckpt.fp8:  # an FP8 table: dequantized by its reader
        return ckpt.read_rows(name, start, stop)
    if isinstance(ckpt, GgufCheckpoint):  # llama.cpp's one table, in its stored type: dequantized rows
        return ckpt.read_rows(name, start, stop)
    info = ckpt.info(name)
    size, dtype = DTYPES[info.dtype]
    width = info.shape[1]
    begin = info.begin + start * width * size
    buf = ckpt._pread(info, begin, (stop - start) * width * size)
    x = np.frombuffer(buf, dtype=dtype).reshape(stop - start, width)
    if info.dtype == "BF16":
        return bf16_bits_to_f32(x)
    return x.astype(np.float32, copy=False)


def write_ngram_tables(ckpt: Checkpoint, path: str | os.PathLike, tables: dict[int, NgramTable], *,
                       qtype: QuantType = QuantType.F16, page_bytes: int = PAGE_BYTES,
                       progress: bool = False) -> NgramRowsFile:
    """Write `tables` into a row store at `path` (atomically) and open it. The store keys each
    table by its PLE index (its place among the tables' decoder layers, ascending): what the
    model's PLE layers ask their rows by (`NgramRows.rows(ple_index, ids)`). F32 keeps a bfloat16 checkpoint's values exactly; F16 rounds
    them to F16 (its 10-bit mantissa holds bf16's 7 bits, its range not bf16's: a table with a
    value beyond 65504 is refused in one line)."""
    ordered = [t for _, t in sorted(tables.items())]  # [PLE index] -> table
    shapes = {i: (t.rows, t.width) for i, t in enumerate(ordered)}
    with NgramRowsWriter(path, qtype=qtype, shapes=shapes, page_bytes=page_bytes) as w:
        for i, t in enumerate(ordered):
            for key in t.keys:
                n = ckpt.shape(key)[0]
                for a in range(0, n, ROWS_PER_READ):
                    w.write(i, _rows(ckpt, key, a, min(n, a + ROWS_PER_READ)))
            if progress:
                print(f"{os.path.basename(os.fspath(path))}: n-gram table of layer {t.layer} (PLE {i}, {t.rows} rows)",
                      file=sys.stderr, flush=True)
    return NgramRowsFile.open(path)
