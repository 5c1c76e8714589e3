"""The twin table (STYLE §1): each reference function and its MLX twin, by name.

The differential tests (tests/mlx_backend/test_mlx_twins.py) iterate over `TWINS`; each entry names the error
budget its comparison uses (tests/mlx_agree.py). A twin shares its reference's name and argument
order; where the MLX side holds weights differently (MlxParams, MlxLayerKV), `adapt` in the test
builds them from the reference's inputs.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Callable

from strata.mlx_backend import attention as mlx_attention
from strata.mlx_backend import deltanet as mlx_deltanet
from strata.mlx_backend import experts as mlx_experts
from strata.mlx_backend import mla as mlx_mla
from strata.mlx_backend import model as mlx_model
from strata.mlx_backend import quants as mlx_quants
from strata.mlx_backend import routing as mlx_routing
from strata.reference import attention as ref_attention
from strata.reference import deltanet as ref_deltanet
from strata.reference import experts as ref_experts
from strata.reference import mla as ref_mla
from strata.reference import model as ref_model
from strata.reference import quants as ref_quants
from strata.reference import routing as ref_routing


@dataclass(frozen=True)
class Twin:
    name: str  # module.function, the same on both sides
    reference: Callable
    fast: Callable
    budget: str  # EXACT, FAST, FORWARD or ROUTING (tests/mlx_agree.py)
    kernel: bool  # has a custom-kernel path (runs on the GPU and emulated paths too)


TWINS: tuple[Twin, ...] = (
    Twin("quants.dequantize", ref_quants.dequantize, mlx_quants.dequantize, "EXACT", False),
    Twin("quants.gemv", ref_quants.gemv, mlx_quants.gemv, "FAST", True),
    Twin("routing.route", ref_routing.route, mlx_routing.route, "ROUTING", False),
    Twin("routing.router_logits", ref_routing.router_logits, mlx_routing.router_logits, "FAST", False),
    Twin("attention.rms_norm", ref_attention.rms_norm, mlx_attention.rms_norm, "FAST", False),
    Twin("experts.swiglu_expert", ref_experts.swiglu_expert, mlx_experts.swiglu_expert, "FAST", True),
    Twin("experts.routed_experts", ref_experts.routed_experts, mlx_experts.routed_experts, "FAST", True),
    Twin("experts.shared_expert", ref_experts.shared_expert, mlx_experts.shared_expert, "FAST", True),
    Twin("attention.softmax_with_sinks", ref_attention.softmax_with_sinks, mlx_attention.softmax_with_sinks, "FAST",
         False),
    Twin("experts.gated_hidden", ref_experts.gated_hidden, mlx_experts.gated_hidden, "FAST", False),
    Twin("mla.mla", ref_mla.mla, mlx_mla.mla, "FAST", True),  # decoded positions: the MLA kernels
    Twin("model.embed", ref_model.embed, mlx_model.embed, "EXACT", True),
    Twin("model.attention_block", ref_model.attention_block, mlx_model.attention_block, "FAST", True),
    Twin("model.head", ref_model.head, mlx_model.head, "FAST", True),
    Twin("model.forward", ref_model.forward, mlx_model.forward, "FORWARD", True),
    Twin("deltanet.output_gate", ref_deltanet.output_gate, mlx_deltanet.output_gate, "FAST", False),
)

BY_NAME = {t.name: t for t in TWINS}
assert len(BY_NAME) == len(TWINS)
