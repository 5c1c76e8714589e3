"""Latent attention's decode step (T = 1) in the absorbed form, in three launches
(strata.reference.mla is the definition).

A decoded MLA layer is: the a-projections (kernels/dense_gemv.py: the layer's RMSNorm, W_qa and
W_kva stacked in one GEMV), the q up-projection (dense_gemv again, with q_a_norm), these three
kernels, and the output projection (dense_gemv). The kernels never expand a cached position into
per-head keys and values: W_uk is folded into the query and W_uv applied after the softmax, so
attention runs over the cached (c + r)-wide rows themselves (the absorbed form; docs/mlx_backend.md
gives the bytes and flops at DeepSeek-V3's shape).

1. `mla_query`, block h < H: the head's absorbed query q_lat = W_uk,h^T q_nope [c] (W_uk,h [n, c]
   read as 16-byte groups of 8 columns, the n rows split over NT / (c / 8) row groups, their sums
   merged in threadgroup memory in a fixed order) and its roped q_rope [r], both times the softmax
   scale -> qcat[h] = [q_lat; q_rope] [c + r]. Block H: the new position's latent, RMS-normed with
   kv_a_norm, and its roped rope key, written in place into the cache row `pos` (a cast away from
   const, as kernels/attention.py writes its KV cache: a separate update op would cost a launch,
   and a copy of the whole cache whenever anything aliases it).
2. `mla_attend`, block (g, j): heads g HPB .. g HPB + HPB - 1 (a warp each) over split j of the
   positions 0..pos (NS splits of ceil((pos + 1) / NS) positions: flash decoding). Each lane holds
   the elements lane + 32 i of its head's qcat row and of each cached row it reads; a position's
   score is one warp sum, then an online softmax accumulates the latent part of the row. The
   block's warps read the same rows (one fetch from L2 serves HPB heads). Out: per (split, head)
   the running max, the sum and the unnormalised latent accumulator (not written for an empty
   split: a short context under the compiled step's fixed NS moves 8 bytes per empty split).
3. `mla_output`, block h: the NS splits merged in a fixed order (no atomics: deterministic) into
   the head's attended latent o_lat [c] in threadgroup memory, then out_h = W_uv,h o_lat [v]: a
   warp per row of W_uv,h, a lane per 16-byte group.

Shapes:
    mla_query:  q float32 [1, H (n + r)] (raw, after the q up-projection), kva float32 [1, c + r]
                (raw latent | rope key), w_uk float16 [H, n, c], kv_norm float16 [c],
                rope_cos / rope_sin float32 [S_MAX, r / 2], cache float32 [S_MAX, c + r]
                -> qcat float32 [H, c + r]; writes cache row pos
    mla_attend: qcat, cache -> part float32 [NS, H, c + 2] (accumulator [c], max, sum)
    mla_output: part, w_uv float16 [H, v, c] -> out float32 [1, H v]
"""

from __future__ import annotations

import mlx.core as mx

from strata.mlx_backend.kernels.launch import float_params, index_param, launch
from strata.mlx_backend.kernels.preludes import WARP
from strata.mlx_backend.kernels.source import KernelSource

# the query and output kernels: a block per head, one per SM at 128 heads, so a block's own loads
# in flight are what HBM sees (512 threads x 4 rows x 16 bytes: 32 KB a block)
THREADS = 512
HEADS_PER_BLOCK = 8  # mla_attend: a warp per head; 8 heads share each row fetched into L1
MAX_SPLITS = 16  # flash-decoding splits (the partials: 2 x 4 NS H (c + 2) bytes, 8.4 MB at NS = 16, H = 128)
# a split's positions are one warp's sequential steps: on the H200 NS = 2 at 512 positions (256
# a warp) took 111 us a step, latency-bound; from ~8192 positions NS = 4..32 all ran 266-296 us,
# issue-bound. Every step takes MAX_SPLITS (each NS is a compile of its own on MLX's CUDA build;
# an empty split moves 8 bytes, a used one its H (c + 2) floats of partials)
POSITIONS_PER_STEP = 4  # PB: a warp's cached rows in flight at once (4 x 18 floats a lane at c + r = 576)
HEADS_PER_WARP = 1  # HPW: heads a warp scores with each row it loads (2 halves the row loads, doubles q and acc)
# VW: floats a lane loads at once from a cached row: 4 (16-byte loads, a quarter of the load
# instructions; rows of c + r % 4 == 0 floats only) or 1 (lane + 32 i). H200, DeepSeek-V3's heads,
# PB 4, HPW 1: VW 4 took 92.8 / 170.1 / 289.8 / 767.0 us a step at 512 / 2048 / 8192 / 32768
# positions against VW 1's 128.3 / 169.4 / 295.9 / 872.3 (no other variant was at or below VW 1
# at every length: benchmarks/mla.py --variants, docs/perf.md)
VECTOR_WIDTH = 4
ROWS_PER_STEP = 4  # RB: weight rows whose loads a query / output thread issues together
MAX_LATENT = 2048  # c: a query block's 8-column groups fit its threads (and RG x c floats its 32 KB)
MAX_ROW = 32 * 32  # c + r: a lane holds at most 32 of a row's elements in registers

