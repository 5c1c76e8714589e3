"""Decode attention over a long context in two launches: `attend_split` (this file: flash
decoding, a block per (KV head, split of the context)) and `merge_project` (kernels/merge_project.py:
the splits merged inside the output projection's blocks). strata.reference.attention is the
definition.

Why (issue 19, H200, the seed shape: 16 q / 4 KV heads of 128, D 2560, float32 cache): the split
before this (kernels/attention.py with CH > 0, then kernels/attend_merge.py, then the W_o GEMV)
was three launches a layer where a short context takes one (kernels/attend_project.py): 338
launches a token at context 2048 against 242 at 8, and 5.59 against 3.83 ms a token with no host
wait: ~37 us a layer more, where the layer's keys and values at 2048 positions are 8.4 MB (2.5
us at 3.4 TB/s). Its attend ran a block per (query head, chunk of 128 positions): each warp took
16 positions one dependent step at a time (a load, a warp sum, two exponentials), and the four
query heads of a KV head read the same rows four times.

`attend_split`, block (g, j, t): the HPB query heads h0 .. h0 + HPB - 1 of KV head g / (G / HPB)
over split j of token t's positions 0 .. pos0 + t (NS splits of ceil(n / NS) positions: every
block has work at every length past NS, the grid does not change with the context, so a compiled
step keeps one trace). Each warp takes PB consecutive cached rows a step, 16-byte loads (a lane's
4 floats of each key and value row: a row is one coalesced 512-byte read at HD 128), the first
step's loads issued before q is made; each row loaded once serves the block's HPB heads (one
warp sum a head and row). The chunk's own positions (>= pos0) come from the raw qkv rows as in
attend (the same pieces: per-head k norm, RoPE, the float16 rounding of KV16, the one writer per
(KV head, position)), made into threadgroup memory by the warps that do not make q, beside
them and before the cached rows, NEWMAX at a time (at most T of them, in the last splits): every
load that waits on nothing goes out first. Warps merge in a fixed order; out: per (token, head, split) the
unnormalised values, the max and the sum (an empty split: zeros, NEG_BIG, 0).

`merge_project`, block (h, c, t) as attend_project's: rows c NT .. c NT + NT - 1 of W_o's head-h
slice, loaded (16-byte groups, up to PREF of them) before the merge; the head's NS partials merged
in a fixed order, M = max m_j, out = sum_j exp(m_j - M) acc_j / sum_j exp(m_j - M) l_j (x the
output gate), then the slice times the head's output: one partial per head, [T, H, D], which the
router kernel adds to x as it adds attend_project's (the same router specialisation: P = H).

Predicted at context 2048 (seed shape, a layer): attend_split 256 blocks (4 KV heads x NS 64), 32
positions a block, 4 a warp (one step): all 8.4 MB in flight at once, so ~2.5 us of bytes + ~2 us
of ramp and q's prologue: ~4-5 us (the old split attend + merge: ~25-30 us by the difference
above). merge_project: W_o's 10.5 MB (6.7 us as the GEMV alone, attend_project 9.8 us at context 8)
plus 532 KB of partials, each head's 33 KB read by its 10 row blocks from L2: ~7-8 us. So ~12 us a
layer against attend_project's 9.8 at context 8, one launch more (290 a token against 242, not
338): context 2048 at ~0.15-0.25 ms a token over context 8 with no host wait (~1.05x).
Measured (H200, ncu, the first form): attend_split 12.4 us at 2048 and 7.0 at 64 positions,
merge_project 14.5: fixed costs, not bytes. The first form made the window's own positions only
after every cached row (two more dependent accesses and two barriers at the end) and the merge
loaded one partial at a time (~0.14 us a split); now the positions are made beside q, q's row is
loaded before the position, and the merge loads MB partials at once: predicted ~5-7 and ~8-9 us.

Shapes:
    attend_split: qkv float32 [T, (H + 2 KVH + GATE H) HD] (raw), kc / vc float32 or float16
                  [KVH, S_MAX, HD] -> part float32 [T, H NS (HD + 2)]; writes the T new positions
    merge_project: part, qkv, wo float16 [D, H HD] -> partials float32 [T, H, D]
Grids: attend_split (KVH G / HPB, NS, T) blocks of NT threads; merge_project (H ceil(D / NT), T).
"""

