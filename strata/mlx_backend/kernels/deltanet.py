"""The gated DeltaNet decode step (T = 1) after the input projection, in one launch
(strata.reference.deltanet is the definition).

A decoded DeltaNet layer is three launches, like attention: the input projection
(kernels/dense_gemv.py: the layer's RMSNorm and the four stacked projections qkv | z | beta |
alpha in one GEMV), `deltanet_step` (this file), and the output projection (dense_gemv again).

`deltanet_step`: block h runs v head h. Its threads first issue their loads of the head's
recurrent state S [dk, dv] (nothing they wait on comes before them, so the state's HBM latency
hides behind the conv phase). Then, in the block:
1. the causal depthwise conv over the head's channels (q and k of its k head h / r, v of h) from
   the conv state and this position's projection, SiLU; the new conv state is the old one shifted
   by one with this input appended (q/k channels written by the block h % r == 0, one writer per
   channel);
2. the l2 norms of q and k (q also scaled by dk^-1/2), beta = sigmoid(b), g = a softplus(alpha +
   dt_bias);
3. the gated delta rule column by column: thread (v, ks) holds rows ks*KR .. ks*KR + KR-1 of
   column v of S in registers; S <- exp(g) S; kv = S^T k (partial sums over the KS row slices
   merged in threadgroup memory in a fixed order); delta = (v - kv) beta; S <- S + k delta^T,
   written to s_out; o = S^T q (merged likewise). One read and one write of the state: each
   column is independent once its two dot products are known.
4. the gated RMSNorm of the head's o over dv, times silu(z) -> y (sigmoid(z) where SIGMOID_GATE:
   the released Qwen3.8-Flash-Next's output gate; a template constant, so one specialisation
   each).

Why a block per head: the gated RMSNorm needs all dv of a head's outputs, and a block boundary
there would cost a second launch. At Qwen3.5-397B's shape (64 v heads of dk = dv = 128) that is
64 blocks of 512 threads, each SM's block with its whole 64 KB of state in flight at once
(16 warps x 32 loads of 128 bytes): the state is read at once rather than at one SM's pace.
docs/mlx_backend.md gives the predicted cost.

Every sum is in a fixed order (no atomics): deterministic, and batch invariant.

Shapes:
    proj float32 [1, C + V + 2 Hv] (qkv | z | beta | alpha rows, C = 2 Hk dk + Hv dv, V = Hv dv),
    conv_in float32 [C, K-1], conv_w float16 [C, K], a / dt_bias float32 [Hv], norm_w float16 [dv],
    s_in float32 [Hv, dk, dv]
    -> y float32 [1, V], conv_out float32 [C, K-1], s_out float32 [Hv, dk, dv]
Grid: Hv blocks of NT = 32 ceil(KS dv / 32) threads, KS = ceil(dk / KR).
"""

from __future__ import annotations

import mlx.core as mx
import numpy as np

from strata.mlx_backend.kernels.launch import float_params, launch
from strata.mlx_backend.kernels.preludes import WARP
from strata.mlx_backend.kernels.source import KernelSource

ROWS_PER_THREAD = 32  # KR: state rows a thread holds in registers (dk = 128: 4 row slices)
MAX_THREADS = 1024  # a block's threads: KS * dv must fit (dv = 128 with dk <= 256)

