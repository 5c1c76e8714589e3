"""strata's own engine costs from the probe's engine runs, and the refit of a stored profile.

The probe (probe.py) runs a made model (`tiny` shape, CALIBRATION_LAYERS layers of
CALIBRATION_EXPERTS experts) all-resident at top-k and top-1 and streaming at several arenas;
`fit_engine` turns those runs into the profile's engine fields:

- `expert_call_s`: (resident top-k − resident top-1) / (L · (k − 1)), the engine's own cost per
  routed expert at the calibration record size;
- `layer_s`: what the ops (gemv / expert / widening tables) and the token's one host round trip
  (`sync_s`, MLX) leave of the resident run, per layer;
- `miss_s`: the reports' wait per urgent miss;
- `turn_s`, `turn_slot_s`, `read_s`: non-negative least squares on what the waits leave of the
  streaming runs (`fit_streaming`);
- `base_rss`: the resident run's peak less the model's bytes, as predict.py counts a peak.

Every time is per decode call after the warm-up steps (`RunMeasurement.steady_tps`): the first
steps of an MLX process compile kernels, and on the H200 a quick probe that timed its runs by
their mean (first steps included) put 1.36 ms of turn per MoE layer where the validated small
model's steady runs showed about 0.95. The runs are kept in the profile (`calibration`), so
`refit(profile)` recomputes the fields with this file's code from what was measured then, on
any machine (benchmarks/doctor_validate.py --replay).
"""

from __future__ import annotations

import dataclasses
from dataclasses import dataclass

import numpy as np

__all__ = ["EngineCosts", "fit_engine", "fit_streaming", "token_s", "calibration_config", "refit",
           "CALIBRATION_LAYERS", "CALIBRATION_EXPERTS"]

CALIBRATION_LAYERS = 6
CALIBRATION_EXPERTS = 64  # 384 slots over 6 layers: arenas from the smallest legal one (44) to all


def calibration_config(top_k: int | None = None):
    """The probe's made model's ModelConfig (as `make_model(..., "tiny", n_layers=..., n_experts=...)`)."""
    from strata.testing.models import SHAPES

    cfg = dataclasses.replace(SHAPES["tiny"], n_layers=CALIBRATION_LAYERS, n_experts=CALIBRATION_EXPERTS)
    return dataclasses.replace(cfg, n_experts_per_token=top_k) if top_k else cfg


@dataclass(frozen=True)
class EngineCosts:
    expert_call_s: float
    layer_s: float
    turn_s: float
    turn_slot_s: float
    read_s: float
    miss_s: float
    base_rss: int


def token_s(run) -> float:
    """Mean seconds per decode call after the warm-up steps (`RunMeasurement.steady_tps`), else
    the stream report's mean, else tokens / decode time (a run measured before steady rates)."""
    if run.steady_tps:
        return 1.0 / run.steady_tps
    if run.report:
        return run.report["ms_per_token"] / 1e3
    return 1.0 / run.decode_tps if run.decode_tps else 0.0


def counts(run) -> tuple[float, float, float]:
    """(urgent misses, reads, seconds waited on urgent reads) per decode call, over the steps
    `token_s` times where measured (the wait per miss is the report's: it has no per-step figure)."""
    rep = run.report
    wait = rep["waiting_ms_per_window"] / 1e3
    if run.steady_tps:
        per_miss = wait / rep["urgent_misses_per_token"] if rep["urgent_misses_per_token"] else 0.0
        return run.steady_urgent, run.steady_reads, run.steady_urgent * per_miss
    return rep["urgent_misses_per_token"], rep["reads_per_token"], wait