QUERY_BODY = r"""
  constexpr int QW = N + R;            // a head's raw query: nope dims, then rope dims
  constexpr int CR = C + R;            // a cached row: latent, then rope key
  constexpr int RH = R / 2;            // rotate-half pairs (i, i + RH)
  constexpr int CG = C / 8;            // 16-byte groups of 8 columns of W_uk,h
  constexpr int RG = NT / CG;          // row groups: thread (rg, g) sums rows rg, rg + RG, ...
  constexpr int NW = NT / 32;
  const uint32_t h = bx;
  const int32_t pos = params[0];
  const float eps = fparams[0];
  const float scale = fparams[1];
  SHARED float qn[N];
  SHARED float part[RG * C];
  SHARED float red[NW];
  const uint64_t rp = (uint64_t)pos * RH;
  if (h < (uint32_t)H) {               // block-uniform: the barriers below are the whole block's
    const DEVICE float* src = q + (uint64_t)h * QW;
    DEVICE float* dst = qcat + (uint64_t)h * CR;
    for (uint32_t i = tid; i < (uint32_t)N; i += NT) qn[i] = src[i];
    for (uint32_t i = tid; i < (uint32_t)RH; i += NT) {
      const float a = src[N + i], b = src[N + i + RH];
      const float cs = rope_cos[rp + i], sn = rope_sin[rp + i];
      dst[C + i] = (a * cs - b * sn) * scale;
      dst[C + i + RH] = (b * cs + a * sn) * scale;
    }
    BARRIER();
    const uint32_t g = tid % CG, rg = tid / CG;
    const bool act = rg < (uint32_t)RG;  // threads past RG x CG idle (c / 8 not dividing NT)
    constexpr int KI = (N + RG - 1) / RG;  // rows a row group sums: the same trip count for every thread
    float acc[8];
    UNROLL for (int j = 0; j < 8; ++j) acc[j] = 0.0f;
    const DEVICE half_t* wp = w_uk + (uint64_t)h * N * C + 8 * (act ? g : 0);
    for (int k0 = 0; k0 < KI; k0 += RB) {  // RB rows a step: their loads in flight together
      f8 w[RB];
      UNROLL for (int b = 0; b < RB; ++b) {
        const int i = (int)rg + RG * (k0 + b);
        if (act && i < N) w[b] = load_h8(wp + (uint64_t)i * C);
        else UNROLL for (int q = 0; q < 8; ++q) w[b].v[q] = 0.0f;
      }
      warp_sync();  // every load above issued before the FMAs below (uniform control flow here)
      UNROLL for (int b = 0; b < RB; ++b) {
        const int i = (int)rg + RG * (k0 + b);
        const float qi = act && i < N ? qn[i] : 0.0f;
        UNROLL for (int j = 0; j < 8; ++j) acc[j] += w[b].v[j] * qi;
      }
    }
    if (act) UNROLL for (int j = 0; j < 8; ++j) part[rg * C + 8 * g + j] = acc[j];
    BARRIER();
    for (uint32_t e = tid; e < (uint32_t)C; e += NT) {  // the row groups in a fixed order
      float s = 0.0f;
      for (int k = 0; k < RG; ++k) s += part[k * C + e];
      dst[e] = s * scale;
    }
  } else {                             // the new position's cache row
    float ss = 0.0f;
    for (uint32_t i = tid; i < (uint32_t)C; i += NT) ss += kva[i] * kva[i];
    ss = warp_sum(ss);
    if (lane == 0) red[warp_id] = ss;
    BARRIER();
    float tot = 0.0f;
    for (int w = 0; w < NW; ++w) tot += red[w];
    const float inv = 1.0f / sqrt_f(tot / (float)C + eps);
    DEVICE float* row = (DEVICE float*)cache + (uint64_t)pos * CR;
    for (uint32_t i = tid; i < (uint32_t)C; i += NT) row[i] = kva[i] * inv * F32(kv_norm[i]);
    for (uint32_t i = tid; i < (uint32_t)RH; i += NT) {
      const float a = kva[C + i], b = kva[C + i + RH];
      const float cs = rope_cos[rp + i], sn = rope_sin[rp + i];
      row[C + i] = a * cs - b * sn;
      row[C + i + RH] = b * cs + a * sn;
    }
  }
"""

