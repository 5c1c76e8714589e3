"""The decode QKV GEMV walked KV group by KV group, as the first phase of the chained attention
launch (kernels/attend_project.py, `walks_by_group`): an attention block waits for its own group's
rows only, so the attention of the first groups runs while the GEMV still reads the last ones.

A KV group's rows of the QKV projection are its G query heads, its key head, its value head and
(gated attention) its G heads' output-gate columns: RG = (G (1 + GATE) + 2) HD rows. The phase
has ceil(RG / 8) blocks of 8 warps; warp w of block b owns row j = 8 b + w of every group and
walks the KVH groups in order, one row a group: group g's row loaded (every 16-byte group of it
in flight at once, as `dense_gemv`), multiplied by the normed activations in threadgroup memory,
and the next group's row loaded before this one's sum is reduced and stored. After each group a
block fences its stores and counts into `chain_extra[g]` (kernels/phases.py); an attention block
of a head in group g waits there for every block of the phase.

Why: ncu timed the chained QKV + attention + W_o + router launch at ~30 us a layer on the H200
(the GEMV's 15.7 MB at ~9 us cold, then the attention's chain of dependent steps, then W_o),
while the launch's 27.5 MB take ~8 us at copy speed. In the plain chain every GEMV block reads
its rows at once, so every row arrives at about the same time and no attention block can start
early; walking the groups in order with all of the GEMV's 96 blocks (at the seed shape) resident
beside the 160 attention blocks lets group g's attention overlap the reads of groups g + 1 ...
Predicted: ~6-10 us a layer off the launch (0.3-0.5 ms a token).

Each row's sum is the one `dense_gemv` forms for it (a lane's 16-byte groups in order, then the
warp's sum), so the outputs are bit for bit the plain chain's.

Shapes (one token):
    w float16 [(H + 2 KVH + GATE H) HD, C], x float32 [1, C], norm_w float16 [C], bias float16 [R]
    -> y float32 [1, (H + 2 KVH + GATE H) HD]
Grid: ceil(RG / 8) blocks of 256 threads; CUDA and the emulator, inside a chain only.
"""

from __future__ import annotations

import mlx.core as mx
import numpy as np

from strata.mlx_backend.kernels import dense_gemv as dense_kernel
from strata.mlx_backend.kernels.launch import absent, as_f32, float_params
from strata.mlx_backend.kernels.phases import LaunchSpec
from strata.mlx_backend.kernels.preludes import WARP
from strata.mlx_backend.kernels.source import KernelSource, expand

THREADS = dense_kernel.THREADS
# where the walk pays: few groups (each a round of loads a warp, one after another) and few blocks
# (they must all be resident beside the attention's blocks for the early start to happen)
MAX_GROUPS = 8
MAX_BLOCKS = 132

HELPERS = r"""
// row j (< RG) of KV group g of a raw qkv (| gate) row: the group's G query heads, its key head,
// its value head, then its heads' output-gate columns
INLINE uint32_t qkv_group_row(uint32_t g, uint32_t j, uint32_t G, uint32_t HD, uint32_t H, uint32_t KVH) {
  const uint32_t qr = G * HD;
  if (j < qr) return g * qr + j;
  if (j < qr + HD) return H * HD + g * HD + (j - qr);
  if (j < qr + 2 * HD) return (H + KVH) * HD + g * HD + (j - qr - HD);
  return (H + 2 * KVH) * HD + g * qr + (j - qr - 2 * HD);
}
"""