BODY = r"""
  constexpr int R = HV / HK;                 // v heads per k head
  constexpr int QK = HK * DK;                // q channels (then as many k channels)
  constexpr int C = 2 * QK + HV * DV;        // conv channels
  constexpr int V = HV * DV;
  constexpr int KS = (DK + KR - 1) / KR;     // row slices of a column
  constexpr int ACTIVE = KS * DV;            // threads that own a (column, slice)
  constexpr int CH = 2 * DK + DV;            // this head's conv channels: q, k (of its k head), v
  constexpr int KM = KC - 1;                 // conv state width
  const uint32_t h = bx;
  const uint32_t hk = h / R;
  const float eps = fparams[0];
  const float l2eps = fparams[1];
  const float qscale = fparams[2];
  SHARED float qk[2 * DK];                   // conv output: q | k (before their norms)
  SHARED float vsh[DV];
  SHARED float osh[DV];
  SHARED float ra[KS * DV];                  // partial S^T k, then S^T q, by slice
  SHARED float rb[KS * DV];
  SHARED float nrm[4];
  const bool live = tid < (uint32_t)ACTIVE;
  const uint32_t v = tid % DV;
  const uint32_t ks = tid / DV;
  const uint64_t sbase = (uint64_t)h * DK * DV + v;
  // the state's loads first: nothing below them waits on them until step 3
  float s[KR];
  UNROLL for (int i = 0; i < KR; ++i) {
    const int k = (int)ks * KR + i;
    s[i] = live && k < DK ? s_in[sbase + (uint64_t)k * DV] : 0.0f;
  }
  // 1. conv + SiLU over this head's channels; the new conv state
  for (uint32_t i = tid; i < (uint32_t)CH; i += NT) {
    const uint32_t c = i < (uint32_t)DK ? hk * DK + i
                     : i < (uint32_t)(2 * DK) ? QK + hk * DK + (i - DK)
                     : 2 * QK + h * DV + (i - 2 * DK);
    const float xin = proj[c];
    float acc = 0.0f;
    UNROLL for (int j = 0; j < KM; ++j) acc += F32(conv_w[c * KC + j]) * conv_in[c * KM + j];
    acc += F32(conv_w[c * KC + KM]) * xin;
    const float mixed = acc / (1.0f + exp_f(-acc));
    if (i < (uint32_t)(2 * DK)) qk[i] = mixed; else vsh[i - 2 * DK] = mixed;
    if (i >= (uint32_t)(2 * DK) || h % R == 0) {  // one writer per channel
      UNROLL for (int j = 0; j + 1 < KM; ++j) conv_out[c * KM + j] = conv_in[c * KM + j + 1];
      conv_out[c * KM + KM - 1] = xin;
    }
  }
  BARRIER();
  // 2. l2 norms of q and k (warp 0, lanes in a fixed order); the head's gates
  if (warp_id == 0) {
    float sq = 0.0f, sk = 0.0f;
    for (uint32_t i = lane; i < (uint32_t)DK; i += 32) { sq += qk[i] * qk[i]; sk += qk[DK + i] * qk[DK + i]; }
    sq = warp_sum(sq);
    sk = warp_sum(sk);
    if (lane == 0) { nrm[0] = qscale / sqrt_f(sq + l2eps); nrm[1] = 1.0f / sqrt_f(sk + l2eps); }
  }
  const float beta = 1.0f / (1.0f + exp_f(-proj[C + V + h]));
  const float ax = proj[C + V + HV + h] + dt_bias[h];
  const float decay = exp_f(a[h] * (ax > SOFTPLUS_MAX ? ax : log1p_f(exp_f(ax))));
  BARRIER();
  const float qn = nrm[0], kn = nrm[1];
  // 3. the gated delta rule on column v, rows ks*KR ..
  float part = 0.0f;
  UNROLL for (int i = 0; i < KR; ++i) {
    const int k = (int)ks * KR + i;
    s[i] *= decay;
    if (k < DK) part += s[i] * (qk[DK + k] * kn);
  }
  if (live) ra[ks * DV + v] = part;
  BARRIER();
  float kv = 0.0f;
  for (int j = 0; j < KS; ++j) kv += ra[j * DV + v];
  const float delta = (vsh[v] - kv) * beta;
  float po = 0.0f;
  UNROLL for (int i = 0; i < KR; ++i) {
    const int k = (int)ks * KR + i;
    if (live && k < DK) {
      s[i] += (qk[DK + k] * kn) * delta;
      s_out[sbase + (uint64_t)k * DV] = s[i];
      po += s[i] * (qk[k] * qn);
    }
  }
  if (live) rb[ks * DV + v] = po;
  BARRIER();
  // 4. o, its RMSNorm over the head (warp 0), times the norm weight and silu(z) (sigmoid(z))
  float o = 0.0f;
  for (int j = 0; j < KS; ++j) o += rb[j * DV + v];
  if (live && ks == 0) osh[v] = o;
  BARRIER();
  if (warp_id == 0) {
    float ss = 0.0f;
    for (uint32_t i = lane; i < (uint32_t)DV; i += 32) ss += osh[i] * osh[i];
    ss = warp_sum(ss);
    if (lane == 0) nrm[2] = 1.0f / sqrt_f(ss / (float)DV + eps);
  }
  BARRIER();
  if (live && ks == 0) {
    const float z = proj[C + h * DV + v];
    const float gate = SIGMOID_GATE ? 1.0f / (1.0f + exp_f(-z)) : z / (1.0f + exp_f(-z));
    y[h * DV + v] = o * nrm[2] * F32(norm_w[v]) * gate;
  }
"""

