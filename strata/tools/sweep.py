"""The reference engine's policy table (§1.1): for each MoCE (J, λ), urgent misses against quality.

Per policy: urgent misses per token from the closed-loop replay of the λ = 0 trace (the reference engine's
number) and from the decode-order run itself (hidden-state drift included), the routed-output
relMSE / rel-L2 and the KLD vs λ = 0 (`strata.tools.quality`). λ = 0 is one row whatever J
(J only matters with a bonus). The reference run and the trace are computed once.
"""

from __future__ import annotations

import csv
from dataclasses import dataclass, replace
from pathlib import Path

import numpy as np

from strata.numpy_backend.quant_kernels import REFERENCE_OPS, CpuOps
from strata.reference.model import ModelParams
from strata.reference.routing import STOCK_BONUS, STOCK_J, MoCEPolicy
from strata.tools.closed_loop import LoopConfig
from strata.tools.quality import QualityResult, fast_params, quality, run_decode
from strata.tools.replay import ReplayInputs, ReplayResult, replay
from strata.tools.trace import record_trace

__all__ = ["SweepRow", "policy_sweep", "write_csv", "CSV_COLUMNS"]

CSV_COLUMNS = ("J", "lambda", "label", "urgent_per_token", "delta_vs_stock", "urgent_per_token_decode",
               "readahead_hits_per_token", "reads_per_token", "relmse", "rel_l2", "kld_mean", "kld_p90",
               "kld_p99", "kld_max", "ppl", "ppl_ref", "changed_fraction")


@dataclass(frozen=True)
class SweepRow:
    J: int | None  # None for λ = 0
    lam: float
    replayed: ReplayResult
    scored: QualityResult

    @property
    def label(self) -> str:
        return "λ0" if self.J is None else f"J{self.J} λ{self.lam:g}"

    def to_dict(self) -> dict:
        q, r = self.scored, self.replayed
        return {
            "J": "" if self.J is None else self.J, "lambda": self.lam, "label": self.label,
            "urgent_per_token": r.urgent_per_token, "delta_vs_stock": float("nan"),
            "urgent_per_token_decode": q.urgent_per_token,
            "readahead_hits_per_token": r.readahead_hits_per_token, "reads_per_token": r.reads_per_token,
            "relmse": q.relmse, "rel_l2": q.rel_l2, "kld_mean": q.kld_mean, "kld_p90": q.kld_p90,
            "kld_p99": q.kld_p99, "kld_max": q.kld_max, "ppl": q.ppl, "ppl_ref": q.ppl_ref,
            "changed_fraction": q.changed_fraction,
        }


def _grid(js, lambdas) -> list[tuple[int | None, float]]:
    out: list[tuple[int | None, float]] = []
    if any(float(lam) == 0 for lam in lambdas):
        out.append((None, 0.0))
    out += [(int(j), float(lam)) for lam in lambdas if float(lam) != 0 for j in js]
    return out


def policy_sweep(params: ModelParams, tokens, js=(1, 2, 3), lambdas=(0.0, 0.5, 0.85, 1.5), *,
                 base: LoopConfig, warmup: int = 0, progress=None, ops: CpuOps = REFERENCE_OPS) -> list[dict]:
    """One row (a dict with CSV_COLUMNS) per (J, λ); `base` gives the arena and read-ahead
    (its policy is replaced). `progress(label)` before each policy. ops: the products
    (strata.tools.quality)."""
    params = fast_params(params)
    tokens = np.asarray(tokens, np.int64)
    inputs = ReplayInputs(record_trace(params, tokens, ops=ops))
    ref = run_decode(params, tokens, ops=ops)
    rows = []
    for j, lam in _grid(js, lambdas):
        policy = MoCEPolicy(bonus=0.0) if j is None else replace(
            base.policy or MoCEPolicy(), protect_top_j=j, bonus=lam)
        config = replace(base, policy=policy)
        if progress is not None:
            progress(config.label)
        row = SweepRow(j, lam, replay(inputs, config, warmup=warmup),
                       quality(params, tokens, config, warmup=warmup, reference=ref, ops=ops))
        rows.append(row.to_dict())
    stock = [r for r in rows if r["J"] == STOCK_J and r["lambda"] == STOCK_BONUS]
    for r in rows:
        if stock and stock[0]["urgent_per_token"] > 0:
            r["delta_vs_stock"] = r["urgent_per_token"] / stock[0]["urgent_per_token"] - 1.0
    return rows


def write_csv(rows: list[dict], path: str | Path) -> Path:
    path = Path(path)
    path.parent.mkdir(parents=True, exist_ok=True)
    with open(path, "w", newline="") as f:
        w = csv.DictWriter(f, fieldnames=CSV_COLUMNS)
        w.writeheader()
        for r in rows:
            w.writerow({k: r[k] for k in CSV_COLUMNS})
    return path
