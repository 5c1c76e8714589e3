"""The next layer's weights asked into L2 while this layer's expert launches run.

Why: a decoded layer at the seed shape reads ~26 MB of float16 attention weights (the QKV matrix,
15.7 MB, and W_o, 10.5 MB) in its first launch, whose GEMV phase moves them at ~1.4 TB/s (ncu,
H200: each lane waits on one round of HBM loads), and ~11 MB of expert records in its two expert
launches, which move them at ~0.5 TB/s (they wait on the router's ranking, then on the slots):
for ~20 us a layer HBM is mostly idle. The H200's 50 MB L2 holds a layer's attention weights
beside the expert step's records, and a load that hits L2 waits about half as long as one that
goes to HBM, so the next layer's chain can read its weights from L2 if these launches ask for
them first. Asking costs no registers and no values change.

Where (`NEXT_LAYER`, the A/B switch the benchmarks flip):
- QKV_DOWN: the QKV matrix, by the down step (the first form built);
- QKV_GATEUP: the QKV matrix, by the gate/up step, issued before its ranking (HBM is idle while
  the blocks rank the router's logits: the records' loads wait on it);
- QKV_GATEUP_WO_DOWN: that, and W_o by the down step, issued after its own loads.

How: each block asks for one span of the array (`SPAN_TEMPLATE`: bytes in all, bytes a block); on
CUDA for sm_90 a span is one bulk prefetch instruction a 64 KB chunk (`cp.async.bulk.prefetch.L2`,
the copy engine walks the lines, so issuing 15.7 MB costs ~400 instructions over the grid instead
of ~120k single-line prefetches), a loop of 128-byte line prefetches before sm_90; a no-op on
Metal (compile-checked, not run) and on the emulator.

Predicted at the seed shape: the chain's GEMV phase reads 15.7 MB from L2 instead of HBM, ~11 ->
~5-6 us a layer, and W_o's groups likewise (~2-3 us): 0.3-0.4 ms a token of GPU time, if the
prefetches' 26 MB fit in the expert launches' idle HBM time (~8 us at copy speed) without
slowing them. ncu flushes the caches between kernels, so only in-graph timings tell
(benchmarks/host_cost.py, benchmarks/decode_context.py forms l2_*).
"""

from __future__ import annotations

from enum import Enum

import mlx.core as mx
import numpy as np

from strata.mlx_backend.kernels.launch import absent


class NextLayer(Enum):
    """Which of the next layer's weights the expert launches ask into L2, and which launch asks."""

    OFF = "off"
    QKV_DOWN = "qkv_down"
    QKV_GATEUP = "qkv_gateup"
    QKV_GATEUP_WO_DOWN = "qkv_gateup_wo_down"


NEXT_LAYER = NextLayer.OFF  # off until measured in the graph on the GPU (docs/perf.md)
MAX_BYTES = 32 << 20  # at most this much a launch asks for (the H200's L2 is 50 MB)
CHUNK = 1 << 16  # bytes a bulk prefetch instruction asks for

# A block's span of `pf` (PFB bytes in all, PFS a block, block bx the bx-th span) into L2, asked by
# one thread; in a chain bx is the phase's own block index. Spans are whole 128-byte lines.
SPAN = r"""
  if (PFB > 0 && by == 0u && tid == 0u) {     // this block's span of the next launches' weights into L2
    const uint64_t lo = (uint64_t)bx * (uint64_t)PFS;
    const uint64_t hi = lo + (uint64_t)PFS < (uint64_t)PFB ? lo + (uint64_t)PFS : (uint64_t)PFB;
    for (uint64_t o = lo; o + 16u <= hi; o += (uint64_t)PF_CHUNK) {
      const uint64_t n = hi - o < (uint64_t)PF_CHUNK ? hi - o : (uint64_t)PF_CHUNK;
      prefetch_l2_span((const DEVICE uint8_t*)pf + o, (uint32_t)(n & ~(uint64_t)15u));
    }
  }
"""


def span_template(prefetch: mx.array | None, blocks: int) -> tuple[tuple[str, int], ...]:
    """The SPAN snippet's template values for `prefetch` (None: nothing asked) over `blocks` blocks:
    PFB its bytes (at most MAX_BYTES), PFS a block's span (whole 128-byte lines), PF_CHUNK."""
    if prefetch is None:
        return (("PFB", 0), ("PFS", 0), ("PF_CHUNK", CHUNK))
    pfb = min(int(prefetch.nbytes), MAX_BYTES)
    per_block = -(-pfb // max(blocks, 1))
    return (("PFB", pfb), ("PFS", -(-per_block // 128) * 128), ("PF_CHUNK", CHUNK))


def span_input(prefetch: mx.array | None) -> mx.array:
    """The `pf` input: the array whose bytes are asked for, or a placeholder."""
    return absent(np.uint8) if prefetch is None else prefetch
