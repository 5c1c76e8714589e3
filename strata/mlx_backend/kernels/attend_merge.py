"""Decode attention split over the context (flash-decoding): the merge of the chunks' partials.

Why split: `attend` ran one block per (query head, token), so a decoded token's 16 heads kept 16
of the H200's 132 SMs busy and each block walked the whole context position by position (a
dependent load, a warp reduction and an exponential per step): 11.8-12.0 ms/token at context
2048 against 4.5-4.8 at context 8 (issue 19), while the context's KV bytes (0.4 GB a token at
2048, float32) are ~0.12 ms of the H200's bandwidth. With CH > 0 `attend` runs a block per (head,
token, chunk of CH positions) and writes each chunk's partial softmax: the values weighted by
exp(score - m) unnormalised, then m (the chunk's max score) and l (the sum of its exponentials).
This kernel merges a head's chunks in a fixed order (no atomics: deterministic):

    M = max_c m_c,   out = (sum_c exp(m_c - M) acc_c) / (sum_c exp(m_c - M) l_c)  (x sigmoid(gate))

The chunk count NC is fixed by the cache's size (S_MAX / CH, rounded up), so a compiled decode
step's grid does not change with the context: chunks past the last position are empty (m =
NEG_BIG, l = 0) and the merge reads only those holding a position (from the device position).

Shapes:
    merge: part float32 [T, H, NC, HD + 2], qkv float32 [T, ROW] (the gate's columns, GATE)
           -> out float32 [T, H HD]
Grid: (H, T) blocks of NT threads.
"""

from __future__ import annotations

import mlx.core as mx

from strata.mlx_backend.kernels.launch import launch
from strata.mlx_backend.kernels.source import KernelSource

THREADS = 128

MERGE_BODY = r"""
  constexpr int NC = (S_MAX + CH - 1) / CH;
  constexpr int GOFF = (H + 2 * KVH) * HD;
  constexpr int ROW = GOFF + GATE * H * HD;
  const uint32_t h = bx;
  const uint32_t t = by;
  const int32_t n_pos = params[0] + (int32_t)t + 1;
  const int32_t nc = (n_pos + CH - 1) / CH;  // the chunks holding a position; the rest are empty
  const DEVICE float* pp = part + ((uint64_t)t * H + h) * NC * (HD + 2);
  float mm = NEG_BIG;
  for (int32_t c = 0; c < nc; ++c) {
    const float m = pp[(uint64_t)c * (HD + 2) + HD];
    mm = m > mm ? m : mm;
  }
  for (uint32_t r = tid; r < (uint32_t)HD; r += NT) {
    float ll = 0.0f, aa = 0.0f;
    for (int32_t c = 0; c < nc; ++c) {
      const DEVICE float* pc = pp + (uint64_t)c * (HD + 2);
      const float f = exp_f(pc[HD] - mm);
      ll += pc[HD + 1] * f;
      aa += pc[r] * f;
    }
    const float gate = GATE ? 1.0f / (1.0f + exp_f(-qkv[(uint64_t)t * ROW + GOFF + (uint64_t)h * HD + r])) : 1.0f;
    out[((uint64_t)t * H + h) * HD + r] = aa / ll * gate;
  }
"""

MERGE_SOURCE = KernelSource("strata_attend_merge", ("part", "qkv", "params"), ("out",), MERGE_BODY)


def merge(part: mx.array, qkv: mx.array, params: mx.array, *, n_heads: int, n_kv_heads: int, head_dim: int,
          s_max: int, chunk: int, gated: bool) -> mx.array:
    """Kernel path: the chunks' partials of `attend` (CH = chunk) -> every query head's output.

    params: int32, element 0 the first new position (pos0), as `attend` read it.

    Shapes:
        part float32 [T, H NC (HD + 2)], qkv float32 [T, (H + 2 KVH + gated H) HD] -> out float32 [T, H HD]
    """
    t = qkv.shape[0]
    return launch(MERGE_SOURCE, [part, qkv, params], [(t, n_heads * head_dim)], [mx.float32],
                  blocks=(n_heads, t, 1), threads=THREADS,
                  template=(("H", n_heads), ("KVH", n_kv_heads), ("HD", head_dim), ("S_MAX", s_max),
                            ("CH", chunk), ("GATE", int(gated)), ("NT", THREADS)))[0]
