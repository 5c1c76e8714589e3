"""The merge of a split decode attention's partials inside the output projection's blocks: the
second of kernels/attend_split.py's two launches (that module says why and what it predicts).

Block (h, c, t) is attend_project's W_o block (kernels/attend_project.py: rows c NT .. c NT + NT
- 1 of W_o's head-h slice, their 16-byte groups, up to PREF of them, loaded before anything
else): its prologue merges head h's NS split partials of token t in a fixed order (no atomics:
deterministic),

    M = max_j m_j,   out = (sum_j exp(m_j - M) acc_j) / (sum_j exp(m_j - M) l_j)  (x sigmoid(gate))

(an empty split: m = NEG_BIG, l = 0, weight 0), into threadgroup memory, then multiplies the
slice by it: one partial per head, [T, H, D], which the router kernel adds to x as it adds
attend_project's. So the merge costs no launch and no HBM round trip of the merged output; each
head's partials (NS (HD + 2) floats, 33 KB at NS 64, HD 128) are read by its ceil(D / NT)
blocks, from L2 after the first.

Shapes:
    part float32 [T, H NS (HD + 2)] (per (token, head, split): acc [HD], m, l), qkv float32 [T, ROW]
    (the gate's columns, GATE), wo float16 [D, H HD] -> partials float32 [T, H, D]
Grid: (H ceil(D / NT), T) blocks of NT threads.
"""

from __future__ import annotations

import mlx.core as mx

from strata.mlx_backend.kernels import attend_project
from strata.mlx_backend.kernels.phases import LaunchSpec, run
from strata.mlx_backend.kernels.source import KernelSource

# MB: a thread's partial loads in flight at once. ncu (H200, 2048 positions): with one load at a
# time the merge took ~0.14 us a split (an L2 round trip each): 14.5 us at NS 64 against 10.2 at 32
# and the W_o GEMV's 6.6 alone
MERGE_BATCH = 16

_MERGE = r"""
  constexpr int GOFF = (H + 2 * KVH) * HD;
  constexpr int ROW = GOFF + GATE * H * HD;
  const uint32_t h = bx / NRC;
  const uint32_t t = by;
  SHARED float wsh[NS];
  SHARED float lsh[NS];
  const DEVICE float* pp = part + ((uint64_t)t * H + h) * NS * (HD + 2);
  for (uint32_t c = tid; c < (uint32_t)NS; c += NT) { wsh[c] = pp[(uint64_t)c * (HD + 2) + HD]; lsh[c] = pp[(uint64_t)c * (HD + 2) + HD + 1]; }
  BARRIER();
  float mm = NEG_BIG;
  for (int c = 0; c < NS; ++c) mm = wsh[c] > mm ? wsh[c] : mm;
  BARRIER();  // every thread has read the maxima before they become weights
  for (uint32_t c = tid; c < (uint32_t)NS; c += NT) wsh[c] = exp_f(wsh[c] - mm);
  BARRIER();
  for (uint32_t r = tid; r < (uint32_t)HD; r += NT) {  // the splits in a fixed order, MB loads in flight
    float ll = 0.0f, aa = 0.0f;
    for (int c0 = 0; c0 < NS; c0 += MB) {
      float v[MB];
      UNROLL for (int q = 0; q < MB; ++q) v[q] = c0 + q < NS ? pp[(uint64_t)(c0 + q) * (HD + 2) + r] : 0.0f;
      if (HD % 32 == 0) warp_sync();  // the loads issued before the sums (whole warps only: HD % 32 == 0)
      UNROLL for (int q = 0; q < MB; ++q) {
        if (c0 + q < NS) { ll += lsh[c0 + q] * wsh[c0 + q]; aa += v[q] * wsh[c0 + q]; }  // an empty split: 0 x 0
      }
    }
    const float gate = GATE ? 1.0f / (1.0f + exp_f(-qkv[(uint64_t)t * ROW + GOFF + (uint64_t)h * HD + r])) : 1.0f;
    osh[r] = aa / ll * gate;
  }
"""
SOURCE = KernelSource("strata_merge_project", ("part", "qkv", "wo"), ("out",),
                      attend_project.W_O_PREFETCH + _MERGE + attend_project.W_O_PROJECT)
WAIT_AT = attend_project.WAIT_AT  # past the same W_o prefetch: where a chained block first reads the partials




def merge_project(part: mx.array, qkv: mx.array, wo: mx.array, *, n_heads: int, n_kv_heads: int, head_dim: int,
                  splits: int, gated: bool, prefetch: int = attend_project.PREFETCH,
                  spec: bool = False) -> mx.array | LaunchSpec:
    """Kernel path: the split partials of `attend_split` (NS = splits) -> the attention output
    times W_o, one partial per head. spec: the launch's `phases.LaunchSpec` instead (part and qkv
    may then be `phases.Pending`: a chain's phase).

    Shapes:
        part float32 [T, H NS (HD + 2)], qkv float32 [T, (H + 2 KVH + gated H) HD], wo float16 [D, H HD]
        -> float32 [T, H, D]
    """
    t, d = qkv.shape[0], wo.shape[0]
    if part.shape != (t, n_heads * splits * (head_dim + 2)) or wo.shape[1] != n_heads * head_dim:
        raise ValueError(f"merge_project: partials {part.shape} for {t} tokens x {n_heads} heads x {splits} splits "
                         f"of {head_dim} + 2, W_o {wo.shape}")
    nrc = -(-d // attend_project.THREADS)
    one = LaunchSpec(SOURCE, (part, qkv, wo), ((t, n_heads, d),), (mx.float32,), (n_heads * nrc, t, 1),
                     attend_project.THREADS,
                     (("H", n_heads), ("KVH", n_kv_heads), ("HD", head_dim), ("GATE", int(gated)),
                      ("NT", attend_project.THREADS), ("NS", splits), ("D", d), ("PREF", prefetch), ("MB", MERGE_BATCH)))
    return one if spec else run(one)[0]
