"""Per-stage stream reports merged into one (docs/pipeline.md).

Each stage keeps its own runtime report (its cache's misses, bytes, waits; strata.runtime.
report) and its hand-off figures: compute (its layers), the time it waited for the previous
stage (rank 0: for the last stage, i.e. the rest of the pipeline), the time and bytes it sent.
A REPORT round gathers every stage's record as JSON; `PipelineReport` is their merge: one line
per stage, and per decoded token the pipeline's time (rank 0's compute + send + wait) and the
hand-off bytes over every hop.
"""

from __future__ import annotations

import dataclasses
import json
from dataclasses import dataclass, field

from strata.sizes import fmt_bytes

__all__ = ["StageTotals", "StageReport", "PipelineReport", "stage_record"]


@dataclass(frozen=True)
class StageTotals:
    """A stage's running hand-off totals (decode windows and prompts apart) and its engine's
    ledger at the moment they were taken."""

    ledger: object = None
    decode_compute_s: float = 0.0
    decode_wait_s: float = 0.0
    decode_send_s: float = 0.0
    decode_sent: int = 0
    prompt_compute_s: float = 0.0
    prompt_wait_s: float = 0.0
    prompt_send_s: float = 0.0
    prompt_sent: int = 0

    def plus(self, decode: bool, *, compute_s: float, wait_s: float, send_s: float, sent: int) -> "StageTotals":
        p = "decode_" if decode else "prompt_"
        return dataclasses.replace(self, **{
            p + "compute_s": getattr(self, p + "compute_s") + compute_s,
            p + "wait_s": getattr(self, p + "wait_s") + wait_s,
            p + "send_s": getattr(self, p + "send_s") + send_s,
            p + "sent": getattr(self, p + "sent") + sent})

    def at(self, ledger) -> "StageTotals":
        return dataclasses.replace(self, ledger=ledger)

    def minus(self, other: "StageTotals | None") -> "StageTotals":
        if other is None:
            return self
        return StageTotals(self.ledger, **{f.name: getattr(self, f.name) - getattr(other, f.name)
                                          for f in dataclasses.fields(self) if f.name != "ledger"})


@dataclass(frozen=True)
class StageReport:
    """One stage since a mark. Per decoded token: compute, waiting for the previous stage, the
    send of its output (time and bytes); `stream` is its runtime StreamReport as a dict."""

    rank: int
    layers: tuple[int, int]  # [start, stop)
    moe_layers: int
    tokens: int
    compute_ms: float
    prev_wait_ms: float
    send_ms: float
    sent_bytes: float
    prompt_sent_bytes: int
    stream: dict = field(default_factory=dict, repr=False)

    def text(self) -> str:
        s = self.stream
        return (f"stage {self.rank} (layers {self.layers[0]}-{self.layers[1] - 1}, {self.moe_layers} MoE): "
                f"urgent misses {s['urgent_misses_per_token']:.2f}/token, reads {fmt_bytes(s['bytes_per_token'])}/token, "
                f"cache wait {s['waiting_ms_per_window']:.2f} ms, compute {self.compute_ms:.2f} ms, waiting for the "
                f"previous stage {self.prev_wait_ms:.2f} ms, sent {fmt_bytes(self.sent_bytes)} in {self.send_ms:.2f} ms "
                f"per token; arena {s['arena_slots']} slots ({fmt_bytes(s['arena_bytes'])})")


def stage_record(rank: int, engine, now: StageTotals, since: StageTotals | None) -> dict:
    """The JSON-able record of `engine`'s stage since `since` (None: its life)."""
    d = now.minus(since)
    stream = engine.report(since=since.ledger if since is not None else None)
    n = stream.tokens or 1  # per decoded token (0 tokens: the sums are 0 too)
    per = 1e3 / n
    return dataclasses.asdict(StageReport(
        rank=rank, layers=(engine.stage.start, engine.stage.stop), moe_layers=len(engine.moe_layers),
        tokens=stream.tokens, compute_ms=d.decode_compute_s * per, prev_wait_ms=d.decode_wait_s * per,
        send_ms=d.decode_send_s * per, sent_bytes=d.decode_sent / n, prompt_sent_bytes=d.prompt_sent,
        stream=stream.to_dict()))


@dataclass(frozen=True)
class PipelineReport:
    """Every stage's report, in rank order, and the pipeline's per-token figures."""

    stages: tuple[StageReport, ...]

    @staticmethod
    def from_records(records: list[dict]) -> "PipelineReport":
        rows = sorted((StageReport(**{**r, "layers": tuple(r["layers"])}) for r in records), key=lambda s: s.rank)
        return PipelineReport(tuple(rows))

    @property
    def tokens(self) -> int:
        return self.stages[0].tokens

    @property
    def ms_per_token(self) -> float:
        """Rank 0's time per decoded token: its layers, its send, its wait for the rest."""
        s = self.stages[0]
        return s.compute_ms + s.send_ms + s.prev_wait_ms

    @property
    def handoff_bytes_per_token(self) -> float:
        """Bytes every hop together carries per decoded token (hidden states and the logits)."""
        return sum(s.sent_bytes for s in self.stages)

    @property
    def urgent_misses_per_token(self) -> float:
        return sum(s.stream["urgent_misses_per_token"] for s in self.stages)

    def text(self) -> str:
        head = (f"pipeline: {len(self.stages)} stages, {self.tokens} tokens, {self.ms_per_token:.2f} ms/token; "
                f"urgent misses {self.urgent_misses_per_token:.2f}/token; hand-off "
                f"{fmt_bytes(self.handoff_bytes_per_token)}/token over {len(self.stages)} hops")
        return "\n".join([head] + ["  " + s.text() for s in self.stages])

    def to_dict(self) -> dict:
        return {"pipeline": True, "tokens": self.tokens, "ms_per_token": self.ms_per_token,
                "handoff_bytes_per_token": self.handoff_bytes_per_token,
                "urgent_misses_per_token": self.urgent_misses_per_token,
                "stages": [dataclasses.asdict(s) for s in self.stages]}

    def to_json(self) -> str:
        return json.dumps(self.to_dict(), sort_keys=True)