BODY = r"""
  constexpr int NW = NT / 32;
  constexpr int GPR = C / 8;              // 16-byte groups per row
  constexpr int GPL = (GPR + 31) / 32;    // ... per lane, all in flight at once
  constexpr int G = H / KVH;
  constexpr int RG = (G * (1 + GATE) + 2) * HD;  // a KV group's rows
  SHARED float xs[C];  // xs[j * GPR + g] = xn[8 g + j], as dense_gemv stages it
  SHARED float red[NW];
  const uint32_t t = 0;                   // the one token (dense_gemv's STAGE_X reads row t of x)
  const uint32_t j = bx * NW + warp_id;   // this warp's row of every group
  const uint32_t jr = j < (uint32_t)RG ? j : (uint32_t)(RG - 1);  // past RG: read a real row, store nothing
  uint4 wv[GPL];
  const DEVICE half_t* row = w + (uint64_t)qkv_group_row(0u, jr, G, HD, H, KVH) * C;
  UNROLL for (int i = 0; i < GPL; ++i) {  // group 0's row: in flight while x is staged and normed
    const int g8 = (int)lane + 32 * i;
    wv[i] = *(const DEVICE uint4*)(row + 8 * (g8 < GPR ? g8 : GPR - 1));
  }
  STAGE_X
  for (int g = 0; g < KVH; ++g) {
    warp_sync();  // a fence for the scheduler: the row's loads all issue before its FMAs
    float acc = 0.0f;
    UNROLL for (int i = 0; i < GPL; ++i) {
      const int g8 = (int)lane + 32 * i;
      if (g8 < GPR) {
        const f8 wf = h8_f8(wv[i]);
        UNROLL for (int e = 0; e < 8; ++e) acc += wf.v[e] * xs[e * GPR + g8];
      }
    }
    if (g + 1 < KVH) {  // the next group's row in flight while this one's sum is reduced and published
      row = w + (uint64_t)qkv_group_row((uint32_t)g + 1u, jr, G, HD, H, KVH) * C;
      UNROLL for (int i = 0; i < GPL; ++i) {
        const int g8 = (int)lane + 32 * i;
        wv[i] = *(const DEVICE uint4*)(row + 8 * (g8 < GPR ? g8 : GPR - 1));
      }
    }
    const float a = warp_sum(acc);
    if (lane == 0 && j < (uint32_t)RG) {
      const uint32_t r = qkv_group_row((uint32_t)g, j, G, HD, H, KVH);
      y[r] = a + (BIAS ? F32(bias[r]) : 0.0f);
      fence_device();  // published before the count below
    }
    BARRIER();
    if (tid == 0) atomic_add_u32(chain_extra + g, 1u);
  }
"""

BODY = expand(BODY, STAGE_X=dense_kernel.STAGE_X)

SOURCE = KernelSource("strata_qkv_groups", ("w", "x", "norm_w", "bias", "fparams"), ("y",), BODY, HELPERS,
                      metal=False)
def attend_wait(group: str = "(bx / NRC) / (H / KVH)") -> str:
    """An attention block's wait (where its body first reads qkv), the walk being the chain's
    first phase: for the count of its KV group, `group` (an expression of the body; by default
    kernels/attend_project.py's: its head h = bx / NRC is in group h / G), to reach the walk's
    blocks."""
    return f"""
  if (tid == 0) wait_count(chain_extra + {group}, (uint32_t)CHAIN_S1);
  BARRIER();
"""


ATTEND_WAIT = attend_wait()


def blocks(n_heads: int, n_kv_heads: int, head_dim: int, gated: bool) -> int:
    """The phase's blocks: a KV group's rows over 8 warps."""
    rg = (n_heads // n_kv_heads * (1 + int(gated)) + 2) * head_dim
    return -(-rg // (THREADS // WARP))


def applies(wqkv: mx.array, n_heads: int, n_kv_heads: int, head_dim: int, gated: bool) -> bool:
    """Whether the walk serves this projection: few groups and blocks, a row's loads all in flight."""
    c = wqkv.shape[1]
    return (1 < n_kv_heads <= MAX_GROUPS and blocks(n_heads, n_kv_heads, head_dim, gated) <= MAX_BLOCKS
            and c % 8 == 0 and -(-(c // 8) // WARP) <= dense_kernel.MAX_LOADS)


def qkv_groups(w: mx.array, x: mx.array, norm_w: mx.array | None, eps: float, bias: mx.array | None, *,
               n_heads: int, n_kv_heads: int, head_dim: int, gated: bool) -> LaunchSpec:
    """The walk's `phases.LaunchSpec` (a chain's first phase; its `chain_extra` must hold
    n_kv_heads counters). Shapes: w float16 [R, C], x float32 [1, C] -> y float32 [1, R]."""
    r, c = w.shape
    if x.shape[0] != 1 or r != (n_heads * (1 + int(gated)) + 2 * n_kv_heads) * head_dim:
        raise ValueError(f"qkv_groups: one token ({x.shape[0]}) and {r} rows for {n_heads} heads over "
                         f"{n_kv_heads} KV heads of {head_dim} (gated {gated})")
    norm, has_bias = norm_w is not None, bias is not None
    return LaunchSpec(SOURCE, (w, as_f32(x), norm_w if norm else absent(np.float16),
                               bias if has_bias else absent(np.float16), float_params(eps)),
                      ((1, r),), (mx.float32,), (blocks(n_heads, n_kv_heads, head_dim, gated), 1, 1), THREADS,
                      (("C", c), ("NORM", int(norm)), ("BIAS", int(has_bias)), ("NT", THREADS), ("H", n_heads),
                       ("KVH", n_kv_heads), ("HD", head_dim), ("GATE", int(gated))))