ATTEND_BODY = r"""
  constexpr int CR = C + R;
  constexpr int GPL = (CR + 32 * VW - 1) / (32 * VW);  // a row's loads per lane: VW floats each
  constexpr int EPL = GPL * VW;        // a row's elements per lane: i -> VW (lane + 32 (i / VW)) + i % VW
  constexpr int LPL = ((C + 32 * VW - 1) / (32 * VW)) * VW;  // ... of them in the latent part
  const uint32_t h0 = bx * HPB + warp_id * HPW;      // this warp's first head; it runs HPW heads
  const int32_t j = (int32_t)by;
  const int32_t n_pos = params[0] + 1;               // causal: positions 0 .. pos
  const int32_t chunk = (n_pos + NS - 1) / NS;
  const int32_t lo = j * chunk;
  const int32_t hi = lo + chunk < n_pos ? lo + chunk : n_pos;
  float qr[HPW][EPL], acc[HPW][LPL], m[HPW], l[HPW];
  UNROLL for (int u = 0; u < HPW; ++u) {
    UNROLL for (int i = 0; i < EPL; ++i) {
      const int e = VW * ((int)lane + 32 * (i / VW)) + i % VW;
      qr[u][i] = e < CR ? qcat[(uint64_t)(h0 + u) * CR + e] : 0.0f;
    }
    UNROLL for (int i = 0; i < LPL; ++i) acc[u][i] = 0.0f;
    m[u] = NEG_BIG;
    l[u] = 0.0f;
  }
  for (int32_t p0 = lo; p0 < hi; p0 += PB) {  // PB positions a step: their loads in flight together
    float kr[PB][EPL];
    UNROLL for (int b = 0; b < PB; ++b) {
      const int32_t p = p0 + b < hi ? p0 + b : hi - 1;  // past the split: reread its last row, weight 0
      const DEVICE float* row = cache + (uint64_t)p * CR;
      UNROLL for (int k = 0; k < GPL; ++k) {  // VW = 4: 16-byte loads (CR % 4 == 0: rows stay aligned)
        const int e = VW * ((int)lane + 32 * k);
        f4 g;
        if (e < CR) {
          if (VW == 4) g = load_f4(row + e);
          else g.v[0] = row[e];
        } else UNROLL for (int q = 0; q < 4; ++q) g.v[q] = 0.0f;
        UNROLL for (int q = 0; q < VW; ++q) kr[b][VW * k + q] = g.v[q];
      }
    }
    UNROLL for (int u = 0; u < HPW; ++u) {  // each row loaded once serves the warp's HPW heads
      float sc[PB];
      float mn = m[u];
      UNROLL for (int b = 0; b < PB; ++b) {
        float dot = 0.0f;
        UNROLL for (int i = 0; i < EPL; ++i) dot += qr[u][i] * kr[b][i];
        sc[b] = p0 + b < hi ? warp_sum(dot) : NEG_BIG;
        mn = sc[b] > mn ? sc[b] : mn;
      }
      const float corr = exp_f(m[u] - mn);
      float pe[PB];
      l[u] *= corr;
      UNROLL for (int b = 0; b < PB; ++b) { pe[b] = exp_f(sc[b] - mn); l[u] += pe[b]; }
      UNROLL for (int i = 0; i < LPL; ++i) {
        const int e = VW * ((int)lane + 32 * (i / VW)) + i % VW;
        float a = acc[u][i] * corr;
        UNROLL for (int b = 0; b < PB; ++b) a += e < C ? pe[b] * kr[b][i] : 0.0f;
        acc[u][i] = a;
      }
      m[u] = mn;
    }
  }
  UNROLL for (int u = 0; u < HPW; ++u) {  // an empty split writes its max and sum only: the merge skips it
    DEVICE float* dst = part + ((uint64_t)j * H + h0 + u) * (C + 2);
    if (hi > lo) UNROLL for (int i = 0; i < LPL; ++i) {
      const int e = VW * ((int)lane + 32 * (i / VW)) + i % VW;
      if (e < C) dst[e] = acc[u][i];
    }
    if (lane == 0) { dst[C] = m[u]; dst[C + 1] = l[u]; }
  }
"""

