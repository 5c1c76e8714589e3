"""Routed experts of a whole prompt as grouped GEMMs: the prompt path's expert step.

The fused expert kernel (kernels/moe.py) is a GEMV per (token, rank): at 2048 prompt tokens it
reads every selected expert's 1.38 MB once per token that picked it (~28 GB a layer at the seed
shape, from L2 at best). Here the T*k (token, expert) pairs are sorted by expert, so each
expert's weights are read once for all its tokens and multiplied on the matrix units:

1. route on the device (the model's rule; every expert resident, so MoCE's bonus lifts every
   logit alike and the selection is the model's): `top_k` ranks by an exact integer key, ties to
   the lower id as the reference breaks them (on a kernel path one launch ranks them the same
   way, kernels/prompt_topk.py, with the softmax rules' weights);
2. dequantize the layer's E records to the compute dtype (`mx.dequantize`: Q2_0 is MLX's affine
   2-bit group-32 layout, d (q - 2) is exact in float16);
3. gather the sorted tokens' rows and run gate, up and down as grouped GEMMs: `mx.gather_mm(...,
   sorted_indices=True)`, or the rows scattered into [E, cap, D] for one batched matmul
   (`GroupedGemm`, `default_gemm` says which where); `mx.gather_qmm` on the Q2_0 planes is not
   used: MLX's CUDA build runs it as a GEMV or a one-row tile per pair;
4. weight, unsort and sum over the k ranks in float32.

Why dequantize-then-GEMM before a custom mma kernel (bytes and flops at the seed shape, 2048
tokens, per layer; docs/mlx_backend.md has the table): the GEMMs are 181 GFLOP (~0.3 ms of
tensor cores), the dequantized copy is 2.26 GB written and read again (~1.4 ms at ~3.3 TB/s), so
the 48 layers' experts take ~80 ms: inside the 0.2 s target with the least code. A kernel that
dequantizes Q2_0 tile by tile into shared memory reads 0.35 GB a layer instead (~5 ms in all):
the next step if the measured time says the copy is what is left.

Shapes: T tokens, k selected, E experts, D hidden, F expert ffn.
"""

from __future__ import annotations

import functools

import mlx.core as mx
import numpy as np

from strata.formats.expert_record import RecordLayout
from strata.formats.quant_types import Q2_0_LEVEL_OFFSET, QuantType, layout
from strata.mlx_backend import kernel_plan
from strata.mlx_backend.experts import gated_hidden
from strata.mlx_backend.grouped_tiles import q2_tile_experts
from strata.mlx_backend.kernels import q2_mma
from strata.mlx_backend.kernel_plan import GroupedGemm
from strata.mlx_backend.kernels.launch import KernelPath, current_path
from strata.mlx_backend.kernels.prompt_topk import WEIGHED_ORDERS, topk_kernel
from strata.mlx_backend.lowp import as_mm, join_rows, mm_dtype, split_rows
from strata.mlx_backend.quants import GROUP
from strata.mlx_backend.routing import combine_weights, rank_order, selection_scores
from strata.mlx_backend.shape_buckets import bucket
from strata.model_config import ExpertKind
from strata.reference.experts import SWIGLU, ExpertAct
from strata.reference.routing import RouterRule

Q2_BITS = layout(QuantType.Q2_0).bits

__all__ = ["GroupedGemm", "TILE_ROWS", "MIN_PAIRS", "grouped_pays", "default_gemm",
           "top_k",
           "route_prompt", "dequantized_experts", "grouped_experts",
           "grouped_refusal"]


def _order_key(score: mx.array) -> mx.array:
    """A uint64 key per entry whose ascending order is the reference's ranking: score descending,
    equal scores by lower expert id. float32 [T, E] -> uint64 [T, E] (distinct within a row)"""
    e = score.shape[-1]
    bits = (score + 0.0).view(mx.uint32)  # + 0.0: -0.0 becomes +0.0, equal to it as the reference compares
    ordered = mx.where(bits >= 0x80000000, ~bits, bits | 0x80000000)  # float order as unsigned order
    ids = mx.arange(e, dtype=mx.uint64)
    return ~((ordered.astype(mx.uint64) << 32) | (e - 1 - ids))  # larger score (then lower id) first


