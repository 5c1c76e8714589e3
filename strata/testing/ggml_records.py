"""Random valid expert records of llama.cpp's types, made on the device (benchmarks: a seed-shaped
arena of Q4_K experts is tens of GB), and the record layout llama.cpp's quantizer would write for
a type at a shape.

Values do not matter to a benchmark; finite ones do (a NaN routes nowhere in particular): every
byte random, then each block's float16 fields (d, dmin, m) set to a small positive value and
MXFP4's e8m0 byte to 2^-5..2^0, so every weight is finite and small.
"""

from __future__ import annotations

import mlx.core as mx
import numpy as np

from strata.formats import ggml_blocks
from strata.formats.expert_record import PROJECTIONS, RecordLayout
from strata.formats.quant_types import QuantType, ggml_block_name, layout

__all__ = ["LLAMA_FALLBACK", "ggml_layout", "random_ggml_records", "random_ggml_matrix"]

CHUNK_RECORDS, CHUNK_BYTES = 1024, 1 << 30  # records made per step: bounded temporaries (int32 randint: 4x)

# llama.cpp's quantizer (llama-quant.cpp): a tensor whose rows are not whole 256-weight
# super-blocks is written in this type instead (a 576- or 640-wide expert down)
LLAMA_FALLBACK = {QuantType.Q2_K: QuantType.IQ4_NL, QuantType.Q3_K: QuantType.IQ4_NL,
                  QuantType.IQ4_XS: QuantType.IQ4_NL, QuantType.IQ3_S: QuantType.IQ4_NL,
                  QuantType.IQ2_XXS: QuantType.IQ4_NL, QuantType.Q4_K: QuantType.Q5_0,
                  QuantType.Q5_K: QuantType.Q5_1, QuantType.Q6_K: QuantType.Q8_0}


def ggml_layout(qtype: QuantType, hidden: int, expert_ffn: int) -> RecordLayout:
    """The record llama.cpp writes for `qtype` experts of this shape: each projection in `qtype`
    where its rows are whole blocks, else in LLAMA_FALLBACK's type."""
    def fit(cols: int) -> QuantType:
        return qtype if cols % layout(qtype).block_size == 0 else LLAMA_FALLBACK[qtype]

    return RecordLayout(fit(hidden), hidden, expert_ffn, up_qtype=fit(hidden), down_qtype=fit(expert_ffn))


def _plane(qtype: QuantType, nbytes: int, m: int, key: mx.array) -> mx.array:
    """m random planes of `nbytes` bytes of `qtype` blocks, scale fields made small. uint8 [m, nbytes]"""
    k1, k2 = mx.random.split(key)
    raw = mx.random.randint(0, 256, (m, nbytes), key=k1).astype(mx.uint8)
    lay = layout(qtype)
    if not lay.whole_blocks:  # Q8_0's codes plane: any byte is valid
        return raw
    _, dt = ggml_blocks.BLOCK_DTYPES[ggml_block_name(qtype)]
    nb = nbytes // dt.itemsize
    blocks = raw.reshape(m, nb, dt.itemsize)
    small = mx.random.uniform(1e-3, 2e-2, (m, nb), key=k2).astype(mx.float16).view(mx.uint8).reshape(m, nb, 2)
    for name in dt.names:
        base, off = dt.fields[name][0].base, dt.fields[name][1]
        if base == np.float16:
            for i in range(dt.fields[name][0].itemsize // 2):
                blocks[:, :, off + 2 * i:off + 2 * i + 2] = small
        elif qtype is QuantType.GGML_MXFP4 and name == "e":
            blocks[:, :, off:off + 1] = (small[:, :, :1] % 6) + 122  # e8m0 122..127: a weight's scale 2^-6 .. 2^-1
    return blocks.reshape(m, nbytes)


def random_ggml_matrix(qtype: QuantType, rows: int, cols: int, key: mx.array) -> tuple[mx.array, mx.array | None]:
    """A valid dense matrix of `qtype` rows as a GGUF stores them: (blocks uint8 [R, row bytes],
    Q8_0's float16 scales as uint8 [R, cols / 32 * 2], else None)."""
    lay = layout(qtype)
    k1, k2 = mx.random.split(key)
    w = _plane(qtype, cols // lay.block_size * lay.code_bytes, rows, k1)
    scales = None
    if lay.scale_bytes:
        scales = mx.random.uniform(1e-3, 2e-2, (rows, cols // lay.block_size), key=k2).astype(mx.float16).view(mx.uint8)
    mx.eval(w, *(() if scales is None else (scales,)))
    return w, scales


def random_ggml_records(rec: RecordLayout, n: int, key: mx.array, *, distinct: int = 0) -> mx.array:
    """n valid records of a layout of llama.cpp's types (Q8_0 planes: float16 d in [1e-3, 2e-2]);
    distinct: make only this many (a divisor of n) and repeat them (mlx_params.random_records'
    rule: a pool past the L2 is what a benchmark needs). uint8 [n, padded_bytes]"""
    if 0 < distinct < n:
        if n % distinct:
            raise ValueError(f"random records: {distinct} distinct records do not divide {n}")
        pool = random_ggml_records(rec, distinct, key)
        out = mx.contiguous(mx.broadcast_to(pool[None], (n // distinct, distinct, rec.padded_bytes)).reshape(n, -1))
        mx.eval(out)
        return out
    step = max(1, min(CHUNK_RECORDS, CHUNK_BYTES // rec.padded_bytes))
    chunk_keys = mx.random.split(key, (n + step - 1) // step)
    chunks = [_records(rec, min(step, n - c0), chunk_keys[c0 // step]) for c0 in range(0, n, step)]
    out = chunks[0] if len(chunks) == 1 else mx.concatenate(chunks, axis=0)
    mx.eval(out)
    return out


def _records(rec: RecordLayout, n: int, key: mx.array) -> mx.array:
    pieces, end = [], 0
    keys = mx.random.split(key, 2 * len(PROJECTIONS))
    for i, proj in enumerate(PROJECTIONS):
        q = rec.qtype_of(proj)
        for j, span in enumerate((rec.codes(proj), rec.scales(proj))):
            if span.nbytes == 0:
                continue
            if span.offset > end:
                pieces.append(mx.zeros((n, span.offset - end), mx.uint8))
            if j == 0:
                pieces.append(_plane(q, span.nbytes, n, keys[2 * i]))
            else:  # Q8_0's float16 scales, viewed as bytes
                sc = mx.random.uniform(1e-3, 2e-2, (n, span.nbytes // 2), key=keys[2 * i + 1]).astype(mx.float16)
                pieces.append(sc.view(mx.uint8))
            end = span.offset + span.nbytes
    pieces.append(mx.zeros((n, rec.padded_bytes - end), mx.uint8))
    out = mx.concatenate(pieces, axis=1)
    mx.eval(out)
    return out
