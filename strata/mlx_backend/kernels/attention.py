"""Decode attention after the QKV projection (strata.reference.attention is the definition).

A decoded layer's attention is three launches: the QKV projection (kernels/dense_gemv.py: the
layer's RMSNorm, W_qkv, the bias) -> raw q | k | v rows; `attend` (this file) -> the attention
output of every query head; the output projection (dense_gemv again) -> [T, D].

Why three: the projections are the bytes (15.7 MB of W_qkv and 10.5 MB of W_o per layer at the
seed shape, D 2560, 16 query heads, 4 KV heads of 128, float16), and they need hundreds of
blocks to reach the H200's bandwidth. Fused into the per-head kernels they had one block per
head: ncu measured `qkv_rope` (a block per q/k/v head slot: 24 blocks, so 24 of 132 SMs moved
all of W_qkv) at 64 us per layer, ~12% of copy bandwidth, and `attend` with each of its 16
blocks projecting its head (655 KB per block) at 31 us. As GEMVs they run on 384 and 320 blocks.

`attend`: block (h, t) runs query head h of token t over positions 0..pos0+t of its KV head.
Every warp takes q from the raw qkv row itself (per-head q RMSNorm if QKN, RoPE in the
rotate-half form from the host's float64-computed cos/sin table: the reference's angles, bit for
bit; with partial rotary (RD < HD, Qwen3-Next / Qwen3.5) only the first RD dims of a head rotate,
the rest pass through). Positions below pos0 come from the cache (already normed and roped); the chunk's own
positions pos0..pos0+t are computed in the block from their raw qkv rows (k RMSNorm + RoPE; v
raw), so no block waits on another. Each lane owns the rotate-half pairs (r, r + RD/2),
r = lane + 32 i, and the dims RD + lane + 32 j past the rotary part, of q, k and v alike: RoPE
needs no other lane. Each warp takes every NW-th
position with an online softmax (running max, sum, weighted values); warps merge through
threadgroup memory in a fixed order (no atomics: deterministic). The block with h % (H/KVH) == 0
writes position pos0+t's k and v into the layer's cache, in place (a cast away from const): a
separate cache-update op would cost a launch and, when anything else aliases the cache, a copy
of all of it. The keys it writes are the bits later steps read back, computed by the same code.
With GATE (the sigmoid output gate), the projection's rows carry the gate's H HD columns after
v (its rows stacked under W_qkv: one GEMV), and the merge multiplies each output by their sigmoid.

Shapes:
    attend: qkv float32 [T, (H + 2 KVH + GATE H) HD] (q heads | k heads | v heads | gate heads, raw)
            -> out float32 [T, H HD]; writes kc / vc [KVH, S_MAX, HD] at positions pos0 .. pos0+T-1
Grid: (H, T) blocks of NT threads; split over the context (CH > 0): (H, T, NC) blocks writing
the chunks' partials [T, H, NC, HD + 2] for kernels/attend_merge.py.
"""

from __future__ import annotations

import mlx.core as mx
import numpy as np

from strata.mlx_backend.kernels import attend_merge
from strata.mlx_backend.kernels.launch import absent, float_params, index_param, launch
from strata.mlx_backend.kernels.source import KernelSource, expand

THREADS = 256
MAX_HEAD_DIM = 256  # rotate-half pairs per lane: (HD / 2) / 32 <= 4
# Split over the context (flash-decoding, kernels/attend_merge.py says why): CH positions per
# block, 32 at S_MAX = 4096 per head. A split costs the merge's launch (~5-8 us of host time a
# compiled launch on the H200), so it starts once the context outweighs
# that: a block walks its positions at ~1 us per step per warp, so past SPLIT_FROM positions (32
# steps per warp) one block per head is slower than the launch. Windows longer than SPLIT_MAX_T positions (prompt
# chunks) stay on one block per head: their partials would be T x NC x (HD + 2) floats per head.
SPLIT_CHUNK = 128
SPLIT_FROM = 256
SPLIT_MAX_T = 16


