"""A decoded token's down step with a warp per selected expert: the second of moe_decode.py's two
launches, without the block-wide staging of h.

moe_decode.py's DOWN gives a warp one output row and all k experts' (expert, word) pairs, so each
of its 320 blocks (seed shape) first copies every selected expert's h (k F floats: 23 KB from L2)
into threadgroup memory, pre-scaled per code (30 KB written), behind a barrier; ncu on the H200:
9.7 us for 4.7 MB of records, L1/TEX 67% busy (the staging and its reads), DRAM 10%, 11 cycles
between a warp's instructions. Here:

- block (RB rows, token) has k warps, warp i the i-th selected expert: lane (row, part) takes the
  row's words part + LPR j (LPR = 32 / RB lanes a row; RB = 8: 4 lanes, 9 words each at F = 576),
  issuing every code and scale load before any arithmetic;
- h comes as the gate/up launch writes it for this step (`GateUp.hpre`: pre-scaled per code;
  `GateUp.hws`: each word's plain sum), read where it is (L1 after a block of the SM first reads
  it): no threadgroup copy, no barrier before the arithmetic;
- the row's parts are summed by xor shuffles, the k experts' rows (times their weights) and the
  shared expert's partials (times its gate) by one thread a row in a fixed order after one barrier.

Predicted at the seed shape (320 blocks of 320 threads, 2.4 an SM, ~40 registers): the 4.7 MB at
~3 TB/s (1.5 us) behind one DRAM round trip after the slots' L2 load, 1.0M warp instructions of
code arithmetic as before (~2 us of issue at the H200's 528 a cycle): ~4-5 us against 9.7.

Shapes:
    arena uint8 [S, SLOT], x_mid float32 [T, D], hpre float32 [T, K, F], hws float32 [T, K, F/16],
    sel int32 [T, K], wsel float32 [T, K], sout float32 [T, NSB, D], gate float32 [T, 8]
    -> out float32 [T, D]
"""

from __future__ import annotations

import mlx.core as mx
import numpy as np

from strata.formats.expert_record import RecordLayout
from strata.mlx_backend.kernels import moe
from strata.mlx_backend.kernels.launch import absent, as_f32
from strata.mlx_backend.kernels.phases import LaunchSpec, run
from strata.mlx_backend.kernels.preludes import WARP
from strata.mlx_backend.kernels.source import KernelSource

ROWS = 8  # output rows a block: 320 blocks at D = 2560 (2.4 an H200 SM), 4 lanes a row
MAX_K = 32  # a warp an expert: at most 1024 threads a block
# A lane's codes as single words (8-byte loads of a Q2_0 block's two words did not beat them on
# the H200: docs/perf.md)

BODY = r"""
  constexpr int WF = F / 16;                  // words of one expert's down row
  constexpr int LPR = 32 / RB;                // lanes a row
  constexpr int WPN = (WF + LPR - 1) / LPR;   // words a lane
  constexpr int SPW = NSB > 0 ? (NSB + K - 1) / K : 1;  // shared partials a warp's row thread adds
  SHARED float part_r[K * RB];                // warp i's rows, times w_i
  SHARED float part_s[K * RB];                // the shared partials' sums, by warp
  const uint32_t t = by, i = warp_id;
  const uint32_t row = lane % (uint32_t)RB, piece = lane / (uint32_t)RB;
  const uint32_t d = bx * RB + row;           // D % RB == 0 (`applies`)
  const DEVICE uint8_t* rec = arena + (uint64_t)sel[t * K + i] * (uint64_t)SLOT;
  // every load first: the row's codes and scales, this lane's shared partials
  uint32_t q[WPN];
  half_t sc[WPN];
  const DEVICE uint32_t* qrow = (const DEVICE uint32_t*)(rec + DC + (uint64_t)d * (F / 4));
  const DEVICE half_t* srow = (const DEVICE half_t*)(rec + DS) + (uint64_t)d * (F / 32);
  UNROLL for (int j = 0; j < WPN; ++j) {
    const int w = (int)piece + LPR * j;
    const int wc = w < WF ? w : WF - 1;       // past the row: its last word again (unused; no branch)
    q[j] = qrow[wc];
    sc[j] = srow[wc >> 1];
  }
  float sp[SPW];
  UNROLL for (int j = 0; j < SPW; ++j) {
    const int s = (int)i + K * j;
    sp[j] = (NSB > 0 && piece == 0u && s < NSB) ? sout[((uint64_t)t * NSB + s) * D + d] : 0.0f;
  }
  const DEVICE float* hp = hpre + ((uint64_t)t * K + i) * F;
  const DEVICE float* hs = hws + ((uint64_t)t * K + i) * WF;
  float acc = 0.0f;
  UNROLL for (int j = 0; j < WPN; ++j) {
    const int w = (int)piece + LPR * j;
    if (w < WF) {
      float hv[16];
      UNROLL for (int v = 0; v < 16; v += 4) {
        const f4 h4 = load_f4(hp + 16 * w + v);
        UNROLL for (int u = 0; u < 4; ++u) hv[v + u] = h4.v[u];
      }
      float dd = 0.0f;
      if (DN) {
        const uint32_t qh = q[j] >> 22;
        UNROLL for (int c = 0; c < 16; ++c) dd = fma_keep(q2_dn(c <= 10 ? q[j] : qh, q2_shift(c)), hv[c], dd);
        acc += F32(sc[j]) * fma_keep(dd, TWO64, -2.0f * hs[w]);
      } else {
        const uint32_t ql = q2_lo(q[j]), qh = q2_hi(q[j]);
        UNROLL for (int c = 0; c < 16; ++c) dd += q2_code(ql, qh, c) * hv[c];
        acc += F32(sc[j]) * (dd - 2.0f * hs[w]);
      }
    }
  }
  UNROLL for (int m = RB; m < 32; m <<= 1) acc += shfl_xor_f(acc, (uint32_t)m);  // the row's pieces
  if (piece == 0u) {
    float ss = 0.0f;
    UNROLL for (int j = 0; j < SPW; ++j) ss += sp[j];
    part_r[i * RB + row] = wsel[t * K + i] * acc;
    part_s[i * RB + row] = ss;
  }
  BARRIER();
  if (tid < (uint32_t)RB) {                   // the row's sum over experts, in rank order
    float r = 0.0f, s = 0.0f;
    for (int e = 0; e < K; ++e) { r += part_r[e * RB + tid]; s += part_s[e * RB + tid]; }
    const float sg = GATED ? gate_val[t * 8] : 1.0f;
    const uint64_t o = (uint64_t)t * D + bx * RB + tid;
    out[o] = x_mid[o] + (r + (NSB > 0 ? s * sg : 0.0f));
  }
"""