from __future__ import annotations

import mlx.core as mx
import numpy as np

from strata.mlx_backend import kernel_plan
from strata.mlx_backend.kernels import attend_project, merge_project, phases, qkv_groups
from strata.mlx_backend.kernels import attention as attn
from strata.mlx_backend.kernels import router as router_kernel
from strata.mlx_backend.kernels.launch import absent, float_params, index_param
from strata.mlx_backend.kernels.phases import LaunchSpec, run
from strata.mlx_backend.kernels.source import KernelSource, expand

THREADS = 256  # 8 warps a block: 8 x PB rows of a split in flight at once
SPLITS = 64  # NS: 4 KV heads x 64 = 256 blocks at the seed shape (132 SMs); 32 positions a block at 2048
POSITIONS_PER_STEP = 4  # PB: a warp's cached rows whose loads are in flight together
MAX_HEAD_ROWS = 512  # HPB x HD: the block's q rows and each warp's accumulators in threadgroup memory
NEW_PER_ROUND = 4  # NEWMAX: the chunk's own positions made at once (a decoded token: 1, in one round)
# The block's scores summed at once and each divided and exponentiated in one lane (`_update`'s TR
# form), not each summed by its own warp_sum and then divided and exponentiated by all 32 lanes.
# Why: the chain's marks on the H200 put the split attention's time in its cached-rows loop (~10
# kcycles a step of 4 rows x 4 heads at 4 warps a scheduler, ncu: 12.4 cycles between a warp's
# instructions), where a step's 16 scores each took a 6-shuffle sum, an IEEE division and an
# exponential on every lane: ~1400 instructions a warp; summed at once they take 16 + 1 shuffles,
# and each lane divides and exponentiates one score: ~400. Measured (H200, context 2048, seed
# shape): the split chain's launch 34.3 us a layer against 41.5 (a chain's timeline: the cached
# rows scored 9.5 kcycles after the wait against 23.5); ncu by graph 3232 against 3404 us a token
# for the split chain, 3692 against 3871 for the six launches (docs/perf.md). The same bits (the
# xor levels of warp_sum; tests/mlx_backend/test_mlx_attend_split.py, emulated and on the H200). The kernel
# plan's spread_scores: off on Metal (its warp_sum is simd_sum, whose order this does not follow:
# Metal keeps the per-score sums).