def split_applies(n_pos: int, t: int) -> bool:
    """Whether `attend` over n_pos positions (the last t of them new) splits over the context."""
    return t <= SPLIT_MAX_T and n_pos > SPLIT_FROM

_ATTEND_TEMPLATE = r"""
  constexpr int NW = NT / 32;
  constexpr int RH = RD / 2;              // rotate-half pairs (r, r + RH), r < RH: the rotary part
  constexpr int PPL = (RH + 31) / 32;     // pairs per lane
  constexpr int NP = HD - RD;             // dims past the rotary part (partial rotary): not rotated
  constexpr int PSL = (NP + 31) / 32;     // ... per lane
  constexpr int PSA = PSL > 0 ? PSL : 1;  // (no zero-length arrays)
  constexpr int G = H / KVH;              // query heads per KV head
  constexpr int GOFF = (H + 2 * KVH) * HD;  // the output gate's columns in a row (GATE)
  constexpr int ROW = GOFF + GATE * H * HD; // a raw qkv (| gate) row
  constexpr int NC = CH > 0 ? (S_MAX + CH - 1) / CH : 1;  // chunks of the context (split)
  const uint32_t h = bx;
  const uint32_t t = by;
  const int32_t pos0 = params[0];
  const int32_t n_pos = pos0 + (int32_t)t + 1;  // causal: positions 0 .. pos0 + t
  // CH > 0 (split over the context): block z takes positions [z CH, (z + 1) CH) of them
  const int32_t lo = CH > 0 ? (int32_t)bz * CH : 0;
  const int32_t hi = CH > 0 ? (lo + CH < n_pos ? lo + CH : n_pos) : n_pos;
  const uint32_t kvh = h / G;
  const float eps = fparams[0];
  const float scale = sqrt_f((float)HD);
  SHARED float mw[NW];
  SHARED float lw[NW];
  SHARED float accw[NW * HD];
  // q: every warp its own copy (no barrier); per-head RMSNorm (QKN), then RoPE at pos0 + t
  float qa[PPL], qb[PPL], qc[PSA];
  {
    const DEVICE float* src = qkv + (uint64_t)t * ROW + (uint64_t)h * HD;
    float s2 = 0.0f;
    LOAD_Q
    NORM_ROPE_Q
  }
  float m = NEG_BIG, l = 0.0f;
  float oa[PPL], ob[PPL], oc[PSA];
  UNROLL for (int i = 0; i < PPL; ++i) { oa[i] = 0.0f; ob[i] = 0.0f; }
  UNROLL for (int j = 0; j < PSA; ++j) oc[j] = 0.0f;
  for (int32_t p = lo + (int32_t)warp_id; p < hi; p += NW) {
    float ka[PPL], kb[PPL], kx[PSA], va[PPL], vb[PPL], vx[PSA];
    if (p < pos0) {  // cached (warp-uniform branch): normed and roped when it was written
      const auto kp = kc + ((uint64_t)kvh * S_MAX + p) * HD;  // float, or half_t (KV16)
      const auto vp = vc + ((uint64_t)kvh * S_MAX + p) * HD;
      LOAD_KV_CACHED
    } else {  // this chunk's position: from the raw qkv row of token p - pos0
      const DEVICE float* ks = qkv + (uint64_t)(p - pos0) * ROW + (uint64_t)(H + kvh) * HD;
      const DEVICE float* vs = ks + (uint64_t)KVH * HD;
      float s2 = 0.0f;
      LOAD_KV_RAW
      const bool write = h % G == 0 && p == n_pos - 1;  // one writer per (KV head, position)
      const auto kd = writable(kc) + ((uint64_t)kvh * S_MAX + p) * HD;
      const auto vd = writable(vc) + ((uint64_t)kvh * S_MAX + p) * HD;
      NORM_ROPE_K
    }
    float dot = 0.0f;
    UNROLL for (int i = 0; i < PPL; ++i) dot += qa[i] * ka[i] + qb[i] * kb[i];
    UNROLL for (int j = 0; j < PSL; ++j) dot += qc[j] * kx[j];
    const float sc = warp_sum(dot) / scale;
    const float mn = sc > m ? sc : m;
    const float corr = exp_f(m - mn), pe = exp_f(sc - mn);
    l = l * corr + pe;
    UNROLL for (int i = 0; i < PPL; ++i) {
      oa[i] = oa[i] * corr + pe * va[i];
      ob[i] = ob[i] * corr + pe * vb[i];
    }
    UNROLL for (int j = 0; j < PSL; ++j) oc[j] = oc[j] * corr + pe * vx[j];
    m = mn;
  }
  if (lane == 0) { mw[warp_id] = m; lw[warp_id] = l; }
  UNROLL for (int i = 0; i < PPL; ++i) {
    const int r = (int)lane + 32 * i;
    if (r < RH) { accw[warp_id * HD + r] = oa[i]; accw[warp_id * HD + r + RH] = ob[i]; }
  }
  UNROLL for (int j = 0; j < PSL; ++j) {
    const int e = RD + (int)lane + 32 * j;
    if (e < HD) accw[warp_id * HD + e] = oc[j];
  }
  BARRIER();
  for (uint32_t r = tid; r < (uint32_t)HD; r += NT) {  // merge the warps in a fixed order
    float mm = NEG_BIG;
    for (int w = 0; w < NW; ++w) mm = mw[w] > mm ? mw[w] : mm;
    float ll = 0.0f, aa = 0.0f;
    for (int w = 0; w < NW; ++w) { const float f = exp_f(mw[w] - mm); ll += lw[w] * f; aa += accw[w * HD + r] * f; }
    if (CH > 0) {  // this chunk's partial: unnormalised values, then (max, sum) after them
      const uint64_t base = (((uint64_t)t * H + h) * NC + bz) * (HD + 2);
      out[base + r] = aa;
      if (r == 0) { out[base + HD] = mm; out[base + HD + 1] = ll; }
    } else {
      // the output gate (Qwen3-Next / Qwen3.5): sigmoid of this head's gate column of the projection
      const float gate = GATE ? 1.0f / (1.0f + exp_f(-qkv[(uint64_t)t * ROW + GOFF + (uint64_t)h * HD + r])) : 1.0f;
      out[((uint64_t)t * H + h) * HD + r] = aa / ll * gate;
    }
  }
"""

