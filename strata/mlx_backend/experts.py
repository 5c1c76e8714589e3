"""SwiGLU experts on MLX arrays: the twins of strata.reference.experts, and the routed-expert
step of a layer in three layers (STYLE §4): the fused kernel (kernels/moe.py), an MLX-ops path
(`mx.gather_qmm` on the Q2_0 layout), and public functions that choose.

A layer's routed output is kept as *partials* [T, P, D] (P terms whose sum, times nothing more,
is sum_i w_i expert_i(x)); `combine` adds them and the shared expert to the residual. The kernel
path produces one partial per (rank, F-chunk), the ops path one per rank.

llama.cpp's types kept as stored (Q4_K, Q6_K, Q8_0, IQ4_XS, ... kernels/ggml_dot.py), a type per
projection, take theirs (kernels/moe_ggml.py: the plain SwiGLU, no biases); they have no ops path
(engines.mlx_refusal sends them to numpy off a GPU, with a note).
MLX's own types (affine 4/8-bit, MXFP4) take their own fused kernel (kernels/moe_native.py),
gpt-oss's experts included (the clamped SwiGLU, biases in the records: `ExpertAct`,
`RecordLayout.biases`); the Q2_0 kernel computes the plain SwiGLU without biases. On the ops
path: `gather_qmm` for the three projections, the biases gathered by the same indices and added.

Shapes: see each function (T tokens, D hidden, F expert ffn, k selected, E experts).
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Sequence

import mlx.core as mx
import numpy as np

from strata.formats.expert_record import PROJECTIONS, ExpertWeights, RecordLayout, pack_record
from strata.formats.quant_matrix import has_biases
from strata.errors import ConfigError
from strata.formats.quant_types import QuantType
from strata.mlx_backend.dense import linear
from strata.mlx_backend.kernels import combine as combine_kernel
from strata.mlx_backend.kernels import moe, moe_ggml, moe_native
from strata.mlx_backend.kernels import shared as shared_kernel
from strata.mlx_backend.kernels.launch import KernelPath, current_path
from strata.mlx_backend.quants import AFFINE, GROUP, NATIVE, native_refusal, native_scale_view
from strata.mlx_backend.routing import select_device
from strata.model_config import ExpertKind
from strata.reference.experts import SWIGLU, ExpertAct
from strata.reference.routing import RouterRule

__all__ = ["silu", "swiglu_expert", "routed_experts", "shared_expert", "ExpertStack", "stack_experts",
           "slot_planes", "routed_partials", "routed_partials_route", "experts_route", "shared_partials", "combine",
           "SharedWeights", "fused_refusal"]


def silu(x: mx.array) -> mx.array:
    return x / (1.0 + mx.exp(-x))


# ---------------------------------------------------------------- MLX affine form of expert stacks


@dataclass(frozen=True, eq=False)
class ExpertStack:
    """n experts of one record layout in MLX's affine form, per projection (w, scales, biases).

    Shapes: gate/up w uint32 [n, F, D/16], scales/biases float32 [n, F, D/32]; down [n, D, F/16], [n, D, F/32]
    """

    gate: tuple[mx.array, mx.array, mx.array]
    up: tuple[mx.array, mx.array, mx.array]
    down: tuple[mx.array, mx.array, mx.array]
    bits: int
    group: int = GROUP
    mode: str = "affine"  # "mxfp4": scales uint8 e8m0, biases None
    expert_biases: tuple[mx.array, mx.array, mx.array] | None = None  # float32 gate [n, F], up [n, F], down [n, D]


def _with_expert_biases(stack: ExpertStack, records: mx.array, rec: RecordLayout) -> ExpertStack:
    """The stack with the records' bias planes as float32 views (records with biases only)."""
    if not rec.biases:
        return stack
    n = records.shape[0]
    planes = tuple(records[:, rec.bias(p).offset:rec.bias(p).end].view(mx.float32).reshape(n, -1) for p in PROJECTIONS)
    return ExpertStack(stack.gate, stack.up, stack.down, stack.bits, stack.group, stack.mode, planes)


