"""A decoded token's routed experts and the layer's combine as two launches (kernels/moe_decode.py),
where they apply: the all-resident engine's routing on the device, few tokens, Q2_0 records,
a softmax rule, the shared expert (if any) on float16 weights (its blocks ride in the gate/up
launch, its partials and gate are added by the down launch). Elsewhere the fused kernel and the
combine launch run (experts.experts_route, experts.combine).

The launch count per layer is the same (experts + combine -> gate/up + down); what changes is the
GPU time: no 1.8 MB of partials written and read back, every gate/up load of a block in flight at
once (the fused kernel waited on DRAM five times a block at one token): ncu on the H200 timed the
fused pair at ~31 us a decoded layer for 13.8 MB of records; the two launches are predicted at
~11 us (kernels/moe_decode.py says why).
"""

from __future__ import annotations

import mlx.core as mx

from strata.formats.expert_record import RecordLayout
from strata.mlx_backend.experts import SharedWeights
from strata.mlx_backend.kernels import moe, moe_decode
from strata.mlx_backend.kernels import shared as shared_kernel
from strata.mlx_backend.kernels.launch import KernelPath, current_path
from strata.model_config import ExpertKind
from strata.reference.experts import ExpertAct
from strata.reference.routing import RouterRule

__all__ = ["MAX_TOKENS", "applies", "routed_residual"]

# up to this many tokens a launch; from moe.MANY_TOKENS the fused kernel's FC = 64 shape reads
# each record's down planes in fewer L2 sectors and is the measured choice
MAX_TOKENS = moe.MANY_TOKENS - 1


def applies(rec: RecordLayout | None, rule: RouterRule | None, shared: SharedWeights | None, act: ExpertAct,
            tokens: int) -> bool:
    """Whether `routed_residual` serves this layer's routed step on the current path."""
    return (current_path() is not KernelPath.OPS and rec is not None and rule is not None
            and (shared is None or _shared_ok(shared, rec.hidden)) and act.kind is ExpertKind.SWIGLU
            and 1 <= tokens <= MAX_TOKENS and moe.routes_on_kernel(rule) and moe_decode.applies(rec, rule.k))


def _shared_ok(sw: SharedWeights, hidden: int) -> bool:
    return (all(a.dtype == mx.float16 for a in (sw.gate, sw.up, sw.down)) and hidden % 8 == 0
            and hidden <= shared_kernel.MAX_HIDDEN and (sw.gate_inp is None or sw.gate_inp.dtype == mx.float16))


def routed_residual(arena: mx.array, rec: RecordLayout, x_mid: mx.array, h: mx.array, z: mx.array, slot_base: int,
                    rule: RouterRule, shared: SharedWeights | None = None) -> mx.array:
    """x_mid + sum_i w_i expert_i(h) (+ the shared expert of h, times sigmoid(gate_inp . h) where
    gated), the experts chosen from z by the model's rule, every expert of the layer resident at
    arena slot slot_base + e (the twin of experts_route + combine).

    Shapes:
        x_mid float32 [T, D], h float32 [T, D], z float32 [T, E] -> float32 [T, D]
    """
    sh = None if shared is None else (shared.gate, shared.up, shared.down, shared.gate_inp)
    return moe_decode.routed_residual(arena, rec, x_mid, h, z, slot_base, rule.k, rule.order, rule.norm_topk_prob,
                                      shared=sh)