_BODY = r"""
  constexpr int NW = NT / 32;
  constexpr int RH = RD / 2;
  constexpr int PPL = (RH + 31) / 32;
  constexpr int NP = HD - RD;
  constexpr int PSL = (NP + 31) / 32;
  constexpr int PSA = PSL > 0 ? PSL : 1;
  constexpr int G = H / KVH;
  constexpr int NG = G / HPB;             // head groups a KV head (blocks per KV head and split)
  constexpr int ROW = (H + 2 * KVH + GATE * H) * HD;
  constexpr int GPL = (HD + 127) / 128;   // a row's 16-byte loads a lane
  constexpr int EPL = 4 * GPL;            // ... its elements: i -> 4 (lane + 32 (i / 4)) + i % 4
  const uint32_t hb = FLAT ? bx % (KVH * NG) : bx;  // FLAT: one row of blocks, split j = bx / (KVH NG)
  const uint32_t kvh = hb / NG;
  const uint32_t h0 = kvh * G + (hb % NG) * HPB;
  const uint32_t j = FLAT ? bx / (KVH * NG) : by;
  const uint32_t t = FLAT ? 0u : bz;
  const float eps = fparams[0];
  const float scale = sqrt_f((float)HD);
  const DEVICE float* qkv_t = qkv + (uint64_t)t * ROW;
  SHARED float qsh[HPB * HD];
  SHARED float ksh[NEWMAX * HD];
  SHARED float vsh[NEWMAX * HD];
  SHARED float mw[NW * HPB];
  SHARED float lw[NW * HPB];
  SHARED float accw[NW * HPB * HD];
  // Every load that does not wait on another goes out first, so the block's chain of dependent
  // memory accesses is: the position, then the rows / the RoPE table / the raw keys, together
  // (ncu: the kernel's fixed cost, 7 us at 64 positions, was that chain's length).
  float qa[PPL], qb[PPL], qc[PSA];
  float s2 = 0.0f;
  const bool qwarp = warp_id < (uint32_t)HPB;  // warp u < HPB makes q of head h0 + u
  if (qwarp) {
    const DEVICE float* src = qkv_t + (uint64_t)(h0 + warp_id) * HD;
    LOAD_Q
  }
  const int32_t pos0 = params[0];
  const int32_t n_pos = pos0 + (int32_t)t + 1;  // causal: positions 0 .. pos0 + t
  const int32_t chunk = (n_pos + NS - 1) / NS;
  const int32_t lo = (int32_t)j * chunk;
  const int32_t hi = lo + chunk < n_pos ? lo + chunk : n_pos;  // lo >= hi: an empty split
  const int32_t hc = hi < pos0 ? hi : pos0;  // cached positions end here; [nlo, hi) are new
  const int32_t nlo = lo > pos0 ? lo : pos0;
  const int32_t rounds = hi > nlo ? (hi - nlo + NEWMAX - 1) / NEWMAX : 0;  // of NEWMAX new positions
  int32_t p0 = lo + (int32_t)warp_id * PB;
  float kr[PB][EPL], vr[PB][EPL];
  if (p0 < hc) {
    LOAD_ROWS
  }
  if (qwarp) {  // attend's code: per-head norm, RoPE at pos0 + t
    NORM_ROPE_Q
    PAIRS_TO_SHARED(qsh + warp_id * HD, qa, qb, qc)
  }
  RAW_ROUND(0)
  BARRIER();
  float qv[HPB][EPL], acc[HPB][EPL], m[HPB], l[HPB];
  UNROLL for (int u = 0; u < HPB; ++u) {
    UNROLL for (int i = 0; i < EPL; ++i) {
      const int e = 4 * ((int)lane + 32 * (i / 4)) + i % 4;
      qv[u][i] = e < HD ? qsh[u * HD + e] : 0.0f;
      acc[u][i] = 0.0f;
    }
    m[u] = NEG_BIG;
    l[u] = 0.0f;
  }
  while (p0 < hc) {  // the cached rows, PB a step
    UPDATE_CACHED
    p0 += NW * PB;
    if (p0 < hc) {
      LOAD_ROWS
    }
  }
  // the chunk's own positions, NEWMAX a round (block-uniform loop: its barriers are the block's)
  for (int32_t k = 0; k < rounds; ++k) {
    if (k > 0) {
      BARRIER();  // the last round's rows read before these overwrite them
      RAW_ROUND(k)
      BARRIER();
    }
    for (int i = (int)warp_id; i < NEWMAX; i += NW) {
      if (nlo + k * NEWMAX + i < hi) {
        UNROLL for (int c = 0; c < EPL; ++c) {
          const int e = 4 * ((int)lane + 32 * (c / 4)) + c % 4;
          kr[0][c] = e < HD ? ksh[i * HD + e] : 0.0f;
          vr[0][c] = e < HD ? vsh[i * HD + e] : 0.0f;
        }
        UPDATE_NEW
      }
    }
  }
  // the warps merged in a fixed order (no atomics: deterministic)
  UNROLL for (int u = 0; u < HPB; ++u) {
    if (lane == 0) { mw[warp_id * HPB + u] = m[u]; lw[warp_id * HPB + u] = l[u]; }
    UNROLL for (int i = 0; i < EPL; ++i) {
      const int e = 4 * ((int)lane + 32 * (i / 4)) + i % 4;
      if (e < HD) accw[(warp_id * HPB + u) * HD + e] = acc[u][i];
    }
  }
  BARRIER();
  for (uint32_t x = tid; x < (uint32_t)(HPB * HD); x += NT) {
    const uint32_t u = x / HD, r = x % HD;
    float mm = NEG_BIG;
    for (int w = 0; w < NW; ++w) mm = mw[w * HPB + u] > mm ? mw[w * HPB + u] : mm;
    float ll = 0.0f, aa = 0.0f;
    for (int w = 0; w < NW; ++w) {
      const float f = exp_f(mw[w * HPB + u] - mm);
      ll += lw[w * HPB + u] * f;
      aa += accw[(w * HPB + u) * HD + r] * f;
    }
    const uint64_t base = (((uint64_t)t * H + h0 + u) * NS + j) * (HD + 2);
    part[base + r] = aa;
    if (r == 0) { part[base + HD] = mm; part[base + HD + 1] = ll; }
  }
"""