SOURCE = KernelSource("strata_moe_down_warps", ("arena", "x_mid", "hpre", "hws", "sel", "wsel", "sout", "gate_val"),
                      ("out",), BODY, moe.HELPERS)


def applies(rec: RecordLayout, k: int, rows: int = ROWS) -> bool:
    """Whether this down step takes the records: moe_decode's (Q2_0, no biases, F a multiple of
    32), k warps a block (k <= MAX_K), D a multiple of the block's rows, rows a power of two
    dividing 32."""
    return (k <= MAX_K and rows in (1, 2, 4, 8, 16, 32) and rec.hidden % rows == 0 and rec.expert_ffn % 32 == 0
            and rec.hidden % 16 == 0)


def down(arena: mx.array, rec: RecordLayout, x_mid: mx.array, hpre: mx.array, hws: mx.array, sel: mx.array,
         wsel: mx.array, sout: mx.array | None = None, sgate: mx.array | None = None, *, rows: int = ROWS,
         denormals: bool | None = None) -> mx.array:
    """Kernel path: x_mid + (sum_i wsel_i down_i . h_i + sgate * sum of the shared partials), h as
    `moe_decode.GateUp` gives it (hpre, hws). sout None: no shared expert; sgate None: ungated.
    denormals: the code form hpre was scaled for (default moe.subnormal_codes()).

    Shapes:
        x_mid float32 [T, D], hpre float32 [T, k, F], hws float32 [T, k, F / 16], sel int32 [T, k],
        wsel float32 [T, k], sout float32 [T, NSB, D], sgate float32 [T, 8] -> float32 [T, D]
    """
    t, k, f = hpre.shape
    if not applies(rec, k, rows):
        raise ValueError(f"moe_down_warps: records {rec} with k={k} and {rows} rows a block do not fit (applies)")
    dn = moe.subnormal_codes() if denormals is None else denormals
    nsb = 0 if sout is None else sout.shape[1]
    none = absent(np.float32)
    template = (("D", rec.hidden), ("F", f), ("SLOT", rec.padded_bytes), ("DC", rec.codes("down").offset),
                ("DS", rec.scales("down").offset), ("K", k), ("RB", rows), ("DN", int(dn)), ("NSB", nsb),
                ("GATED", int(sgate is not None and nsb > 0)))
    # hpre .. sgate may be folded_outputs.Region of the gate/up launch's buffer (moe_decode.routed_residual)
    return run(LaunchSpec(SOURCE, (arena, as_f32(x_mid), hpre, hws, sel, wsel, none if sout is None else sout,
                                   none if sgate is None else sgate), ((t, rec.hidden),), (mx.float32,),
                          (rec.hidden // rows, t, 1), WARP * k, template))[0]