def slot_planes(records: mx.array, rec: RecordLayout) -> ExpertStack:
    """The affine form of n arena records (uint8 [n, >= record_bytes]) of a Q2_0/Q4_0-free layout:
    only types whose codes plane is MLX's packing (Q2_0, MLX's own types) can be re-viewed without repacking."""
    if rec.qtype in NATIVE:
        return _with_expert_biases(native_slot_planes(records, rec), records, rec)
    if rec.qtype is not QuantType.Q2_0 or rec.mixed:
        raise ValueError(f"MLX's ops path reads Q2_0 or MLX's own expert types, not {rec.type_names} "
                         "(llama.cpp's types run on the GPU kernel, kernels/moe_ggml.py, or the numpy backend)")
    bits, _, bias = AFFINE[rec.qtype]
    n = records.shape[0]
    out = {}
    for proj in PROJECTIONS:
        rows, cols = rec.shape(proj)
        c, s = rec.codes(proj), rec.scales(proj)
        w = records[:, c.offset:c.end].view(mx.uint32).reshape(n, rows, cols * bits // 32)
        sc = records[:, s.offset:s.end].view(mx.float16).reshape(n, rows, cols // GROUP).astype(mx.float32)
        out[proj] = (w, sc, -float(bias) * sc)
    return _with_expert_biases(ExpertStack(out["gate"], out["up"], out["down"], bits), records, rec)


def native_slot_planes(records: mx.array, rec: RecordLayout) -> ExpertStack:
    """`slot_planes` for MLX's own types: views of the records, scales (and biases) as stored."""
    bits, group, mode = NATIVE[rec.qtype]
    n = records.shape[0]
    out = {}
    for proj in PROJECTIONS:
        rows, cols = rec.shape(proj)
        c, s = rec.codes(proj), rec.scales(proj)
        w = records[:, c.offset:c.end].view(mx.uint32).reshape(n, rows, cols * bits // 32)
        if has_biases(rec.qtype):  # the scales plane: all scales, then all biases
            half = s.offset + s.nbytes // 2
            sc = native_scale_view(rec.qtype, records[:, s.offset:half]).reshape(n, rows, cols // group)
            bi = native_scale_view(rec.qtype, records[:, half:s.end]).reshape(n, rows, cols // group)
        else:
            sc, bi = records[:, s.offset:s.end].reshape(n, rows, cols // group), None
        out[proj] = (w, sc, bi)
    return ExpertStack(out["gate"], out["up"], out["down"], bits, group, mode)


def stack_experts(experts: Sequence[ExpertWeights], rec: RecordLayout) -> tuple[mx.array, ExpertStack]:
    """Pack experts as arena records -> (records uint8 [n, padded_bytes], their affine form)."""
    buf = np.frombuffer(b"".join(pack_record(w, rec) for w in experts), np.uint8).reshape(len(experts), -1)
    records = mx.array(buf)
    return records, slot_planes(records, rec)


def _qmm(x: mx.array, wsb: tuple[mx.array, mx.array, mx.array], idx: mx.array, stack: ExpertStack) -> mx.array:
    if stack.mode == "mxfp4" and (why := native_refusal(QuantType.MXFP4, gather=True)) is not None:
        raise ConfigError(f"MLX experts: {why}")
    w, s, b = wsb
    return mx.gather_qmm(x, w, s, b, rhs_indices=idx, transpose=True, group_size=stack.group, bits=stack.bits,
                         mode=stack.mode)


def gated_hidden(act: ExpertAct, g: mx.array, u: mx.array) -> mx.array:
    """Twin of reference `gated_hidden`: the expert's hidden activation. g, u [.., F] -> [.., F]"""
    if act.kind is ExpertKind.SWIGLU:
        return silu(g) * u
    g = mx.minimum(g, act.limit)
    u = mx.clip(u, -act.limit, act.limit)
    return (u + 1.0) * (g * mx.sigmoid(g * act.alpha))


def _stack_partials(stack: ExpertStack, x: mx.array, idx: mx.array, weights: mx.array, valid: mx.array,
                    act: ExpertAct = SWIGLU) -> mx.array:
    """Ops path over an ExpertStack. x [T, D]; idx int [T, k] into the stack; weights [T, k];
    valid bool [T, k] -> partials [T, k, D]"""
    xe = x.astype(mx.float32)[:, None, None, :]  # [T, 1, 1, D]
    g = _qmm(xe, stack.gate, idx, stack)  # [T, k, 1, F]
    u = _qmm(xe, stack.up, idx, stack)
    b = stack.expert_biases
    if b is not None:  # each selected expert's bias, gathered by the same indices
        g, u = g + b[0][idx][:, :, None, :], u + b[1][idx][:, :, None, :]
    y = _qmm(gated_hidden(act, g, u), stack.down, idx, stack)[:, :, 0, :]  # [T, k, D]
    if b is not None:
        y = y + b[2][idx]
    return mx.where(valid[..., None], weights[..., None] * y, 0.0)


# ---------------------------------------------------------------- twins of strata.reference.experts


def swiglu_expert(w: ExpertWeights, x, act: ExpertAct = SWIGLU) -> mx.array:
    """Twin of reference `swiglu_expert`. x [D] or [T, D] -> like x"""
    x = mx.array(np.asarray(x, np.float32)) if not isinstance(x, mx.array) else x
    one = x.ndim == 1
    x2 = x.reshape(1, -1) if one else x
    t = x2.shape[0]
    y = routed_experts([w] * t, np.ones(t, np.float32), x2, act, per_token=True)
    return y.reshape(-1) if one else y


def routed_experts(experts: Sequence[ExpertWeights], weights, x, act: ExpertAct = SWIGLU, *,
                   per_token: bool = False) -> mx.array:
    """Twin of reference `routed_experts`: sum_i weight_i * expert_i(x) for one token [D] -> [D].
    (per_token: expert i applies to row i of x [k, D] -> [k, D]; used by `swiglu_expert`.)"""
    experts = list(experts)
    x = mx.array(np.asarray(x, np.float32)) if not isinstance(x, mx.array) else x.astype(mx.float32)
    w0 = experts[0]
    rec = RecordLayout(w0.qtype, w0.hidden, w0.expert_ffn, w0.biases is not None)
    records, _ = stack_experts(experts, rec)
    k = len(experts)
    wts = mx.array(np.asarray(weights, np.float32).reshape(1, k))
    if per_token:
        slots = mx.arange(k, dtype=mx.int32).reshape(k, 1)
        parts = routed_partials(records, rec, x, slots, wts.reshape(k, 1), act=act)
        return parts.sum(axis=1)
    parts = routed_partials(records, rec, x.reshape(1, -1), mx.arange(k, dtype=mx.int32).reshape(1, k), wts, act=act)
    return parts.sum(axis=1).reshape(-1)


@dataclass(frozen=True, eq=False)
class SharedWeights:
    """One layer's shared expert. gate/up [Fs, D], down [D, Fs] (float16 on the kernel path);
    gate_inp [D] or None."""

    gate: mx.array
    up: mx.array
    down: mx.array
    gate_inp: mx.array | None


def shared_expert(gate, up, down, gate_inp, x) -> mx.array:
    """Twin of reference `shared_expert`. x [D] or [T, D] -> like x"""
    arr = lambda a: a if isinstance(a, mx.array) else mx.array(np.asarray(a, np.float32))  # noqa: E731
    x = arr(x).astype(mx.float32)
    one = x.ndim == 1
    x2 = x.reshape(1, -1) if one else x
    sw = SharedWeights(arr(gate), arr(up), arr(down), None if gate_inp is None else arr(gate_inp))
    parts = shared_partials(x2, sw)
    y = combine(mx.zeros_like(x2), mx.zeros((x2.shape[0], 1, x2.shape[1]), mx.float32), parts, x2, sw.gate_inp)
    return y.reshape(-1) if one else y


# ---------------------------------------------------------------- public layer steps (choose a path)


def _kernel_path() -> bool:
    return current_path() is not KernelPath.OPS


def fused_refusal(rec: RecordLayout) -> str | None:
    """Why no fused expert kernel reads these records on a GPU (None: one does; the activation
    aside): Q2_0's (kernels/moe.py), MLX's own types' (moe_native.py), llama.cpp's (moe_ggml.py)."""
    if rec.qtype in moe_native.TYPES and not rec.mixed:
        return moe_native.supports(rec)
    if rec.qtype is QuantType.Q2_0 and not rec.mixed:
        if rec.biases or rec.hidden > moe.MAX_HIDDEN:
            return f"Q2_0 experts with biases or hidden over {moe.MAX_HIDDEN}"
        return None
    return moe_ggml.supports(rec)


def _routed_kernel_ok(rec: RecordLayout, act: ExpertAct = SWIGLU) -> bool:
    """A fused expert kernel runs these records (else the gather_qmm ops path): Q2_0's computes
    the plain SwiGLU without biases; the native one (MLX's types) also gpt-oss's experts."""
    if not _kernel_path():
        return False
    if rec.qtype in moe_native.TYPES:
        return moe_native.supports(rec) is None and act.kind in moe_native.ACT_KINDS
    if rec.qtype in moe_ggml.TYPES:
        return moe_ggml.supports(rec) is None and act.kind is ExpertKind.SWIGLU
    return (rec.qtype is QuantType.Q2_0 and rec.hidden <= moe.MAX_HIDDEN
            and not rec.biases and act.kind is ExpertKind.SWIGLU)


def _fused_slots(arena, rec: RecordLayout, x, slots, weights, act: ExpertAct, shared=None):
    if rec.qtype in moe_native.TYPES:
        return moe_native.moe_slots(arena, rec, x, slots, weights, act=act, shared=shared)
    if rec.qtype in moe_ggml.TYPES:
        return moe_ggml.moe_slots(arena, rec, x, slots, weights, shared=shared)
    return moe.moe_slots(arena, rec, x, slots, weights, shared=shared)


def _fused_route(arena, rec: RecordLayout, x, z, slot_base: int, rule: RouterRule, act: ExpertAct, shared=None):
    if rec.qtype in moe_native.TYPES:
        return moe_native.moe_route(arena, rec, x, z, slot_base, rule.k, rule.order, rule.norm_topk_prob, act=act,
                                    shared=shared)
    if rec.qtype in moe_ggml.TYPES:
        return moe_ggml.moe_route(arena, rec, x, z, slot_base, rule.k, rule.order, rule.norm_topk_prob, shared=shared)
    return moe.moe_route(arena, rec, x, z, slot_base, rule.k, rule.order, rule.norm_topk_prob, shared=shared)


def _shared_kernel_ok(sw: SharedWeights, hidden: int) -> bool:
    """The shared-expert block body runs these weights (alone or in the routed launch)."""
    return _kernel_path() and sw.gate.dtype == mx.float16 and hidden % 8 == 0 and hidden <= shared_kernel.MAX_HIDDEN


def routed_partials(arena: mx.array, rec: RecordLayout, x: mx.array, slots, weights, *,
                    act: ExpertAct = SWIGLU) -> mx.array:
    """The routed experts of T tokens from arena slots.

    Shapes:
        arena uint8 [S, SLOT]; x float32 [T, D]; slots int [T, k] (-1: skip); weights float32 [T, k]
        -> partials float32 [T, P, D] (sum over P = sum_i w_i expert_i(x_t))
    """
    if slots.shape[1] == 0:  # every selection dropped (drop-tail)
        return mx.zeros((x.shape[0], 1, x.shape[1]), mx.float32)
    if _routed_kernel_ok(rec, act):
        return _fused_slots(arena, rec, x, slots, weights, act)
    slots_mx = slots if isinstance(slots, mx.array) else mx.array(np.asarray(slots, np.int32))
    w_mx = weights if isinstance(weights, mx.array) else mx.array(np.asarray(weights, np.float32))
    if isinstance(slots, np.ndarray):  # host slots: gather each distinct slot once
        s = np.asarray(slots)
        uniq, inv = np.unique(np.where(s >= 0, s, -1), return_inverse=True)
        keep = uniq >= 0
        used = uniq[keep] if keep.any() else np.zeros(1, np.int64)
        remap = np.cumsum(keep) - 1  # index into `used`
        idx = np.where(s >= 0, remap[inv.reshape(s.shape)], 0)
        records = mx.take(arena, mx.array(used.astype(np.int32)), axis=0)
        return _stack_partials(slot_planes(records, rec), x, mx.array(idx.astype(np.int32)), w_mx,
                               mx.array(s >= 0), act)
    valid = slots_mx >= 0
    t, k = slots_mx.shape
    records = mx.take(arena, mx.where(valid, slots_mx, 0).reshape(-1), axis=0)  # [T*k, SLOT]
    idx = mx.arange(t * k, dtype=mx.int32).reshape(t, k)
    return _stack_partials(slot_planes(records, rec), x, idx, w_mx, valid, act)


def routed_partials_route(arena: mx.array, rec: RecordLayout, stack: ExpertStack | None, x: mx.array,
                          z: mx.array, slot_base: int, rule: RouterRule, act: ExpertAct = SWIGLU) -> mx.array:
    """Route on the device (the model's own rule) and run the selected experts, every expert of
    the layer resident (arena slot slot_base + e, or `stack` index e on the ops path).

    Shapes:
        x float32 [T, D]; z float32 [T, E] -> partials float32 [T, P, D]
    """
    if _routed_kernel_ok(rec, act) and moe.routes_on_kernel(rule):
        return _fused_route(arena, rec, x, z, slot_base, rule, act)
    experts, weights, _, _ = select_device(z, rule, None, None, 0.0)  # MLX ops, still on the device
    if stack is None:
        return routed_partials(arena, rec, x, experts + slot_base, weights, act=act)
    return _stack_partials(stack, x, experts, weights, mx.ones(experts.shape, mx.bool_), act)


def experts_route(arena: mx.array, rec: RecordLayout, x: mx.array, z: mx.array, slot_base: int, rule: RouterRule,
                  shared: SharedWeights | None, act: ExpertAct = SWIGLU) -> tuple[mx.array, mx.array | None]:
    """The routed experts (routing on the device, every expert resident) and the shared expert
    of a layer. Kernel path: one launch for both (the shared expert's blocks ride in the routed
    kernel's grid); else the two steps apart.

    Shapes:
        x float32 [T, D]; z float32 [T, E] -> (routed partials [T, P, D], shared partials [T, PS, D] or None)
    """
    if shared is not None and _routed_kernel_ok(rec, act) and moe.routes_on_kernel(rule) and _shared_kernel_ok(shared, rec.hidden):
        return _fused_route(arena, rec, x, z, slot_base, rule, act, shared=(shared.gate, shared.up, shared.down))
    routed = routed_partials_route(arena, rec, None, x, z, slot_base, rule, act)
    return routed, (shared_partials(x, shared) if shared is not None else None)


def shared_partials(x: mx.array, sw: SharedWeights) -> mx.array:
    """The shared expert's output without its gate, as partials. x [T, D] -> [T, P, D]"""
    if _shared_kernel_ok(sw, x.shape[1]):
        return shared_kernel.shared_partials(x, sw.gate, sw.up, sw.down)
    x = x.astype(mx.float32)
    h = silu(linear(x, sw.gate)) * linear(x, sw.up)  # weights as stored, widened per op (dense.py)
    return linear(h, sw.down)[:, None, :]


def combine(x: mx.array, routed: mx.array, shared: mx.array | None, h: mx.array, gate_inp: mx.array | None) -> mx.array:
    """x + (sum routed + sigmoid(gate_inp . h) * sum shared). routed [T, P, D], shared [T, PS, D] or None."""
    if _kernel_path() and (gate_inp is None or gate_inp.dtype == mx.float16):
        return combine_kernel.combine(x, routed, shared, h, gate_inp)
    r = routed.sum(axis=1)
    if shared is None:
        return x + r
    s = shared.sum(axis=1)
    if gate_inp is not None:
        s = s * mx.sigmoid(h.astype(mx.float32) @ gate_inp.astype(mx.float32))[:, None]
    return x + (r + s)
