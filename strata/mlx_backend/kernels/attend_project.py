"""Decode attention and its output projection in one launch: `attend` (kernels/attention.py) and
the output projection's GEMV (kernels/dense_gemv.py) as one grid, one launch a layer fewer.

Block (h, c, t) runs `attend`'s body for query head h of token t (the same source: q/k norms,
RoPE, the cached and the chunk's own positions, the online softmax and the warps' fixed-order
merge, the output gate), keeps the head's output in threadgroup memory, and multiplies it by its
slice of W_o: rows c NT .. c NT + NT - 1, columns h HD .. h HD + HD - 1, a thread per row, the
row's HD halves loaded (16-byte loads, up to PREFETCH of them) *before* the attention runs (they
do not depend on it), so the projection's HBM reads overlap the attention's chain of dependent
steps. The output is one partial per head ([T, H, D]), so no block waits on another; on CUDA and
the emulator the last of a row chunk's H blocks to finish then adds the chunk's H partials in head
order into one part ([T, 1, D], `sums_parts`), which the router kernel adds to x (on Metal the
router adds the H partials, in the same fixed order). Only block c = 0 of a KV head's first query
head writes the cache (attend's one writer per (KV head, position)).

Why: at context 8 ncu timed attend at 4.6-4.9 us (16 blocks: 16 of the H200's 132 SMs) and the
output projection at 6.5-6.7 us (10.5 MB, 47% of copy) a layer, plus a launch each (~5 us of
host dispatch in the compiled step). Here 160 blocks (D / 256 row chunks x 16 heads at the seed
shape) each recompute their head's attention (9 positions x 4 KB of keys and values from L2)
while their 64 KB of W_o arrive. Predicted: ~5-6 us a layer for both (10.5 MB at ~3 TB/s plus the
attention's ~2 us chain and one ramp), one launch fewer: 48 a token.

The attention is the one-block-per-head form, so this replaces attend + projection exactly where
`attention.split_applies` is false (the compiled step's trace is keyed by that alone); longer
contexts keep the split attend, its merge and the GEMV.

Shapes:
    qkv float32 [T, (H + 2 KVH + GATE H) HD] (raw), wo float16 [D, H HD]
    -> partials float32 [T, H, D]; writes kc / vc [KVH, S_MAX, HD] at positions pos0 .. pos0+T-1
Grid: (H x ceil(D / NT), T) blocks of NT threads.
"""

from __future__ import annotations

import mlx.core as mx
import numpy as np

from strata.mlx_backend.kernels import attention as attn
from strata.mlx_backend.kernels import dense_gemv as dense_kernel
from strata.mlx_backend.kernels import phases, qkv_groups
from strata.mlx_backend.kernels import router as router_kernel
from strata.mlx_backend.kernels.launch import absent, float_params, index_param
from strata.mlx_backend.kernels.phases import LaunchSpec, run
from strata.mlx_backend.kernels.source import KernelSource

THREADS = 256  # rows of W_o a block: 10 chunks x 16 heads = 160 blocks at the seed shape
PREFETCH = 16  # 16-byte groups of a row loaded before the attention (a head of 128: the whole row)
MAX_TOKENS = 7  # a decode step or a short window: each token's blocks read their W_o slice


def _edit(body: str, old: str, new: str) -> str:
    """body with its one line `old` replaced (a change to attend's body that breaks this fails here)."""
    if body.count(old) != 1:
        raise AssertionError(f"attend_project: attend's body no longer has exactly one {old.strip()!r}")
    return body.replace(old, new)


W_O_PREFETCH = r"""
  constexpr int NRC = (D + NT - 1) / NT;      // row chunks of W_o
  constexpr int NG8 = HD / 8;                 // 16-byte groups of a head's slice of a row
  constexpr int PF = NG8 < PREF ? NG8 : PREF; // ... loaded before the attention
  SHARED float osh[HD];                       // this head's attention output
  const uint32_t orow = (bx % NRC) * NT + tid;  // this thread's row of W_o
  const DEVICE half_t* wrow = wo + (uint64_t)(orow < (uint32_t)D ? orow : (uint32_t)(D - 1)) * (H * HD)
                              + (uint64_t)(bx / NRC) * HD;
  uint4 wq[PF];
  UNROLL for (int g = 0; g < PF; ++g) wq[g] = *(const DEVICE uint4*)(wrow + 8 * g);
"""