def _load_pairs(*pairs: tuple[str, str, str, str], sum_squares: bool) -> str:
    """This lane's elements of a head: for each (a, b, c, src), the rotate-half pairs a[i] = src[r],
    b[i] = src[r + RH] for r = lane + 32 i (0 past RH), and the dims past the rotary part c[j] =
    src[RD + lane + 32 j] (0 past HD); with sum_squares, s2 gathers the first head's squares."""
    lines, rest = [], []
    for a, b, c, src in pairs:
        lines += [f"  {a}[i] = r < RH ? F32({src}[r]) : 0.0f;", f"  {b}[i] = r < RH ? F32({src}[r + RH]) : 0.0f;"]
        rest.append(f"  {c}[j] = e < HD ? F32({src}[e]) : 0.0f;")
    if sum_squares:
        a, b, c, _ = pairs[0]
        lines.append(f"  s2 += {a}[i] * {a}[i] + {b}[i] * {b}[i];")
        rest.append(f"  s2 += {c}[j] * {c}[j];")
    body, tail = "\n".join(lines), "\n".join(rest)
    return f"""
UNROLL for (int i = 0; i < PPL; ++i) {{
  const int r = (int)lane + 32 * i;
{body}
}}
UNROLL for (int j = 0; j < PSA; ++j) {{
  const int e = RD + (int)lane + 32 * j;
{tail}
}}
"""


