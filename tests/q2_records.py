"""The small Q2_0 expert layer the grouped-GEMM kernel tests share (test_mlx_q2_mma.py,
test_mlx_q2_tiles.py): 5 made experts of hidden 64 / ffn 96 stacked as arena records."""

from __future__ import annotations

from dataclasses import replace

from strata.formats.expert_record import RecordLayout
from strata.formats.quant_types import QuantType
from strata.mlx_backend.experts import stack_experts
from strata.testing.models import SHAPES, make_expert

CFG = replace(SHAPES["tiny"], hidden_size=64, expert_ffn_size=96, n_experts=5)


def q2_records():
    """(layout, the made experts, their records uint8 [E, SLOT])."""
    rec = RecordLayout(QuantType.Q2_0, CFG.hidden_size, CFG.expert_ffn_size)
    experts = [make_expert(CFG, 0, 0, e, QuantType.Q2_0) for e in range(CFG.n_experts)]
    records, _ = stack_experts(experts, rec)
    return rec, experts, records