# PB rows from p0 on (a row past the cached ones rereads the last: its weight is 0 below)
_LOAD_ROWS = r"""
UNROLL for (int b = 0; b < PB; ++b) {
  const int32_t p = p0 + b < hc ? p0 + b : hc - 1;
  const auto kp = kc + ((uint64_t)kvh * S_MAX + p) * HD;
  const auto vp = vc + ((uint64_t)kvh * S_MAX + p) * HD;
  UNROLL for (int g = 0; g < GPL; ++g) {
    const int e = 4 * ((int)lane + 32 * g);
    const f4 a = e < HD ? load_kv4(kp + e) : zero4();
    const f4 c = e < HD ? load_kv4(vp + e) : zero4();
    UNROLL for (int q = 0; q < 4; ++q) { kr[b][4 * g + q] = a.v[q]; vr[b][4 * g + q] = c.v[q]; }
  }
}
"""


def _update(nb: str, valid: str) -> str:
    """The online softmax over nb rows in kr / vr for each of the block's heads (row b counts
    where `valid`; the first always does). Spread (TR, the plan's spread_scores): the HPB nb scores summed at once
    (`warp_sums_spread`), each lane dividing and exponentiating its own one, the values then read
    from their lanes: the same operations on the same values in the same order, so the same bits."""
    return f"""
if (TR && HPB * {nb} <= 32) {{
  constexpr int NV = HPB * {nb};
  constexpr int P2 = NV <= 1 ? 1 : NV <= 2 ? 2 : NV <= 4 ? 4 : NV <= 8 ? 8 : NV <= 16 ? 16 : 32;
  constexpr int SH = P2 == 1 ? 5 : P2 == 2 ? 4 : P2 == 4 ? 3 : P2 == 8 ? 2 : P2 == 16 ? 1 : 0;
  fx32 rv;
  UNROLL for (int u = 0; u < HPB; ++u) {{
    UNROLL for (int b = 0; b < {nb}; ++b) {{
      float dot = 0.0f;
      UNROLL for (int i = 0; i < EPL; ++i) dot += qv[u][i] * kr[b][i];
      rv.v[u * {nb} + b] = dot;
    }}
  }}
  UNROLL for (int v = NV; v < 32; ++v) rv.v[v] = 0.0f;
  const int mv = (int)(lane >> SH);  // this lane's score: head mv / nb, row mv % nb
  const float ms = warp_sums_spread(rv, P2, lane) / scale;
  float mns[HPB];
  float mmy = 0.0f;  // the running max of this lane's head
  UNROLL for (int u = 0; u < HPB; ++u) {{
    float mn = m[u];
    UNROLL for (int b = 0; b < {nb}; ++b) {{
      const float sb = ({valid}) ? shfl_f(ms, (uint32_t)((u * {nb} + b) << SH)) : NEG_BIG;
      mn = sb > mn ? sb : mn;
    }}
    mns[u] = mn;
    if (mv / {nb} == u) mmy = mn;
  }}
  float pmy;
  {{
    const int b = mv % {nb};
    pmy = (mv < NV && ({valid})) ? exp_f(ms - mmy) : 0.0f;
  }}
  UNROLL for (int u = 0; u < HPB; ++u) {{
    const float corr = exp_f(m[u] - mns[u]);
    l[u] = l[u] * corr;
    float pe[{nb}];
    UNROLL for (int b = 0; b < {nb}; ++b) {{ pe[b] = shfl_f(pmy, (uint32_t)((u * {nb} + b) << SH)); l[u] += pe[b]; }}
    UNROLL for (int i = 0; i < EPL; ++i) {{
      float a = acc[u][i] * corr;
      UNROLL for (int b = 0; b < {nb}; ++b) a += pe[b] * vr[b][i];
      acc[u][i] = a;
    }}
    m[u] = mns[u];
  }}
}} else {{
UNROLL for (int u = 0; u < HPB; ++u) {{
  float sc[{nb}];
  float mn = m[u];
  UNROLL for (int b = 0; b < {nb}; ++b) {{
    float dot = 0.0f;
    UNROLL for (int i = 0; i < EPL; ++i) dot += qv[u][i] * kr[b][i];
    const float s = warp_sum(dot) / scale;
    sc[b] = ({valid}) ? s : NEG_BIG;
    mn = sc[b] > mn ? sc[b] : mn;
  }}
  const float corr = exp_f(m[u] - mn);
  l[u] = l[u] * corr;
  float pe[{nb}];
  UNROLL for (int b = 0; b < {nb}; ++b) {{ pe[b] = ({valid}) ? exp_f(sc[b] - mn) : 0.0f; l[u] += pe[b]; }}
  UNROLL for (int i = 0; i < EPL; ++i) {{
    float a = acc[u][i] * corr;
    UNROLL for (int b = 0; b < {nb}; ++b) a += pe[b] * vr[b][i];
    acc[u][i] = a;
  }}
  m[u] = mn;
}}
}}
"""