def _norm_rope(a: str, b: str, c: str, weight: str, position: str, then_pair: str = "", then_rest: str = "") -> str:
    """One head's elements of this lane (pairs a[i], b[i]; the rest c[j]), whose sum of squares is
    in s2: the per-head RMSNorm with `weight` (QKN), then RoPE on the pairs at `position`;
    `then_pair` / `then_rest` run per element after it. Written once for q and the chunk's keys."""
    return f"""
    const float inv = QKN ? 1.0f / sqrt_f(warp_sum(s2) / (float)HD + eps) : 1.0f;
    const uint64_t rp = (uint64_t)({position}) * RH;
    UNROLL for (int i = 0; i < PPL; ++i) {{
      const int r = (int)lane + 32 * i;
      if (r < RH) {{
        const float a = QKN ? {a}[i] * inv * F32({weight}[r]) : {a}[i];
        const float b = QKN ? {b}[i] * inv * F32({weight}[r + RH]) : {b}[i];
        const float cs = rope_cos[rp + r], sn = rope_sin[rp + r];
        {a}[i] = a * cs - b * sn;
        {b}[i] = b * cs + a * sn;{then_pair}
      }}
    }}
    UNROLL for (int j = 0; j < PSL; ++j) {{
      const int e = RD + (int)lane + 32 * j;
      if (e < HD) {{
        if (QKN) {c}[j] = {c}[j] * inv * F32({weight}[e]);{then_rest}
      }}
    }}
"""


# attend's pieces by name: kernels/attend_split.py builds its body from the same q and raw-key code
ATTEND_PIECES = dict(
    LOAD_Q=_load_pairs(("qa", "qb", "qc", "src"), sum_squares=True),
    LOAD_KV_CACHED=_load_pairs(("ka", "kb", "kx", "kp"), ("va", "vb", "vx", "vp"), sum_squares=False),
    LOAD_KV_RAW=_load_pairs(("ka", "kb", "kx", "ks"), ("va", "vb", "vx", "vs"), sum_squares=True),
    NORM_ROPE_Q=_norm_rope("qa", "qb", "qc", "q_norm", "pos0 + (int32_t)t"),
    NORM_ROPE_K=_norm_rope(
        "ka", "kb", "kx", "k_norm", "p",
        then_pair="\n        if (KV16) { ka[i] = kv_round(ka[i]); kb[i] = kv_round(kb[i]); va[i] = kv_round(va[i]);"
                  " vb[i] = kv_round(vb[i]); }"
                  "\n        if (write) { put_kv(kd + r, ka[i]); put_kv(kd + r + RH, kb[i]); put_kv(vd + r, va[i]);"
                  " put_kv(vd + r + RH, vb[i]); }",
        then_rest="\n        if (KV16) { kx[j] = kv_round(kx[j]); vx[j] = kv_round(vx[j]); }"
                  "\n        if (write) { put_kv(kd + e, kx[j]); put_kv(vd + e, vx[j]); }"))
ATTEND_BODY = expand(_ATTEND_TEMPLATE, **ATTEND_PIECES)


# The cache's element type is the kernel's float or half_t (KV16): the chunk's own positions are
# rounded as the cache stores them (reference.attention.KVPrecision) before they are used, and
# written through the overload of their pointer type (the inputs are const: a cast away from it).
ATTEND_HELPERS = r"""
INLINE DEVICE float* writable(const DEVICE float* p) { return (DEVICE float*)p; }
INLINE DEVICE half_t* writable(const DEVICE half_t* p) { return (DEVICE half_t*)p; }
INLINE void put_kv(DEVICE float* p, float x) { *p = x; }
INLINE void put_kv(DEVICE half_t* p, float x) { *p = to_half(x); }
INLINE float kv_round(float x) { return F32(to_half(x)); }
"""


ATTEND_SOURCE = KernelSource(
    "strata_attend", ("qkv", "q_norm", "k_norm", "rope_cos", "rope_sin", "params", "fparams", "kc", "vc"),
    ("out",), ATTEND_BODY, ATTEND_HELPERS)


