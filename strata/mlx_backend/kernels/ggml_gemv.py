"""GEMV over a dense matrix of llama.cpp's blocks kept as stored (Q6_K, Q5_K, Q4_K, the rest of
kernels/ggml_dot.py's types: the head and attention of unsloth's files): y[t, r] = Σ_c W[r, c] x[t, c].

A block stages token t's x in threadgroup memory; a warp per row, lane l taking the row's 32-weight
groups l, l + 32, ... through `gg_dot32` (the decoder the fused expert kernel reads), then a warp
sum. Q8_0 rows are its two planes (codes, float16 scales); the whole-block types pass no scales.

Not measured on a GPU yet (benchmarks/kernels.py --dense-type reports its share of copy bandwidth).

Shapes:
    w uint8 [R, C / QK * bb], scales uint8 [R, C / 32 * 2] (Q8_0) , x float32 [T, C] -> y float32 [T, R]
Grid: x = ceil(R / NW) blocks of NT threads, y = T.
"""

from __future__ import annotations

import mlx.core as mx
import numpy as np

from strata.formats.quant_types import QuantType, layout
from strata.mlx_backend.kernels import ggml_dot
from strata.mlx_backend.kernels.launch import absent, as_f32, launch
from strata.mlx_backend.kernels.preludes import WARP
from strata.mlx_backend.kernels.source import KernelSource

THREADS = 256
MAX_COLS = 8192  # x in threadgroup memory (32 KB)

BODY = r"""
  constexpr int NW = NT / 32;
  constexpr int GPR = C / 32;  // 32-weight groups per row
  const uint32_t t = by;
  SHARED float xs[C];
  for (uint32_t c = tid; c < (uint32_t)C; c += NT) xs[c] = x[(uint64_t)t * C + c];
  BARRIER();
  const uint32_t r = bx * NW + warp_id;
  if (r < (uint32_t)R) {  // warp-uniform; no barrier below
    const DEVICE uint8_t* row = w + (uint64_t)r * WRB;
    const DEVICE uint8_t* srow = scales + (uint64_t)r * WSR;
    float acc = 0.0f;
    for (int g = (int)lane; g < GPR; g += 32) acc += gg_dot32(WTY, WBB, row, srow, g, xs + 32 * g, tables);
    acc = warp_sum(acc);
    if (lane == 0) y[(uint64_t)t * R + r] = acc;
  }
"""

SOURCE = KernelSource("strata_ggml_gemv", ("w", "scales", "x", "tables"), ("y",), BODY, ggml_dot.HELPERS)


def supports(qtype: QuantType, cols: int) -> str | None:
    """Why the kernel cannot multiply rows of this type and width (None: it can)."""
    if qtype not in ggml_dot.TYPES:
        return f"no ggml GEMV kernel for {qtype.name}"
    if cols % layout(qtype).block_size or cols > MAX_COLS:
        return f"{cols} columns: a multiple of {layout(qtype).block_size}, at most {MAX_COLS}"
    return None


def ggml_gemv(qtype: QuantType, w: mx.array, x: mx.array, scales: mx.array | None = None) -> mx.array:
    """Kernel path. w uint8 [R, row bytes] of `qtype`'s blocks (Q8_0: its codes plane, with
    `scales` its float16 d plane as uint8 or float16), x float32 [T, C] -> y float32 [T, R]."""
    r, t, c = w.shape[0], x.shape[0], x.shape[1]
    if (why := supports(qtype, c)) is not None:
        raise ValueError(f"ggml GEMV: {why}")
    ints = ggml_dot.projection_ints("W", qtype, c, 0, 0)
    if (qtype is QuantType.Q8_0) != (scales is not None):
        raise ValueError(f"ggml GEMV: {qtype.name} takes {'a' if qtype is QuantType.Q8_0 else 'no'} scales plane")
    if dict(ints)["WRB"] != w.shape[1]:
        raise ValueError(f"ggml GEMV: {qtype.name} rows of {c} weights are {dict(ints)['WRB']} bytes, got {w.shape[1]}")
    sc = absent(np.uint8) if scales is None else scales.reshape(r, -1).view(mx.uint8)
    nw = THREADS // WARP
    return launch(SOURCE, [w, sc, as_f32(x), ggml_dot.tables()], [(t, r)], [mx.float32], blocks=((r + nw - 1) // nw, t, 1),
                  threads=THREADS, template=(("R", r), ("C", c), ("NT", THREADS), *ints))[0]