def _raw_round(k: str) -> str:
    """`RAW_ROUND(k)`: the new positions nlo + k NEWMAX + ni (ni < NEWMAX, below hi) made from their
    raw qkv rows by attend's code (k norm, RoPE, KV16 rounding, the cache write of the one writer),
    position ni by warp (HPB + ni) % NW (round 0 beside q's warps), into ksh / vsh row ni."""
    return f"""
for (int ni = 0; ni < NEWMAX; ++ni) {{  // ni: not i, which attend's pieces use
  const int32_t p = nlo + ({k}) * NEWMAX + ni;
  if ((uint32_t)((HPB + ni) % NW) == warp_id && p < hi) {{  // warp-uniform
    float ka[PPL], kb[PPL], kx[PSA], va[PPL], vb[PPL], vx[PSA];
    const DEVICE float* ks = qkv + (uint64_t)(p - pos0) * ROW + (uint64_t)(H + kvh) * HD;
    const DEVICE float* vs = ks + (uint64_t)KVH * HD;
    float s2 = 0.0f;
    LOAD_KV_RAW
    const bool write = hb % NG == 0 && p == n_pos - 1;  // one writer per (KV head, position)
    const auto kd = writable(kc) + ((uint64_t)kvh * S_MAX + p) * HD;
    const auto vd = writable(vc) + ((uint64_t)kvh * S_MAX + p) * HD;
    NORM_ROPE_K
    PAIRS_TO_SHARED(ksh + ni * HD, ka, kb, kx)
    PAIRS_TO_SHARED(vsh + ni * HD, va, vb, vx)
  }}
}}
"""


def _pairs_to_shared(dst: str, a: str, b: str, c: str) -> str:
    """`PAIRS_TO_SHARED(dst, a, b, c)`: this lane's rotate-half pairs and the rest of a head (attend's
    layout) stored at dst[0 .. HD)."""
    return f"""
UNROLL for (int i = 0; i < PPL; ++i) {{
  const int r = (int)lane + 32 * i;
  if (r < RH) {{ ({dst})[r] = {a}[i]; ({dst})[r + RH] = {b}[i]; }}
}}
UNROLL for (int jj = 0; jj < PSL; ++jj) {{
  const int e = RD + (int)lane + 32 * jj;
  if (e < HD) ({dst})[e] = {c}[jj];
}}
"""