# top_k on a kernel path as one launch (kernels/prompt_topk.py: the same selection) instead of the
# uint64 key's ~12 ops and its sort (ncu, a 2048-token layer: ~140 us). False: the key everywhere.
def top_k(score: mx.array, k: int) -> mx.array:
    """The k best experts per row in rank order (the reference's order, ties to the lower id):
    on a kernel path one launch (kernels/prompt_topk.py: ~140 us less of a 2048-token layer than
    the uint64 key's ~12 ops and its sort, ncu), else one sort of distinct integer keys, where
    `routing.rank_order` compares all E x E pairs ([T, E, E]: 0.5 GB of int32 a layer at 2048
    tokens; still the form where this device cannot sort uint64). float32 [T, E] -> int32 [T, k]"""
    if current_path() is not KernelPath.OPS:
        return topk_kernel(score, k)
    if not _sorts_uint64(str(mx.default_device())):
        ids = mx.broadcast_to(mx.arange(score.shape[-1], dtype=mx.int32)[None], score.shape)
        return mx.argsort(rank_order(score, ids), axis=-1)[:, :k].astype(mx.int32)
    return mx.argsort(_order_key(score), axis=-1)[:, :k].astype(mx.int32)


@functools.cache
def _sorts_uint64(device: str) -> bool:
    """Whether MLX sorts uint64 keys on `device` (asked once: an unsupported op fails only when evaluated).
    Keyed by the device's name: `mx.Device` compares equal but hashes by identity and
    `mx.default_device()` makes a new one per call, so a cache keyed by it asked again at every
    layer (on the H200 an 8-key sort of a host array, 156 us of GPU time under ncu, and a host
    sync that drained the layers queued before it)."""
    keys = np.array([5, 3, 7, 1, 6, 0, 4, 2], np.uint64) << np.uint64(33) | np.arange(8, dtype=np.uint64)
    try:
        return np.array(mx.argsort(mx.array(keys))).tolist() == np.argsort(keys).tolist()
    except Exception:  # noqa: BLE001 - any failure means: use the comparison form
        return False


def route_prompt(z: mx.array, rule: RouterRule) -> tuple[mx.array, mx.array]:
    """The model's own rule on the device: on a kernel path the softmax rules' weights in the top-k
    kernel's launch (kernels/prompt_topk.py), where routing.combine_weights takes ~8 launches over
    [T, E] (ncu, a 2048-token layer: ~30 us).
    z float32 [T, E] -> (experts int32 [T, k], weights float32 [T, k])"""
    if current_path() is not KernelPath.OPS and rule.order in WEIGHED_ORDERS:
        return topk_kernel(z, rule.k, order=rule.order, norm=rule.norm_topk_prob)
    experts = top_k(selection_scores(z, rule), rule.k)
    return experts, combine_weights(z, experts, rule)


def grouped_refusal(rec: RecordLayout | None, act: ExpertAct) -> str | None:
    """Why these records cannot take the grouped path (None: they can)."""
    if rec is None:
        return "no resident arena"
    if rec.qtype is not QuantType.Q2_0:
        return f"experts of type {rec.qtype.name} (the grouped path dequantizes Q2_0)"
    if rec.biases or act.kind is not ExpertKind.SWIGLU:
        return "experts with biases or a clamped SwiGLU"
    if rec.hidden % GROUP or rec.expert_ffn % GROUP:
        return f"hidden {rec.hidden} / expert ffn {rec.expert_ffn} not multiples of {GROUP}"
    return None