W_O_PROJECT = r"""
  BARRIER();
  float acc = 0.0f;
  UNROLL for (int g = 0; g < PF; ++g) {
    const f8 wf = h8_f8(wq[g]);
    UNROLL for (int j = 0; j < 8; ++j) acc += wf.v[j] * osh[8 * g + j];
  }
  for (int g = PF; g < NG8; ++g) {
    const f8 wf = h8_f8(*(const DEVICE uint4*)(wrow + 8 * g));
    UNROLL for (int j = 0; j < 8; ++j) acc += wf.v[j] * osh[8 * g + j];
  }
  if (orow < (uint32_t)D) out[((uint64_t)t * H + h) * D + orow] = acc;
"""

BODY = _edit(_edit(_edit(attn.ATTEND_BODY,
                         "  const uint32_t h = bx;\n", "  const uint32_t h = bx / NRC;\n"),
                   "      const bool write = h % G == 0 && p == n_pos - 1;  // one writer per (KV head, position)\n",
                   "      const bool write = h % G == 0 && bx % NRC == 0 && p == n_pos - 1;  // one writer\n"),
             "      out[((uint64_t)t * H + h) * HD + r] = aa / ll * gate;\n",
             "      osh[r] = aa / ll * gate;\n")
SOURCE = KernelSource("strata_attend_project",
                      ("qkv", "q_norm", "k_norm", "rope_cos", "rope_sin", "params", "fparams", "kc", "vc", "wo"),
                      ("out",), W_O_PREFETCH + BODY + W_O_PROJECT, attn.ATTEND_HELPERS)

# The H partials of a row chunk summed once, by the last of the chunk's H blocks to finish (a count
# a (token, chunk), left zero again by that block; the partials added in head order): the router
# then reads one part instead of H. Why: ncu timed the router at 9.7 us a layer on the H200 while
# each of its 64 blocks read all 16 partials (160 KB of L2 a block), 3.8-4.2 us when it read one.
# Where chains run (atomics and device fences, as phases.py; Metal keeps the H partials).
SUM_EPILOGUE = r"""
  fence_device();
  BARRIER();
  SHARED uint32_t sum_last;
  uint32_t* const sum_at = (uint32_t*)sum_ctr + (uint64_t)t * NRC + bx % NRC;
  if (tid == 0) sum_last = atomic_add_u32(sum_at, 1u) == (uint32_t)(H - 1) ? 1u : 0u;
  BARRIER();
  if (sum_last != 0u) {
    fence_device();
    if (orow < (uint32_t)D) {
      float s = load_coherent(out + (uint64_t)t * H * D + orow);
      for (int p = 1; p < H; ++p) s += load_coherent(out + ((uint64_t)t * H + p) * D + orow);
      summed[(uint64_t)t * D + orow] = s;
    }
    if (tid == 0) *sum_at = 0u;
  }
"""
SUMMED_SOURCE = KernelSource("strata_attend_project_sum", SOURCE.inputs + ("sum_ctr",), ("out", "summed"),
                             SOURCE.body + SUM_EPILOGUE, attn.ATTEND_HELPERS, metal=False)


def sums_parts() -> bool:
    """Whether `attend_project` returns its partials summed (one part) on the current path."""
    return phases.available()


# The QKV GEMV and this launch as one (phases.chain): the attention blocks load their W_o rows,
# then wait for the GEMV's blocks where they first read q, k and v: one launch a layer fewer at
# decode (~13-15 us of host a launch on the H200, where a decoded token is host-bound), and the
# W_o loads overlap the GEMV. Measured there (docs/perf.md, ncu, a layer): the two apart 21.9 us,
# chained 26.6 (117 registers a thread, the GEMV's blocks 2 an SM), with the partials' sum 28.0;
# a decoded token 7-13% less wall time, the host being what bounds it.
# 16-byte groups of W_o a chained block loads before its wait: the chained kernel holds them in
# registers through the GEMV's phase too (ncu: 26.3-27.0 us a layer at 4, 71 registers a thread;
# 28.0-28.2 at 8 and 16, 87 and 117); no bits change with the depth
CHAIN_PREFETCH = 4
WAIT_AT = len(W_O_PREFETCH)  # the consumer body's offset where the attention starts