def _macro(body: str, name: str, fn) -> str:
    """body with each line `name(a, b, ...)` replaced by fn("a", "b", ...), indented alike."""
    out = []
    for line in body.splitlines(keepends=True):
        text = line.strip()
        if text.startswith(name + "("):
            args = [a.strip() for a in text[len(name) + 1:text.rindex(")")].split(",")]
            ind = line[:len(line) - len(line.lstrip())]
            out += [ind + s + "\n" for s in fn(*args).strip("\n").splitlines()]
        else:
            out.append(line)
    return "".join(out)


BODY = _macro(expand(_macro(_BODY, "RAW_ROUND", _raw_round), LOAD_ROWS=_LOAD_ROWS,
                     UPDATE_CACHED=_update("PB", "p0 + b < hc"), UPDATE_NEW=_update("1", "true"),
                     **{k: attn.ATTEND_PIECES[k] for k in ("LOAD_Q", "NORM_ROPE_Q", "LOAD_KV_RAW", "NORM_ROPE_K")}),
              "PAIRS_TO_SHARED", _pairs_to_shared)
HELPERS = attn.ATTEND_HELPERS + r"""
INLINE f4 zero4() { f4 r; for (int i = 0; i < 4; ++i) r.v[i] = 0.0f; return r; }
INLINE f4 load_kv4(const DEVICE float* p) { return load_f4(p); }
INLINE f4 load_kv4(const DEVICE half_t* p) { f4 r; for (int i = 0; i < 4; ++i) r.v[i] = F32(p[i]); return r; }
"""
ATTEND_SOURCE = KernelSource("strata_attend_split", ("qkv", "q_norm", "k_norm", "rope_cos", "rope_sin", "params",
                                                     "fparams", "kc", "vc"), ("part",), BODY, HELPERS)

def spreads() -> bool:
    """Whether the split attention sums a step's scores at once here (the plan's spread_scores)."""
    return kernel_plan.current().spread_scores


def heads_per_block(n_heads: int, n_kv_heads: int, head_dim: int) -> int:
    """HPB: the largest power of two dividing the group (H / KVH) with HPB x HD <= MAX_HEAD_ROWS,
    at most a warp a head (q is made by warps 0 .. HPB - 1)."""
    g, hpb = n_heads // n_kv_heads, 1
    while g % (2 * hpb) == 0 and 2 * hpb * head_dim <= MAX_HEAD_ROWS and 2 * hpb <= THREADS // 32:
        hpb *= 2
    return hpb


def applies(wo: mx.array) -> bool:
    """Whether a split decode step takes these two launches: a float16 W_o (a Q8_0 one takes
    attend, the merge and the Q8_0 GEMV)."""
    return wo.dtype == mx.float16 and wo.ndim == 2


def attend_split_project(qkv: mx.array, q_norm: mx.array | None, k_norm: mx.array | None, rope_cos: mx.array,
                         rope_sin: mx.array, kc: mx.array, vc: mx.array, wo: mx.array, pos0: int, eps: float,
                         n_heads: int, *, pos: mx.array | None = None, rotary_dim: int | None = None,
                         gated: bool = False, splits: int | None = None, positions_per_step: int | None = None,
                         prefetch: int | None = None) -> mx.array:
    """Kernel path: attention of T new positions split over the context, then the output
    projection by wo, as one partial per head. Writes the positions' keys and values into kc / vc
    as attend does. splits (NS), positions_per_step (PB), prefetch (16-byte groups of a W_o row
    loaded before the merge): the step's shape, None for the module's (any is correct; the
    benchmarks and tests compare).

    Shapes:
        qkv float32 [T, (H + 2 KVH + gated H) HD], kc / vc float32 or float16 [KVH, S_MAX, HD],
        wo float16 [D, H HD] -> partials float32 [T, H, D]
    """
    attend = _attend_spec(qkv, q_norm, k_norm, rope_cos, rope_sin, kc, vc, wo, pos0, eps, n_heads, pos, rotary_dim,
                          gated, splits, positions_per_step, flat=False)
    part = run(attend)[0]
    return _merge(part, qkv, kc, wo, n_heads, gated, attend, prefetch)


