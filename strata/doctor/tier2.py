"""The doctor's answer for a checkpoint directory that runs as it is on tier 2 (strata.tier2).

The plan is the tier-2 engine's own (strata.tier2.plan): the checkpoint's layout read lazily
(mlx-lm's model built without reading a weight, the experts located in the shards' headers) and
the runtime's budget rule over its slot geometry, with the memory the engine will see at start
(today's available less the measured base process and the dense weights mlx-lm holds). So the
arena, the refusals and `--arena` / `--keep` behave as in a tier-2 run.

There is no decode-time prediction for tier 2: the doctor's timing model is fitted on strata's
own engines (their kernels, turns and reads), while tier 2 computes with mlx-lm's model file;
`benchmarks/tier2.py DIR` measures it.
"""

from __future__ import annotations

from dataclasses import asdict, dataclass
from pathlib import Path

from strata.errors import StrataError
from strata.runtime.budget import ArenaPlan, fmt_bytes
from strata.runtime.memory import MemoryInfo

__all__ = ["Tier2Diagnosis", "diagnose_tier2", "NO_PREDICTION"]

NO_PREDICTION = ("none for tier 2: the doctor's timing model is fitted on strata's own engines, and tier 2 "
                 "computes with mlx-lm's model file (`benchmarks/tier2.py DIR` measures it)")


@dataclass(frozen=True)
class Tier2Diagnosis:
    """What tier 2 would do with the directory here. verdict: "fits resident", "streams",
    "will not run" (the plan refused: `refusal`) or "not supported" (tier 2 cannot run it: `why`)."""

    verdict: str
    summary: str
    why: str  # the tier line: which tier and why
    model_type: str = ""
    moe_layers: int = 0
    n_experts: int = 0
    top_k: int = 0
    record_bytes: int = 0  # one expert as stored, all pieces
    slot_bytes: int = 0
    pieces: int = 0
    dense_bytes: int = 0  # the parameters mlx-lm holds resident
    arena_slots: int = 0  # 0: every expert resident (a slot each)
    min_slots: int = 0
    plan_reason: str = ""
    refusal: str = ""
    available: int = 0  # the machine's available memory now
    available_at_engine_start: int = 0  # less the base process and the dense weights: what the plan had
    memory_at_start: int = 0  # base process + dense + arena (or every expert); mlx-lm's KV cache comes on top
    prediction: str = NO_PREDICTION

    @property
    def runs(self) -> bool:
        return self.verdict in ("fits resident", "streams")

    def lines(self) -> list[str]:
        if not self.model_type:
            return [f"verdict (tier 2): {self.summary}"]
        out = [f"tier 2 reads the checkpoint as stored: {self.moe_layers} MoE layers x {self.n_experts} experts "
               f"top-{self.top_k}; one expert {fmt_bytes(self.record_bytes)} in {self.pieces} pieces, slot "
               f"{fmt_bytes(self.slot_bytes)}; dense {fmt_bytes(self.dense_bytes)} as mlx-lm holds it"]
        if self.verdict == "streams":
            out.append(f"arena (tier 2): {self.arena_slots} slots ({fmt_bytes(self.arena_slots * self.slot_bytes)}; "
                       f"at least {self.min_slots}) from {self.plan_reason}")
        elif self.verdict == "fits resident":
            out.append(f"arena (tier 2): a slot per expert ({self.plan_reason})")
        if self.runs:
            out.append(f"memory (tier 2): {fmt_bytes(self.memory_at_start)} at engine start (base process, dense, "
                       f"experts) of {fmt_bytes(self.available)} available now; mlx-lm's KV cache grows on top")
        out.append(f"predicted decode: {self.prediction}")
        out.append(f"verdict: {self.summary}")
        return out

    def to_dict(self) -> dict:
        return asdict(self)


def diagnose_tier2(directory: Path, *, config, memory: MemoryInfo, base_rss: int, why: str) -> Tier2Diagnosis:
    """The tier-2 plan for `directory` (a checkpoint directory mlx-lm has a model file for, with
    mlx-lm importable at the pinned version). `why`: the tier line."""
    from strata.tier2.engine import check_tier2_config
    from strata.tier2.plan import arena_plan, checkpoint_layout

    try:
        layout = checkpoint_layout(directory)
    except StrataError as e:
        return Tier2Diagnosis("not supported", f"not supported on tier 2: {e}", why)
    t = layout.tensors
    after_load = memory.available - base_rss - layout.dense_bytes
    shape = dict(model_type=layout.model_type, moe_layers=t.n_layers, n_experts=t.n_experts, top_k=layout.top_k,
                 record_bytes=t.record_bytes, slot_bytes=t.slot_bytes, pieces=len(t.pieces),
                 dense_bytes=layout.dense_bytes, available=memory.available, available_at_engine_start=after_load)
    try:
        check_tier2_config(config, layout.model_type)
        plan: ArenaPlan = arena_plan(tensors=t, top_k=layout.top_k, dense_bytes=layout.dense_bytes, config=config,
                                     available=after_load, total=memory.total)
    except StrataError as e:
        return Tier2Diagnosis("will not run", f"will not run on tier 2: {e}", why, refusal=str(e), **shape)
    held = plan.slots if plan.streaming else t.n_records
    at_start = base_rss + layout.dense_bytes + held * t.slot_bytes
    if plan.streaming:
        verdict = "streams"
        summary = (f"streams on tier 2 ({plan.slots} of {t.n_records} experts in the arena, "
                   f"{100 * plan.slots / t.n_records:.0f}%)")
    else:
        verdict, summary = "fits resident", f"fits resident on tier 2 (all {t.n_records} experts)"
    return Tier2Diagnosis(verdict, summary, why, arena_slots=plan.slots if plan.streaming else 0,
                          min_slots=plan.min_slots, plan_reason=plan.reason, memory_at_start=at_start, **shape)