def attend(qkv: mx.array, q_norm: mx.array | None, k_norm: mx.array | None, rope_cos: mx.array, rope_sin: mx.array,
           kc: mx.array, vc: mx.array, pos0: int, eps: float, n_heads: int, *, pos: mx.array | None = None,
           rotary_dim: int | None = None, gated: bool = False, split: bool = False) -> mx.array:
    """Kernel path. Raw qkv rows of positions pos0.. over the cache -> the attention output of
    every query head; writes those positions' keys (normed, roped) and values into kc / vc.

    pos: pos0 already on the device (int32, element 0; `launch.index_param(pos0)` makes one), used
    in place of `pos0`, which is then not read. Under mx.compile the position must be an input of
    the traced function, not a Python int baked into its graph (compiled.py).
    rotary_dim: RoPE on the first rotary_dim dims of each head, the rest passed through (None:
    the whole head). gated: each row ends with the output gate's H HD columns; the output is
    multiplied by their sigmoid. split: a block per chunk of SPLIT_CHUNK positions, then the
    merge (kernels/attend_merge.py): two launches, for long contexts (`split_applies`).

    Shapes:
        qkv float32 [T, (H + 2 KVH + gated H) HD], q_norm / k_norm float16 [HD] or None (together),
        rope_cos / rope_sin float32 [S_MAX, RD / 2], kc / vc float32 or float16 [KVH, S_MAX, HD]
        (float16: the cache stores each key and value rounded, reference.attention.KVPrecision.F16)
        -> out float32 [T, H HD]
    """
    t, width = qkv.shape
    kvh, s_max, hd = kc.shape
    rd = hd if rotary_dim is None else rotary_dim
    if (hd % 8 or hd > MAX_HEAD_DIM or n_heads % kvh or width != (n_heads * (1 + int(gated)) + 2 * kvh) * hd
            or rd % 2 or not 0 < rd <= hd or rope_cos.shape[-1] != rd // 2):
        raise ValueError(f"attend kernel: head_dim {hd} (a multiple of 8, <= {MAX_HEAD_DIM}), {n_heads} heads over "
                         f"{kvh} KV heads, qkv width {width} (gated {gated}), rotary dims {rd} "
                         f"(table of {rope_cos.shape[-1]} pairs)")
    if (q_norm is None) != (k_norm is None):
        raise ValueError("attend kernel: q_norm and k_norm come together")
    if pos is not None and (pos.dtype != mx.int32 or pos.size < 1):
        raise ValueError(f"attend kernel: pos must be int32 with at least one element, got {pos.dtype} [{pos.size}]")
    if kc.dtype != vc.dtype or kc.dtype not in (mx.float32, mx.float16):
        raise ValueError(f"attend kernel: the cache is float32 or float16 (keys {kc.dtype}, values {vc.dtype})")
    kv16 = kc.dtype == mx.float16
    qkn = q_norm is not None
    half = absent(np.float16)  # absent optional inputs
    params = index_param(pos0) if pos is None else pos
    ch = SPLIT_CHUNK if split else 0
    nc = -(-s_max // SPLIT_CHUNK) if split else 1
    width_out = n_heads * nc * (hd + 2) if split else n_heads * hd  # split: the chunks' partials
    out = launch(ATTEND_SOURCE, [qkv, q_norm if qkn else half, k_norm if qkn else half, rope_cos, rope_sin,
                                 params, float_params(eps), kc, vc],
                 [(t, width_out)], [mx.float32], blocks=(n_heads, t, nc), threads=THREADS,
                 template=(("H", n_heads), ("KVH", kvh), ("HD", hd), ("S_MAX", s_max), ("QKN", int(qkn)),
                           ("RD", rd), ("GATE", int(gated)), ("NT", THREADS), ("CH", ch), ("KV16", int(kv16))))[0]
    if not split:
        return out
    return attend_merge.merge(out, qkv, params, n_heads=n_heads, n_kv_heads=kvh, head_dim=hd, s_max=s_max,
                              chunk=ch, gated=gated)
