"""Greedy selection on the device: the token a decoded position's logits choose, its log-probability
and whether the logits are finite, packed into the one small int32 array that is both the next
step's token input and what the host reads back.

Why: the host loop reads every token's logits ([V] float32) before it can encode the next step,
so the GPU idles for the round trip and the host's encoding of the step (H200, seed shape,
context 8: 5.45 ms a token against 3.83 ms with the steps enqueued back to back). Chosen on the
device, token n feeds step n + 1 before the host has seen it (strata/mlx_backend/device_pipeline.py).

Exactly the host's choice (strata.reference.sampling.sample at temperature 0 without a penalty:
numpy's argmax, the FIRST index of the maximum): MLX's argmax keeps the first index on ties too
(its CPU reduction replaces only on a strictly larger value; its CUDA reduction takes the
smaller index of equal values), over the very float32 logits the host would have read.
The log-probability is that of `log_softmax` (max-subtracted), in float32 where the host's is
float64: for the argmax it is -log(sum(exp(z - max))), no gather needed (summed in rows, SUM_ROW). Finite is what
`check_finite_logits` tests, whether the max is finite (NaN propagates through the max).

Layout of the packed selection (int32 [MIN_INPUT_SIZE]: a kernel input's smallest size, the shape
of `launch.index_param`'s views, so the compiled step sees one input shape and never retraces):
    [0] the token id (what the embed kernel reads: element 0)
    [1] the log-probability, float32 bits
    [2] 1 where the logits are finite, else 0
    [3:] zeros
"""

from __future__ import annotations

from dataclasses import dataclass

import mlx.core as mx
import numpy as np

from strata.mlx_backend.kernels.source import MIN_INPUT_SIZE

__all__ = ["Selection", "greedy_select", "read_selection"]

TOKEN, LOGPROB, FINITE = 0, 1, 2  # the packed selection's elements (module docstring)


@dataclass(frozen=True)
class Selection:
    """A greedy step's choice as the host reads it."""

    token: int
    logprob: float
    finite: bool


# the exponentials are summed in rows of this many, then the rows' sums: MLX's CPU build sums a
# row in order, and one row of a 152k vocabulary in float32 was 2.4e-4 off the float64 sum, in
# rows of 256 9e-7 (a GPU reduction is a tree either way)
SUM_ROW = 256


def _select(logits: mx.array) -> mx.array:
    z = logits.reshape(-1)  # [V]: one position
    top = mx.max(z)
    token = mx.argmax(z).astype(mx.int32)
    e = mx.exp(z - top)
    if e.size % SUM_ROW:
        e = mx.pad(e, (0, SUM_ROW - e.size % SUM_ROW))  # zeros: they add nothing
    logprob = -mx.log(mx.sum(mx.sum(e.reshape(-1, SUM_ROW), axis=1)))  # z[token] - logsumexp(z), z[token] == top
    bits = mx.view(logprob.reshape(1), mx.int32)  # [1]: the same 4 bytes, no copy
    finite = mx.isfinite(top).astype(mx.int32)
    # the layout by element index, one elementwise expression (one fused kernel), not a concatenation
    i = mx.arange(MIN_INPUT_SIZE, dtype=mx.int32)
    zero = mx.array(0, mx.int32)
    return mx.where(i == TOKEN, token, mx.where(i == LOGPROB, bits, mx.where(i == FINITE, finite, zero)))


# a handful of reductions and elementwise ops, fused where MLX can; compiled on a GPU only: MLX's
# CPU build compiles a fused graph with the C++ compiler (~4 s the first time in a process here).
# On the H200 the first call compiles the fused kernels with NVRTC: ~9 s once in a process (the
# mid-session run), start-up like the decode step's own first trace
_compiled_select = mx.compile(_select)

def greedy_select(logits: mx.array) -> mx.array:
    """The packed greedy selection of one position's logits (lazy: nothing is evaluated here).

    Shapes:
        logits float32 [1, V] or [V] -> int32 [MIN_INPUT_SIZE] (the layout above)
    """
    if logits.dtype != mx.float32 or logits.size != logits.shape[-1]:
        raise ValueError(f"greedy_select: one position's float32 logits, got {logits.dtype} {tuple(logits.shape)}")
    return (_compiled_select if mx.default_device().type == mx.DeviceType.gpu else _select)(logits)


def read_selection(packed: mx.array) -> Selection:
    """The host's copy of a packed selection: one read of MIN_INPUT_SIZE int32 (waits for its step)."""
    a = np.array(packed, copy=True)
    return Selection(int(a[TOKEN]), float(a[LOGPROB:LOGPROB + 1].view(np.float32)[0]), bool(a[FINITE]))