OUTPUT_BODY = r"""
  constexpr int CG = C / 8;
  constexpr int NW = NT / 32;
  const uint32_t h = bx;
  SHARED float ol[C];
  SHARED float wsplit[NS];
  SHARED float total[1];
  if (tid == 0) {                      // the splits' weights, in a fixed order
    float mm = NEG_BIG;
    for (int j = 0; j < NS; ++j) { const float mj = part[((uint64_t)j * H + h) * (C + 2) + C]; mm = mj > mm ? mj : mm; }
    float ll = 0.0f;
    for (int j = 0; j < NS; ++j) {
      const DEVICE float* pj = part + ((uint64_t)j * H + h) * (C + 2);
      const float f = exp_f(pj[C] - mm);
      wsplit[j] = f;
      ll += pj[C + 1] * f;
    }
    total[0] = ll;
  }
  BARRIER();
  const float inv = 1.0f / total[0];
  for (uint32_t e = tid; e < (uint32_t)C; e += NT) {
    float a = 0.0f;
    for (int j = 0; j < NS; ++j)  // weight 0: an empty split (its accumulator unwritten) or one underflowed
      if (wsplit[j] > 0.0f) a += part[((uint64_t)j * H + h) * (C + 2) + e] * wsplit[j];
    ol[e] = a * inv;
  }
  BARRIER();
  constexpr int GPL = (CG + 31) / 32;   // a row's 16-byte groups per lane
  const DEVICE half_t* wh = w_uv + (uint64_t)h * V * C;
  for (uint32_t r0 = warp_id * RB; r0 < (uint32_t)V; r0 += NW * RB) {  // out_h = W_uv,h o_lat, RB rows a step
    f8 w[RB][GPL];
    UNROLL for (int b = 0; b < RB; ++b) {
      UNROLL for (int k = 0; k < GPL; ++k) {
        const uint32_t row = r0 + b, g = lane + 32 * k;
        if (row < (uint32_t)V && g < (uint32_t)CG) w[b][k] = load_h8(wh + (uint64_t)row * C + 8 * g);
        else UNROLL for (int q = 0; q < 8; ++q) w[b][k].v[q] = 0.0f;
      }
    }
    warp_sync();  // every load above issued before the FMAs below (ptxas would interleave them)
    UNROLL for (int b = 0; b < RB; ++b) {
      float dot = 0.0f;
      UNROLL for (int k = 0; k < GPL; ++k) {
        const uint32_t g = lane + 32 * k;
        if (g < (uint32_t)CG) UNROLL for (int q = 0; q < 8; ++q) dot += w[b][k].v[q] * ol[8 * g + q];
      }
      dot = warp_sum(dot);
      if (lane == 0 && r0 + b < (uint32_t)V) out[(uint64_t)h * V + r0 + b] = dot;
    }
  }
"""

QUERY_SOURCE = KernelSource("strata_mla_query", ("q", "kva", "w_uk", "kv_norm", "rope_cos", "rope_sin", "params",
                                                 "fparams", "cache"), ("qcat",), QUERY_BODY)
ATTEND_SOURCE = KernelSource("strata_mla_attend", ("qcat", "cache", "params"), ("part",), ATTEND_BODY)
OUTPUT_SOURCE = KernelSource("strata_mla_output", ("part", "w_uv"), ("out",), OUTPUT_BODY)


def fits(kv_lora_rank: int, qk_rope_head_dim: int) -> bool:
    """Whether the kernels take a latent of this width (c a multiple of 8 whose groups fit a
    block; a cached row of at most MAX_ROW floats)."""
    c, r = kv_lora_rank, qk_rope_head_dim
    return c > 0 and c % 8 == 0 and c <= MAX_LATENT and c + r <= MAX_ROW and r % 2 == 0


def heads_per_block(n_heads: int) -> int:
    """The largest of 8, 4, 2, 1 that divides the head count (a warp per head)."""
    hpb = HEADS_PER_BLOCK
    while n_heads % hpb:
        hpb //= 2
    return hpb