def fit_streaming(runs: dict, resident_s: float, n_layers: int, fallback_miss_s: float):
    """(turn_s, turn_slot_s, read_s, miss_s) from the streaming runs (capacity -> run).

    miss_s is the measured wait per urgent miss (the reports' waiting time / urgent misses,
    over the runs that missed); the rest by non-negative least squares on what the waits do
    not explain: per decode call
        t - resident - urgent * miss_s = L * (turn_s + turn_slot_s * slots) + reads * read_s.
    Non-negative as a whole, not clipped one by one: clipping a negative coefficient of an
    unconstrained fit leaves the others fitted beside it."""
    from scipy.optimize import nnls

    c = {slots: counts(r) for slots, r in runs.items()}
    urgent = sum(u for u, _, _ in c.values())
    miss_s = sum(w for _, _, w in c.values()) / urgent if urgent > 0 else fallback_miss_s
    rows, ys = [], []
    for slots, r in runs.items():
        u, reads, _ = c[slots]
        rows.append([n_layers, n_layers * slots, reads])
        ys.append(token_s(r) - resident_s - u * miss_s)
    coef, _ = nnls(np.array(rows, float), np.array(ys, float))
    turn, per_slot, read = (float(x) for x in coef)
    return turn, per_slot, read, miss_s


def fit_engine(runs: dict, *, cfg, slot_bytes: int, record_bytes: int, gemv, expert, widen: dict, sync_s: float,
               backend: str, gpu: bool, fallback_miss_s: float) -> EngineCosts:
    """The engine fields (module docstring) from `runs`: "resident", "top1" and capacity -> run."""
    from strata.doctor.byte_budget import byte_budget
    from strata.doctor.families import count_strata
    from strata.doctor.predict import dense_held, ops_seconds
    from strata.doctor.probe import placeholder_profile

    streaming = {s: r for s, r in runs.items() if isinstance(s, int)}
    resident, top1 = runs["resident"], runs["top1"]
    n = count_strata(cfg)
    budget = byte_budget(n, slot_bytes=slot_bytes)
    resident_s = token_s(resident)
    L, k = cfg.n_layers, cfg.n_experts_per_token
    # the engine's own cost per routed expert at the calibration size: top-k vs top-1, the rest equal
    expert_call_s = max(0.0, (resident_s - token_s(top1)) / (L * (k - 1)))
    partial = placeholder_profile(gemv=gemv, expert=expert, expert_call_s=expert_call_s,
                                  calibration_record_bytes=record_bytes, widen=widen)
    layer_s = max(0.0, (resident_s - sync_s - ops_seconds(n, budget, partial)) / L)
    turn_s, turn_slot_s, read_s, miss_s = fit_streaming(streaming, resident_s, L, fallback_miss_s)
    base = max(0, resident.peak_rss - dense_held(budget, backend, gpu=gpu) - budget.experts_resident)
    return EngineCosts(expert_call_s=expert_call_s, layer_s=layer_s, turn_s=turn_s, turn_slot_s=turn_slot_s,
                       read_s=read_s, miss_s=miss_s, base_rss=base)


def stored_runs(calibration: dict) -> dict:
    """A profile's `calibration` (case name -> RunMeasurement dict) as fit_engine's runs."""
    from strata.doctor.measure import RunMeasurement

    out = {}
    for name, d in calibration.items():
        key = int(name.removesuffix("slots")) if name.endswith("slots") else name
        out[key] = RunMeasurement(**d)
    return out


def refit(profile):
    """`profile` with its engine fields fitted again, by this file's code, from the runs it keeps."""
    if not profile.calibration:
        raise ValueError("this profile keeps no engine runs (measured before profile version 6): remeasure")
    costs = fit_engine(stored_runs(profile.calibration), cfg=calibration_config(),
                       slot_bytes=profile.calibration_slot_bytes, record_bytes=profile.calibration_record_bytes,
                       gemv=profile.gemv, expert=profile.expert, widen=profile.widen, sync_s=profile.sync_s,
                       backend=profile.backend,
                       gpu=profile.gpu, fallback_miss_s=profile.read_seconds(profile.calibration_slot_bytes))
    return dataclasses.replace(profile, **dataclasses.asdict(costs))