def dequantized_experts(records: mx.array, rec: RecordLayout, dtype: mx.Dtype) -> tuple[mx.array, mx.array]:
    """A layer's E records as dense weights in `dtype`, gate and up stacked (one GEMM computes
    both: N = 2F fills the matrix units' tiles better than two of F), exactly: d (q - 2) of a
    float16 d is a float16 value. `mx.dequantize` computes q d + (-2d) in the scales' dtype: on a
    GPU one fused multiply-add in float16 (one rounding of the exact value: exact; a GPU test
    checks it), on MLX's CPU build a rounded product first (3d needs 12 bits), so there the
    scales are float32.

    Shapes:
        records uint8 [E, >= record_bytes] -> gate_up [E, 2F, D] (gate rows, then up), down [E, D, F]
    """
    sd = mm_dtype(dtype)
    n, bits = records.shape[0], Q2_BITS

    def planes(proj: str) -> tuple[mx.array, mx.array, mx.array]:  # codes, scales, biases in dtype sd
        rows, cols = rec.shape(proj)
        c, sc = rec.codes(proj), rec.scales(proj)
        w = records[:, c.offset:c.end].view(mx.uint32).reshape(n, rows, cols * bits // 32)
        d = records[:, sc.offset:sc.end].view(mx.float16).reshape(n, rows, cols // GROUP).astype(sd)
        return w, d, d * -float(Q2_0_LEVEL_OFFSET)  # -2d: exact in float16 too (a power of two)

    (gw, gs, gb), (uw, us, ub) = planes("gate"), planes("up")
    stacked = [(mx.concatenate([gw, uw], axis=1), mx.concatenate([gs, us], axis=1), mx.concatenate([gb, ub], axis=1)),
               planes("down")]  # the codes planes are a tenth of the float16 weights: stacking them is cheap
    return tuple(mx.dequantize(w, s, b, group_size=GROUP, bits=bits).astype(dtype) for w, s, b in stacked)


def grouped_experts(records: mx.array, rec: RecordLayout, h: mx.array, experts: mx.array, weights: mx.array, *,
                    dtype: mx.Dtype = mx.float16, act: ExpertAct = SWIGLU, gemm: "GroupedGemm | None" = None,
                    slots: mx.array | None = None) -> mx.array:
    """sum_i w_i expert_i(h_t) for every token, the (token, expert) pairs grouped by expert.

    records: the layer's E arena rows (slot e = expert e). dtype: the GEMMs' input dtype
    (float16 on a GPU, activations split in two terms: lowp.py; float32: only the reordering of
    sums). gemm: None is the kernel plan's grouped_gemm, or `default_gemm()` where that is None too. slots: expert e is records[slots[e]]
    (Q2_TILES reads it there; the other forms gather the rows first); None: records[e].

    Shapes:
        records uint8 [E, SLOT]; h float32 [T, D]; experts int32 [T, k]; weights float32 [T, k] -> float32 [T, D]
    """
    t, k = experts.shape
    form = gemm or kernel_plan.current().grouped_gemm or default_gemm()
    if form is GroupedGemm.Q2_TILES:
        if current_path() is KernelPath.OPS:
            raise ValueError("grouped experts: Q2_TILES is a kernel (the GPU or emulated path); "
                             "the ops path has PADDED")
        return q2_tile_experts(records, rec, h, experts, weights, act=act, slots=slots)
    if slots is not None:
        records = mx.take(records, slots, axis=0)  # [E, SLOT]
    flat = experts.reshape(-1)  # [T k]
    order = mx.argsort(flat)  # pairs grouped by expert (any order inside a group)
    by_expert = flat[order].astype(mx.uint32)
    rows = h.astype(mx.float32)[order // k]  # [T k, D]
    if form is GroupedGemm.Q2_MMA:
        y = _q2_mma(rows, by_expert, records, rec, act, dtype)
    else:
        run = {GroupedGemm.PADDED: _padded, GroupedGemm.TILED: _tiled, GroupedGemm.GATHER: _gather}[form]
        gate_up, down = (as_mm(w, dtype) for w in dequantized_experts(records, rec, dtype))
        y = run(rows, by_expert, gate_up, down, act, dtype)  # [T k, D] in sorted order
    y = y.astype(mx.float32) * weights.reshape(-1)[order][:, None]
    unsorted = y[mx.argsort(order)]  # [T k, D]: back to (token, rank) order
    return unsorted.reshape(t, k, -1).sum(axis=1)


# Rows per tile of the TILED form. Its tile count has a bound the host knows without a sync,
# ceil(N / TILE_ROWS) + E, whose unused tiles are computed and dropped: at the seed shape
# (N = 20480 pairs of 2048 tokens, E = 256) 32 rows cost 1.4x the flops, 64 rows 1.8x.
TILE_ROWS = 32


# Pairs per distinct expert from which a grouped form beats the decode's fused GEMV kernel, by
# form (None: never), from the H200 (a layer's experts at the seed shape, each evaluated alone):
# PADDED was slower than the fused kernel at every length (128 /
# 512 / 2048 tokens: 16.5 / 17.0 / 31.3 ms against 1.5 / 4.9 / 19.0), so never. Q2_TILES against
# the fused kernel at 1.25 / 5 / 10 pairs an expert: 1.55 / 1.76 / 2.05 ms against 0.56 / 1.46 /
# 2.60 (the fused kernel's time grows with the pairs, the tiles' barely): they cross at ~7 (a
# 256-expert top-10 layer: ~180 tokens). TILED, Q2_MMA, GATHER: the first guess from bytes (~19 MB
# moved per distinct expert: ~9 pairs), unmeasured. Below the crossing the layer's experts take
# the fused kernel (the rest of the layer stays on the prompt path).
MIN_PAIRS: dict["GroupedGemm", int | None] = {GroupedGemm.PADDED: None, GroupedGemm.Q2_TILES: 7,
                                              GroupedGemm.TILED: 8, GroupedGemm.Q2_MMA: 8, GroupedGemm.GATHER: 8}


def grouped_pays(pairs: int, experts: int) -> bool:
    """Whether `pairs` (token, expert) pairs over `experts` distinct experts take the grouped GEMMs
    (the form `grouped_experts` would run: the kernel plan's, else the device's default; the plan's
    grouped_min_pairs, where it has one, for every form)."""
    plan = kernel_plan.current()
    least = plan.grouped_min_pairs if plan.grouped_min_pairs is not None else MIN_PAIRS[
        plan.grouped_gemm or default_gemm()]
    return least is not None and pairs >= least * experts


def default_gemm() -> GroupedGemm:
    """Q2_TILES on MLX's CUDA build (PADDED on its ops path), GATHER elsewhere. On the H200 the
    tile kernel ran a 2048-token prompt of the seed shape in 284 ms against PADDED's 2858 ms (same
    run, logits 1.2e-5 apart; docs/perf.md). PADDED rather than gather_mm on CUDA's ops path: MLX's
    CUDA gather_mm (0.32.x, a CUTLASS grouped GEMM, grouped_gemm_unaligned.cu) takes its
    tensor-core configuration only where TF32 is enabled, for every dtype; strata turns TF32 off
    (float32 ops must stay float32), so there a float16 gather_mm runs on the SIMT cores. Metal's
    gather_mm is a simdgroup-matrix kernel (the tile kernel's Metal form is compile-checked, not
    run, and not on the matrix units)."""
    cuda = getattr(mx, "cuda", None)
    if cuda is not None and cuda.is_available() and mx.default_device() == mx.gpu:
        return GroupedGemm.PADDED if current_path() is KernelPath.OPS else GroupedGemm.Q2_TILES
    return GroupedGemm.GATHER


def _gather(rows, by_expert, gate_up, down, act, dtype) -> mx.array:
    """float32 [N, D] rows sorted by expert -> float32 [N, D] expert outputs (mx.gather_mm per
    projection; a row's hi and lo terms (lowp.py) are adjacent rows of the same expert)."""
    n = rows.shape[0]

    def mm(a: mx.array, w: mx.array) -> mx.array:  # [N, C] float32 -> [N, R] float32
        parts = split_rows(a[:, None, :], dtype, axis=1)  # [N, 1 or 2, C]
        p = parts.shape[1]
        idx = by_expert if p == 1 else mx.repeat(by_expert, p)
        y = mx.gather_mm(parts.reshape(n * p, 1, -1), w.swapaxes(-1, -2), rhs_indices=idx, sorted_indices=True)
        return join_rows(y.reshape(n, p, -1), 1, axis=1)[:, 0, :]

    f = down.shape[-1]
    gu = mm(rows, gate_up)  # [N, 2F]
    return mm(gated_hidden(act, gu[:, :f], gu[:, f:]), down)


# Round Q2_MMA's group capacity up to a bucket (shape_buckets.py): its row count is a template
# value of its kernel, so an exact cap compiled a new kernel per prompt on MLX's CUDA build.
# PADDED keeps the exact cap: its batched matmul is cuBLAS, which compiles nothing per shape
# (docs/mlx_backend.md, "JIT compile costs"), so a bucket would only add rows.


def _cap(counts: mx.array, *, template: bool) -> int:
    """Rows per expert of a padded form: the largest group (one host sync), in a bucket where the
    count becomes a kernel's template value."""
    largest = int(counts.max().item())
    return bucket(largest) if template else largest


def _padded(rows, by_expert, gate_up, down, act, dtype) -> mx.array:
    """`_gather` as batched matmuls over [E, P cap, D] (P = 2: each row's hi and lo terms; cap:
    the largest group, one host sync a layer)."""
    n, e, f = rows.shape[0], gate_up.shape[0], down.shape[-1]
    counts = mx.zeros((e,), mx.int32).at[by_expert].add(1)  # [E]
    starts = mx.cumsum(counts) - counts
    cap = _cap(counts, template=False)
    pos = mx.arange(n, dtype=mx.int32) - starts[by_expert]  # [N] place inside the expert's group

    def mm(a: mx.array, w: mx.array) -> mx.array:  # [N, C] float32 rows -> [N, R] float32
        parts = split_rows(a, dtype)  # [P N, C]: hi rows, then lo rows
        p = parts.shape[0] // n
        dest = mx.concatenate([by_expert.astype(mx.int32) * (p * cap) + j * cap + pos for j in range(p)])  # [P N]
        buf = mx.zeros((e * p * cap, a.shape[1]), parts.dtype)
        buf[dest] = parts
        y = buf.reshape(e, p * cap, -1) @ w.swapaxes(-1, -2)  # [E, P cap, R]
        return join_rows(y, cap, axis=1).reshape(e * cap, -1)[by_expert.astype(mx.int32) * cap + pos]

    gu = mm(rows, gate_up)  # [N, 2F]
    return mm(gated_hidden(act, gu[:, :f], gu[:, f:]), down)


def _tiled(rows, by_expert, gate_up, down, act, dtype) -> mx.array:
    """`_gather` over tiles of TILE_ROWS rows of one expert each ([NT, TILE_ROWS, D], NT the
    host's bound), one `mx.gather_mm` by tile (MLX's CUDA build: its tensor-core gather GEMM,
    TF32 or not). No host sync."""
    n, e, f, bm = rows.shape[0], gate_up.shape[0], down.shape[-1], TILE_ROWS
    ids = by_expert.astype(mx.int32)
    counts = mx.zeros((e,), mx.int32).at[ids].add(1)  # [E]
    starts = mx.cumsum(counts) - counts
    tiles = (counts + bm - 1) // bm
    first = mx.cumsum(tiles) - tiles  # [E] the expert's first tile
    nt = -(-n // bm) + e  # a bound on sum_e ceil(count_e / bm)
    slot = first[ids] * bm + (mx.arange(n, dtype=mx.int32) - starts[ids])  # [N] row in [NT bm]
    tile_expert = mx.zeros((nt,), mx.int32).at[slot // bm].maximum(ids).astype(mx.uint32)  # [NT]; unused: 0

    def mm(a: mx.array, w: mx.array) -> mx.array:  # [N, C] float32 rows -> [N, R] float32
        parts = split_rows(a, dtype)  # [P N, C]: hi rows, then lo rows
        p = parts.shape[0] // n
        dest = mx.concatenate([j * nt * bm + slot for j in range(p)])  # [P N]
        buf = mx.zeros((p * nt * bm, a.shape[1]), parts.dtype)
        buf[dest] = parts
        idx = tile_expert if p == 1 else mx.concatenate([tile_expert] * p)
        y = mx.gather_mm(buf.reshape(p * nt, bm, -1), w.swapaxes(-1, -2), rhs_indices=idx)  # [P NT, bm, R]
        return join_rows(y.reshape(p * nt * bm, -1), nt * bm)[slot]

    gu = mm(rows, gate_up)  # [N, 2F]
    return mm(gated_hidden(act, gu[:, :f], gu[:, f:]), down)


def _q2_mma(rows, by_expert, records, rec, act, dtype) -> mx.array:
    """PADDED's [E, P cap, C] rows (float16) multiplied by the records' Q2_0 planes in the kernel
    (kernels/q2_mma.py, a kernel path only): no dequantized copy of the experts."""
    if current_path() is KernelPath.OPS:
        raise ValueError("grouped experts: Q2_MMA is a kernel (the GPU or emulated path); the ops path has PADDED")
    n, e, f = rows.shape[0], records.shape[0], rec.expert_ffn
    counts = mx.zeros((e,), mx.int32).at[by_expert].add(1)  # [E]
    starts = mx.cumsum(counts) - counts
    cap = _cap(counts, template=True)
    pos = mx.arange(n, dtype=mx.int32) - starts[by_expert]
    slots = mx.arange(e, dtype=mx.int32)  # expert e is record e of `records`
    half = mx.float16

    def mm(a: mx.array, planes: tuple[str, ...]) -> mx.array:  # [N, C] float32 -> [N, R] float32
        hi = a.astype(half)
        parts = mx.concatenate([hi, (a - hi.astype(mx.float32)).astype(half)])  # lowp.py's two terms
        p = parts.shape[0] // n
        dest = mx.concatenate([by_expert.astype(mx.int32) * (p * cap) + j * cap + pos for j in range(p)])
        buf = mx.zeros((e * p * cap, a.shape[1]), half)
        buf[dest] = parts
        y = q2_mma.q2_mma(buf.reshape(e, p * cap, -1), records, slots, rec, planes)  # [E, P cap, R]
        return join_rows(y, cap, axis=1).reshape(e * cap, -1)[by_expert.astype(mx.int32) * cap + pos]

    gu = mm(rows, ("gate", "up"))  # [N, 2F]
    return mm(gated_hidden(act, gu[:, :f], gu[:, f:]), ("down",))