def mla_decode(q: mx.array, kva: mx.array, w_uk: mx.array, w_uv: mx.array, kv_norm: mx.array, rope_cos: mx.array,
               rope_sin: mx.array, cache: mx.array, pos: int, *, eps: float, scale: float,
               pos_param: mx.array | None = None, splits: int | None = None,
               positions_per_step: int = POSITIONS_PER_STEP, heads_per_warp: int = HEADS_PER_WARP,
               vector_width: int = VECTOR_WIDTH) -> mx.array:
    """Kernel path: one decoded position's latent attention (module doc), its cache row written
    in place. scale: the softmax scale (folded into the query). pos_param: pos on the device
    (int32, element 0; `launch.index_param`), read in place of `pos`. splits: NS (None: MAX_SPLITS at
    every length, as the compiled step traces it: each NS is an NVRTC compile of its own on MLX's
    CUDA build, 1-3 s, which an uncompiled session (streaming) met again at 33, 65, 129 and 257 positions; an
    empty split moves 8 bytes). positions_per_step: PB, heads_per_warp: HPW (a divisor of the
    block's heads), vector_width: VW (4 where c + r is a multiple of 4, else 1); benchmarks
    compare others.

    Shapes:
        q float32 [1, H (n + r)], kva float32 [1, c + r], w_uk float16 [H, n, c], w_uv float16 [H, v, c],
        kv_norm float16 [c], rope_cos / rope_sin float32 [S_MAX, r / 2], cache float32 [S_MAX, c + r]
        -> out float32 [1, H v]
    """
    h, n, c = w_uk.shape
    v = w_uv.shape[1]
    s_max, cr = cache.shape
    r = cr - c
    if (not fits(c, r) or w_uv.shape != (h, v, c) or q.shape != (1, h * (n + r)) or kva.shape != (1, cr)
            or rope_cos.shape[-1] != r // 2 or kv_norm.shape != (c,)):
        raise ValueError(f"mla kernel: latent {c} (a multiple of 8, <= {MAX_LATENT}), rope dims {r} (even; row "
                         f"<= {MAX_ROW}), q {q.shape}, kva {kva.shape}, W_uk {w_uk.shape}, W_uv {w_uv.shape}, "
                         f"rope table of {rope_cos.shape[-1]} pairs do not agree")
    if not 0 <= pos < s_max:
        raise ValueError(f"mla kernel: position {pos} outside the cache's {s_max} rows")
    ns = MAX_SPLITS if splits is None else splits
    hpb = heads_per_block(h)
    hpw = heads_per_warp if hpb % heads_per_warp == 0 else 1
    vw = vector_width if vector_width == 1 or cr % vector_width == 0 else 1
    p = index_param(pos) if pos_param is None else pos_param
    qcat = launch(QUERY_SOURCE, [q, kva, w_uk, kv_norm, rope_cos, rope_sin, p, float_params(eps, scale), cache],
                  [(h, cr)], [mx.float32], blocks=(h + 1, 1, 1), threads=THREADS,
                  template=(("H", h), ("N", n), ("C", c), ("R", r), ("RB", ROWS_PER_STEP), ("NT", THREADS)))[0]
    part = launch(ATTEND_SOURCE, [qcat, cache, p], [(ns, h, c + 2)], [mx.float32], blocks=(h // hpb, ns, 1),
                  threads=WARP * (hpb // hpw), template=(("H", h), ("C", c), ("R", r), ("HPB", hpb), ("HPW", hpw),
                                                        ("NS", ns), ("PB", positions_per_step), ("VW", vw)))[0]
    return launch(OUTPUT_SOURCE, [part, w_uv], [(1, h * v)], [mx.float32], blocks=(h, 1, 1), threads=THREADS,
                  template=(("H", h), ("C", c), ("V", v), ("NS", ns), ("RB", ROWS_PER_STEP), ("NT", THREADS)))[0]


def absorbed_bytes(n_heads: int, c: int, r: int, n: int, v: int, positions: int, splits: int) -> dict:
    """HBM bytes of one absorbed decode step's three kernels: W_uk and W_uv (float16), the cached
    rows read (float32), the partials written and read back, the query row and the output."""
    weights = 2 * n_heads * c * (n + v)
    cache = 4 * positions * (c + r)
    chunk = -(-positions // splits)
    used = -(-positions // chunk)  # splits with positions (the others write 8 bytes, read back)
    partials = 2 * 4 * n_heads * (used * (c + 2) + (splits - used) * 2)
    return {"weights": weights, "cache": cache, "partials": partials,
            "total": weights + cache + partials + 4 * n_heads * (n + r + 2 * (c + r) + v)}


def absorbed_flops(n_heads: int, c: int, r: int, n: int, v: int, positions: int) -> int:
    """Multiply-adds x 2 of one absorbed decode step: q_lat and out (H c (n + v)), the scores and
    the latent accumulation (H S (2 c + r))."""
    return 2 * (n_heads * c * (n + v) + n_heads * positions * (2 * c + r))