# The QKV GEMV of the chain walked KV group by KV group (kernels/qkv_groups.py): an attention block
# waits for its own group's rows, not for the whole GEMV, so the first groups' attention overlaps
# the last groups' reads. The outputs are bit for bit the plain chain's. Measured on the H200 (ncu,
# a layer of the seed shape): 27.0-27.2 us with the whole W_o slice loaded before the wait
# (GROUP_PREFETCH 16: 116 registers, 2 blocks an SM) against 30.6 for the plain chain; with 4
# groups loaded first (80 registers) the walk took 33.3-33.5: an attention block that starts early
# must not then wait on its W_o rows.
GROUP_PREFETCH = 16


def walks_by_group(wqkv: mx.array, kc: mx.array, n_heads: int, gated: bool) -> bool:
    """Whether a chain's QKV GEMV walks the KV groups here (kernels/qkv_groups.py)."""
    return qkv_groups.applies(wqkv, n_heads, kc.shape[0], kc.shape[2], gated)


def chains_qkv(t: int, n_pos: int, wo: mx.array) -> bool:
    """Whether the QKV GEMV and `attend_project` run as one launch here (one token, chains run)."""
    return t == 1 and applies(t, n_pos, wo) and phases.available()


def qkv_attend_project(wqkv: mx.array, x: mx.array, norm_w: mx.array, bias: mx.array | None, q_norm: mx.array | None,
                       k_norm: mx.array | None, rope_cos: mx.array, rope_sin: mx.array, kc: mx.array, vc: mx.array,
                       wo: mx.array, pos0: int, eps: float, n_heads: int, *, pos: mx.array | None = None,
                       rotary_dim: int | None = None, gated: bool = False) -> tuple[mx.array, mx.array]:
    """`dense_gemv(wqkv, x, norm_w, eps, bias)` then `attend_project` of its output, one launch.

    Shapes:
        wqkv float16 [(H + 2 KVH + gated H) HD, D], x float32 [1, D]
        -> (qkv float32 [1, (H + 2 KVH + gated H) HD], partials float32 [1, H or 1, D])
    """
    gemv, proj = _chained_specs(wqkv, x, norm_w, bias, q_norm, k_norm, rope_cos, rope_sin, kc, vc, wo, pos0, eps,
                                n_heads, pos, rotary_dim, gated)
    qkv, *parts = phases.chain_all((gemv, proj), ({}, {"qkv": (0, 0)}), key=wo, waits=(0, WAIT_AT),
                                   **_group_waits(wqkv, kc, n_heads, gated, 2))
    return qkv, parts[-1]


def _group_waits(wqkv: mx.array, kc: mx.array, n_heads: int, gated: bool, n: int) -> dict:
    """chain_all's finer waits where the QKV GEMV walks the KV groups: the attention phase waits
    for its group's count (one counter a group), the others as before."""
    if not walks_by_group(wqkv, kc, n_heads, gated):
        return {}
    return dict(custom_waits=(None, qkv_groups.ATTEND_WAIT) + (None,) * (n - 2), extra=kc.shape[0])


def qkv_spec(wqkv: mx.array, x, norm_w: mx.array, bias: mx.array | None, kc: mx.array, eps: float, n_heads: int,
             gated: bool) -> LaunchSpec:
    """A chain's QKV GEMV phase: walked KV group by KV group where `walks_by_group` (each group counted
    into chain_extra[group], which `qkv_groups.attend_wait` waits on), else the plain GEMV."""
    if walks_by_group(wqkv, kc, n_heads, gated):
        return qkv_groups.qkv_groups(wqkv, x, norm_w, eps, bias, n_heads=n_heads, n_kv_heads=kc.shape[0],
                                     head_dim=kc.shape[2], gated=gated)
    return dense_kernel.dense_gemv(wqkv, x, norm_w, eps, bias=bias, spec=True)


def _chained_specs(wqkv, x, norm_w, bias, q_norm, k_norm, rope_cos, rope_sin, kc, vc, wo, pos0, eps, n_heads, pos,
                   rotary_dim, gated) -> tuple[LaunchSpec, LaunchSpec]:
    """The QKV GEMV's launch and attend_project's reading its output (a `phases.Pending`), as a
    chain's first two phases take them."""
    gemv = qkv_spec(wqkv, x, norm_w, bias, kc, eps, n_heads, gated)
    proj = attend_project(phases.Pending(gemv.output_shapes[0], mx.float32), q_norm, k_norm, rope_cos, rope_sin, kc, vc,
                          wo, pos0, eps, n_heads, pos=pos, rotary_dim=rotary_dim, gated=gated,
                          prefetch=GROUP_PREFETCH if walks_by_group(wqkv, kc, n_heads, gated) else CHAIN_PREFETCH, spec=True)
    return gemv, proj