def _attend_spec(qkv, q_norm, k_norm, rope_cos, rope_sin, kc, vc, wo, pos0, eps, n_heads, pos, rotary_dim, gated,
                 splits, positions_per_step, *, flat: bool) -> LaunchSpec:
    """attend_split's launch; flat: its blocks in one row, the chained body (one token: a chain's
    phase, qkv may be a `phases.Pending`)."""
    splits = SPLITS if splits is None else splits
    positions_per_step = POSITIONS_PER_STEP if positions_per_step is None else positions_per_step
    t = qkv.shape[0]
    kvh, s_max, hd = kc.shape
    rd = attend_project.check_step("attend_split", qkv, q_norm, k_norm, rope_cos, kc, vc, wo, n_heads, pos,
                                   rotary_dim, gated, bad=splits < 1 or positions_per_step < 1 or (flat and t != 1),
                                   detail=f", {splits} splits, {positions_per_step} rows a step")
    qkn = q_norm is not None
    half = absent(np.float16)
    hpb = heads_per_block(n_heads, kvh, hd)
    params = index_param(pos0) if pos is None else pos
    blocks = (n_heads // hpb * splits, 1, 1) if flat else (n_heads // hpb, splits, t)
    inputs = (qkv, q_norm if qkn else half, k_norm if qkn else half, rope_cos, rope_sin, params, float_params(eps),
              kc, vc)
    return LaunchSpec(CHAINED_SOURCE if flat else ATTEND_SOURCE, inputs, ((t, n_heads * splits * (hd + 2)),),
                      (mx.float32,), blocks, THREADS,
                      (("H", n_heads), ("KVH", kvh), ("HD", hd), ("S_MAX", s_max), ("QKN", int(qkn)),
                       ("RD", rd), ("GATE", int(gated)), ("NT", THREADS), ("KV16", int(kc.dtype == mx.float16)),
                       ("NS", splits), ("HPB", hpb), ("PB", positions_per_step), ("NEWMAX", NEW_PER_ROUND),
                       ("FLAT", int(flat)), ("TR", int(spreads()))))


def _merge(part, qkv, kc: mx.array, wo: mx.array, n_heads: int, gated: bool, attend: LaunchSpec,
           prefetch: int | None, spec: bool = False):
    return merge_project.merge_project(part, qkv, wo, n_heads=n_heads, n_kv_heads=kc.shape[0], head_dim=kc.shape[2],
                                       splits=dict(attend.template)["NS"], gated=gated,
                                       prefetch=attend_project.PREFETCH if prefetch is None else prefetch, spec=spec)


# The QKV GEMV, this attention, its merge in W_o's blocks and the router as one launch past
# SPLIT_FROM (phases.chain_all), as kernels/attend_project.py chains them at a short context: 3
# launches a layer fewer (290 -> 146 a token at the seed shape), the same bits. Why: at context
# 2048 the H200 spent 2.9-3.5 ms a decoded token against 2.3-2.5 at 8 (docs/perf.md), the
# layer's float32 keys and values 8.4 MB (2.5 us at copy speed, 0.12 ms a token): the rest of the
# difference was taken for the host's work for the 144 launches more, as at 8 before its chain. The attention blocks wait for their KV group's QKV
# rows (the walk by group, where it applies) after their cached rows' first loads are asked for;
# the merge blocks for every attention block after loading their W_o rows; the router's for the
# merge's partials, which it adds (H of them) as in the two launches' form. Predicted: decode at
# 2048 within ~0.1-0.3 ms a token of decode at 8 (the bytes' and the attention's own difference).
# Measured on the H200 before SPREAD: no gain end to end (the GPU spent what the host saved: back
# to back 3.088 ms a token against 2.885 for the six launches a layer). With SPREAD (its loop ~2.5x
# shorter) ncu by graph gave 3232 us a token against 3692 for the six launches, back to back 2.81
# ms against 2.76 (ncu by graph, context 2048), with half the launches (146) for the host: on.


def _rows_first(body: str) -> tuple[str, int]:
    """(the body with q's row loaded after the first cached rows are asked for, the offset of that
    load): a chained block waits there for the QKV rows while its cached rows arrive. The loads'
    order only: the same bits."""
    start = body.index("  if (qwarp) {\n    const DEVICE float* src")
    end = body.index("\n  }\n", start) + len("\n  }\n")
    load_q, rest = body[start:end], body[:start] + body[end:]
    at = rest.index("  if (qwarp) {  // attend's code")
    return rest[:at] + load_q + rest[at:], at


CHAINED_BODY, WAIT_AT = _rows_first(BODY)
CHAINED_SOURCE = KernelSource("strata_attend_split_chained", ATTEND_SOURCE.inputs, ATTEND_SOURCE.outputs,
                              CHAINED_BODY, HELPERS, metal=False)


def chains_router(t: int, n_pos: int, wo: mx.array) -> bool:
    """Whether the QKV GEMV, the split attention, its merge and the router (no guess) run as one
    launch here (one token past SPLIT_FROM, CUDA or the emulator)."""
    return (t == 1 and attn.split_applies(n_pos, t) and applies(wo) and phases.available())


def qkv_split_route(wqkv: mx.array, x: mx.array, norm_w: mx.array, bias: mx.array | None, q_norm: mx.array | None,
                    k_norm: mx.array | None, rope_cos: mx.array, rope_sin: mx.array, kc: mx.array, vc: mx.array,
                    wo: mx.array, ffn_norm: mx.array, w_router: mx.array, pos0: int, eps: float, n_heads: int, *,
                    pos: mx.array | None = None, rotary_dim: int | None = None, gated: bool = False,
                    hand_on: bool = False):
    """`dense_gemv(wqkv, x, norm_w, eps, bias)`, `attend_split_project` of it and
    `router.router(x, its partials, ffn_norm, w_router)` (no guess) as one launch, where
    `chains_router`. hand_on: h and z as `Region`s of the launch's folded buffer (`attend_project.routed_chain`).

    Shapes:
        x float32 [1, D], w_router float32 [E, D] -> (x_mid [1, D], h [1, D], z float32 [1, E])
    """
    by_group = attend_project.walks_by_group(wqkv, kc, n_heads, gated)
    gemv = attend_project.qkv_spec(wqkv, x, norm_w, bias, kc, eps, n_heads, gated)
    qkv = phases.Pending(gemv.output_shapes[0], mx.float32)
    attend = _attend_spec(qkv, q_norm, k_norm, rope_cos, rope_sin, kc, vc, wo, pos0, eps, n_heads, pos, rotary_dim,
                          gated, None, None, flat=True)
    part = phases.Pending(attend.output_shapes[0], mx.float32)
    merge = _merge(part, qkv, kc, wo, n_heads, gated, attend,
                   attend_project.GROUP_PREFETCH if by_group else attend_project.CHAIN_PREFETCH, spec=True)
    route = router_kernel.router(x, phases.Pending(merge.output_shapes[0], mx.float32), ffn_norm, w_router, None,
                                 None, eps, threads=attend_project.THREADS, row_loads=attend_project.ROUTE_ROW_LOADS,
                                 spec=True)
    specs = [gemv, attend, merge, route]
    links = [{}, {"qkv": (0, 0)}, {"part": (1, 0), "qkv": (0, 0)}, {"parts": (2, 0)}]
    waits = [0, WAIT_AT, merge_project.WAIT_AT, router_kernel.WAIT_AT]
    # where the QKV walk goes by KV group, an attention block waits for its own group's count (the body's kvh)
    extra = dict(custom_waits=(None, qkv_groups.attend_wait("kvh")), extra=kc.shape[0]) if by_group else {}
    return attend_project.routed_chain(specs, links, waits, key=wo, hand_on=hand_on, **extra)