SOURCE = KernelSource("strata_deltanet_step", ("proj", "conv_in", "conv_w", "a", "dt_bias", "norm_w", "s_in", "fparams"),
                      ("y", "conv_out", "s_out"), BODY)

def threads_for(dk: int, dv: int) -> int:
    """A block's threads for heads of dk x dv: KS * dv (column, slice) owners, whole warps."""
    ks = (dk + ROWS_PER_THREAD - 1) // ROWS_PER_THREAD
    return WARP * ((ks * dv + WARP - 1) // WARP)


def fits(dk: int, dv: int, conv_kernel: int) -> bool:
    """Whether the kernel takes heads of dk x dv and a conv of this width."""
    return threads_for(dk, dv) <= MAX_THREADS and conv_kernel >= 2 and dk > 0 and dv > 0


def deltanet_step(proj: mx.array, conv_in: mx.array, conv_w: mx.array, a: mx.array, dt_bias: mx.array,
                  norm_w: mx.array, s_in: mx.array, *, k_heads: int, eps: float, l2_eps: float,
                  softplus_max: float, sigmoid_gate: bool = False) -> tuple[mx.array, mx.array, mx.array]:
    """Kernel path: one decoded position of a DeltaNet layer after its input projection (module doc).
    softplus_max: softplus(x) = x above it (a whole number: a template constant). sigmoid_gate: the
    gated RMSNorm multiplies by sigmoid(z), not silu(z).

    Shapes:
        proj float32 [1, C + V + 2 Hv], conv_in float32 [C, K-1], conv_w float16 [C, K],
        a / dt_bias float32 [Hv], norm_w float16 [dv] (float32 under hyper-connections, whose
        vectors stay as an F32 file stores them), s_in float32 [Hv, dk, dv]
        -> (y float32 [1, V], conv_out float32 [C, K-1], s_out float32 [Hv, dk, dv])
    """
    hv, dk, dv = s_in.shape
    c, kc = conv_w.shape
    if proj.shape != (1, c + hv * dv + 2 * hv) or c != 2 * k_heads * dk + hv * dv or hv % k_heads:
        raise ValueError(f"deltanet kernel: proj {proj.shape}, conv {conv_w.shape}, state {s_in.shape}, "
                         f"{k_heads} k heads do not agree")
    if not fits(dk, dv, kc):
        raise ValueError(f"deltanet kernel: heads {dk} x {dv} need {threads_for(dk, dv)} threads a block "
                         f"(at most {MAX_THREADS}); conv width {kc} (at least 2)")
    if softplus_max != int(softplus_max):
        raise ValueError(f"deltanet kernel: softplus threshold {softplus_max} must be a whole number")
    nt = threads_for(dk, dv)
    consts = float_params(eps, l2_eps, float(np.float32(dk ** -0.5)))  # q's scale as the reference rounds it
    return tuple(launch(
        SOURCE, [proj, conv_in, conv_w, a, dt_bias, norm_w, s_in, consts],
        [(1, hv * dv), (c, kc - 1), (hv, dk, dv)], [mx.float32] * 3, blocks=(hv, 1, 1), threads=nt,
        template=(("HK", k_heads), ("HV", hv), ("DK", dk), ("DV", dv), ("KC", kc), ("KR", ROWS_PER_THREAD),
                  ("SOFTPLUS_MAX", int(softplus_max)), ("SIGMOID_GATE", int(sigmoid_gate)), ("NT", nt),
                  ("NORM_F32", int(norm_w.dtype == mx.float32)))))  # one build per norm_w dtype (launch.py)