# The router kernel as a third phase of that launch (phases.chain_all): its blocks issue their
# first router-row loads, then wait for the attention's blocks (the partials summed) where the
# router first reads x and the part. One launch a layer fewer again (194 -> 146 a token at the
# seed shape); the router runs at the chain's 256 threads (8 rows a block) with ROUTE_ROW_LOADS
# units a lane in flight (its own 20 would hold ~150 registers a thread for the whole chain).
ROUTE_ROW_LOADS = 5


def chains_router(t: int, n_pos: int, wo: mx.array) -> bool:
    """Whether the QKV GEMV, attention + W_o and the router (no guess) run as one launch here."""
    return chains_qkv(t, n_pos, wo) and sums_parts()


def qkv_attend_route(wqkv: mx.array, x: mx.array, norm_w: mx.array, bias: mx.array | None, q_norm: mx.array | None,
                     k_norm: mx.array | None, rope_cos: mx.array, rope_sin: mx.array, kc: mx.array, vc: mx.array,
                     wo: mx.array, ffn_norm: mx.array, w_router: mx.array, pos0: int, eps: float, n_heads: int, *,
                     pos: mx.array | None = None, rotary_dim: int | None = None,
                     gated: bool = False, hand_on: bool = False) -> tuple[mx.array, mx.array, mx.array]:
    """`qkv_attend_project` then `router.router(x, its summed partials, ffn_norm, w_router)` (no
    guess), one launch. hand_on: h and z come back as `Region`s of the launch's folded buffer
    (`routed_chain`).

    Shapes:
        x float32 [1, D], w_router float32 [E, D] -> (x_mid [1, D], h [1, D], z float32 [1, E])
    """
    gemv, proj = _chained_specs(wqkv, x, norm_w, bias, q_norm, k_norm, rope_cos, rope_sin, kc, vc, wo, pos0, eps,
                                n_heads, pos, rotary_dim, gated)
    route = router_kernel.router(x, phases.Pending(proj.output_shapes[-1], mx.float32), ffn_norm, w_router, None,
                                 None, eps, threads=THREADS, row_loads=ROUTE_ROW_LOADS, spec=True)
    specs, waits = [gemv, proj, route], [0, WAIT_AT, router_kernel.WAIT_AT]
    links = [{}, {"qkv": (0, 0)}, {"parts": (1, len(proj.output_shapes) - 1)}]
    return routed_chain(specs, links, waits, key=wo, hand_on=hand_on, **_group_waits(wqkv, kc, n_heads, gated, 3))


def routed_chain(specs: list[LaunchSpec], links: list[dict], waits: list[int], *, key: mx.array,
                 hand_on: bool = False, **extra) -> tuple[mx.array, mx.array, mx.array]:
    """A chain whose last phase is the router (`router.router(spec=True)`, no guess), run as one
    launch (`phases.chain_all`; extra: its custom_waits / extra) -> (x_mid, h, z). Every output but
    those is folded. hand_on: h and z folded too and returned as `Region`s of the buffer, which the
    expert step's gate/up launch reads as one input: 2 outputs and 1 input a layer fewer of MLX's
    host work (96 and 48 a token at the seed shape), the same bits."""
    # what is read after the launch: the router's x_mid, h, z (not its guess: none here); every
    # other output (the phases' intermediates) is folded
    at = sum(len(s.output_shapes) for s in specs[:-1])  # the router phase's first output
    read = tuple(at + router_kernel.SOURCE.outputs.index(o) for o in (("x_mid",) if hand_on else ("x_mid", "h", "z")))
    outs = phases.chain_all(specs, links, key=key, waits=waits, keep=read, regions=hand_on, **extra)
    x_mid, h, z, _ = outs[-4:]
    return x_mid, h, z


def applies(t: int, n_pos: int, wo: mx.array) -> bool:
    """Whether `attend_project` serves t new positions ending at n_pos: the one-block-per-head
    attention (not split), few tokens, float16 W_o."""
    return 1 <= t <= MAX_TOKENS and not attn.split_applies(n_pos, t) and wo.dtype == mx.float16 and wo.ndim == 2


def check_step(name: str, qkv: mx.array, q_norm: mx.array | None, k_norm: mx.array | None, rope_cos: mx.array,
               kc: mx.array, vc: mx.array, wo: mx.array, n_heads: int, pos: mx.array | None, rotary_dim: int | None,
               gated: bool, *, bad: bool = False, detail: str = "") -> int:
    """The arguments an attention step with its output projection takes (this launch and
    attend_split's), checked: a ValueError naming `name` and the shapes. `bad`: the caller's own
    sizes are wrong (the same error), `detail` ends its message. Returns the rotary dims."""
    width = qkv.shape[1]
    kvh, hd = kc.shape[0], kc.shape[2]
    rd = hd if rotary_dim is None else rotary_dim
    if (bad or hd % 8 or hd > attn.MAX_HEAD_DIM or n_heads % kvh or width != (n_heads * (1 + int(gated)) + 2 * kvh) * hd
            or rd % 2 or not 0 < rd <= hd or rope_cos.shape[-1] != rd // 2 or wo.shape[1] != n_heads * hd):
        raise ValueError(f"{name}: head_dim {hd} (a multiple of 8, <= {attn.MAX_HEAD_DIM}), {n_heads} heads "
                         f"over {kvh} KV heads, qkv width {width} (gated {gated}), rotary dims {rd}, W_o {wo.shape}"
                         f"{detail}")
    if (q_norm is None) != (k_norm is None):
        raise ValueError(f"{name}: q_norm and k_norm come together")
    if kc.dtype != vc.dtype or kc.dtype not in (mx.float32, mx.float16):
        raise ValueError(f"{name}: the cache is float32 or float16 (keys {kc.dtype}, values {vc.dtype})")
    if pos is not None and (pos.dtype != mx.int32 or pos.size < 1):
        raise ValueError(f"{name}: pos must be int32 with at least one element, got {pos.dtype} [{pos.size}]")
    return rd


def attend_project(qkv: mx.array, q_norm: mx.array | None, k_norm: mx.array | None, rope_cos: mx.array,
                   rope_sin: mx.array, kc: mx.array, vc: mx.array, wo: mx.array, pos0: int, eps: float, n_heads: int,
                   *, pos: mx.array | None = None, rotary_dim: int | None = None, gated: bool = False,
                   prefetch: int = PREFETCH, spec: bool = False):
    """Kernel path: `attend` (the same arguments, never split) followed by the output projection
    by wo, as one partial per head. Writes the positions' keys and values into kc / vc as attend does.
    prefetch: 16-byte groups of a W_o row loaded before the attention (the benchmarks compare).
    spec: the launch's `phases.LaunchSpec` instead of its output (qkv may be a `phases.Pending`).
    Where `sums_parts()`, the partials come summed, one part (the launch's second output; its
    first holds the H partials).

    Shapes:
        qkv float32 [T, (H + 2 KVH + gated H) HD], wo float16 [D, H HD] -> partials float32 [T, H or 1, D]
    """
    t, width = qkv.shape
    kvh, s_max, hd = kc.shape
    d = wo.shape[0]
    rd = check_step("attend_project", qkv, q_norm, k_norm, rope_cos, kc, vc, wo, n_heads, pos, rotary_dim, gated)
    qkn = q_norm is not None
    half = absent(np.float16)
    nrc = -(-d // THREADS)
    inputs = (qkv, q_norm if qkn else half, k_norm if qkn else half, rope_cos, rope_sin,
              index_param(pos0) if pos is None else pos, float_params(eps), kc, vc, wo)
    shapes = ((t, n_heads, d),)
    summed = sums_parts()
    if summed:
        inputs += (phases.counters(wo, "attend_sum", max(t, MAX_TOKENS) * nrc),)
        shapes += ((t, 1, d),)
    one = LaunchSpec(SUMMED_SOURCE if summed else SOURCE, inputs, shapes, (mx.float32,) * len(shapes),
                     (n_heads * nrc, t, 1), THREADS,
                     (("H", n_heads), ("KVH", kvh), ("HD", hd), ("S_MAX", s_max), ("QKN", int(qkn)),
                      ("RD", rd), ("GATE", int(gated)), ("NT", THREADS), ("CH", 0),
                      ("KV16", int(kc.dtype == mx.float16)), ("D", d), ("PREF", prefetch)))
    return one if spec else run(one)[-1]
