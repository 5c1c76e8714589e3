"""strata's own engine costs from the probe's engine runs, and the refit of a stored profile.

The probe (probe.py) runs a made model (`tiny` shape, CALIBRATION_LAYERS layers of
CALIBRATION_EXPERTS experts) all-resident at top-k and top-1 and streaming at several arenas;
`fit_engine` turns those runs into the profile's engine fields:

- `expert_call_s`: (resident top-k − resident top-1) / (L · (k − 1)), the engine's own cost per
  routed expert at the calibration record size;
- `step_s` + `layer_s` · L: what the ops (gemv / expert / widening tables) and the token's one
  host round trip (`sync_s`, MLX) leave of the all-resident runs (CALIBRATION_LAYERS, SHORT_LAYERS
  and MID_LAYERS layers, and FEW_EXPERTS experts: ALL_RESIDENT_POINTS), by non-negative least
  squares: a decoded token's fixed cost (the generation loop's sampling and bookkeeping, a
  compiled step's replay) apart from its per-layer one. On the H200 the all-resident step took
  0.83 ms at 4 layers and 1.06 at 8 (MLX, compiled): ~0.6 ms a token and ~0.06 a layer, where one
  6-layer run priced it all per layer (0.09 ms) and predicted +37% and -40% there. In a later
  pass the probe's 2- and 6-layer runs took 0.80 and 1.20 ms where the validated 4-layer `small`
  ran 0.69, faster than the 2-layer one: no split of fixed and per-layer cost fits that, the runs
  themselves were ~0.3 ms slower than the validation's, minutes later (doctor/joint.py measures
  both in the same minutes);
- `miss_s`: the reports' wait per urgent miss;
- `turn_s`, `turn_slot_s`, `read_s`, `read_byte_s`: non-negative least squares on what the
  all-resident step and the measured waits leave of the streaming runs (`fit_streaming`), the
  made model's and a wide one's (WIDE_FFN: slots 8x larger), so that a read's cost can grow
  with its bytes. On the H200 the per-layer streaming cost grew with the slot (0.86 ms a layer
  at 4 KB, 1.06 at 8 KB, 1.25 at 32 KB: the reads land in CUDA managed memory, which the
  device's experts then fault over), and one slot size priced the 32 KB model at +26%;
- `base_rss`: the resident run's peak less the model's bytes, as predict.py counts a peak;
  `base_rss_streaming`: the same of the streaming runs (the median of their peaks less dense and
  arena bytes). Two, because the kinds hold different code: on the H200 an all-resident MLX
  process (its compiled step, the prompt path's kernels, the device-side greedy loop) peaked
  ~255 MB above the streaming ones of the same model (804-833 MB against 548-575), and one base
  taken from the resident run priced every streaming peak +44..+47%.

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

from strata.doctor.byte_budget import byte_budget
from strata.doctor.families import count_strata
from strata.doctor.predict import dense_held, ops_seconds
from strata.doctor.profile import placeholder_profile

__all__ = ["EngineCosts", "fit_engine", "fit_streaming", "token_s", "calibration_config", "refit",
           "CALIBRATION_LAYERS", "CALIBRATION_EXPERTS", "SHORT_LAYERS", "MID_LAYERS", "FEW_EXPERTS", "WIDE_FFN",
           "ALL_RESIDENT_POINTS", "run_name", "device_bandwidth", "stored_runs"]

CALIBRATION_LAYERS = 6
CALIBRATION_EXPERTS = 64  # 384 slots over 6 layers: arenas from the smallest legal one (44) to all
SHORT_LAYERS = 2  # the second all-resident model: a token's fixed cost apart from its per-layer one
MID_LAYERS = 4  # a third: three layer counts, so one run off the line is seen (and weighs less)
FEW_EXPERTS = 32  # a fourth, 6 layers of half the experts: the step's cost with E (`small` has 32, `demo` 64)
WIDE_FFN = 512  # the wide model's expert width: 32 KB slots where the made model's are 4 KB
# the all-resident runs the step_s + layer_s fit takes beside "resident": key -> their config's changes
ALL_RESIDENT_POINTS = {"short": {"n_layers": SHORT_LAYERS}, "mid": {"n_layers": MID_LAYERS},
                       "e32": {"n_experts": FEW_EXPERTS}}


def calibration_config(n_layers: int = CALIBRATION_LAYERS, **fields):
    """The probe's made model's ModelConfig (as `make_model(..., "tiny", n_layers=..., n_experts=...)`)."""
    from strata.testing.models import SHAPES

    return dataclasses.replace(SHAPES["tiny"], **{"n_layers": n_layers, "n_experts": CALIBRATION_EXPERTS, **fields})


def wide_slot_bytes() -> int:
    from strata.formats.expert_record import RecordLayout
    from strata.formats.quant_types import QuantType

    cfg = calibration_config(expert_ffn_size=WIDE_FFN)
    return RecordLayout(QuantType.Q2_0, cfg.hidden_size, cfg.expert_ffn_size).padded_bytes


@dataclass(frozen=True)
class EngineCosts:
    expert_call_s: float
    step_s: float
    layer_s: float
    turn_s: float
    turn_slot_s: float
    read_s: float
    read_byte_s: float
    miss_s: float
    base_rss: int
    base_rss_streaming: int = 0  # 0: no streaming run measured (base_rss for both kinds)


def token_s(run, clock: str = "wall") -> float:
    """Mean seconds per decode call after the warm-up steps (`RunMeasurement.steady_tps`), else
    the stream report's mean, else tokens / decode time (a run measured before steady rates).
    clock "cpu": the process's own CPU seconds per call over those steps where measured (a
    descheduled run does not accumulate them: for a probe that ran on a loaded machine)."""
    if clock == "cpu" and run.steady_cpu_s:
        return run.steady_cpu_s
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


def fit_streaming(rows: list, n_layers: int, fallback_miss_s: float, clock: str = "wall"):
    """(turn_s, turn_slot_s, read_s, read_byte_s, miss_s) from streaming runs, `rows` of
    (arena slots, slot bytes, the same model's all-resident seconds per call, run); the first
    slot size is the calibration one.

    miss_s is the measured wait per urgent miss at the calibration slot (the reports' waiting
    time / urgent misses); the rest by non-negative least squares on what each run's own
    waits and its model's all-resident step do not explain: per decode call
        t - resident - wait = L * (turn_s + turn_slot_s * slots) + reads * (read_s + read_byte_s * slot).
    Non-negative as a whole, not clipped one by one: clipping a negative coefficient of an
    unconstrained fit leaves the others fitted beside it."""
    from scipy.optimize import nnls

    calib = rows[0][1]
    c = [counts(r) for _, _, _, r in rows]
    own = [(u, w) for (u, _, w), (_, b, _, _) in zip(c, rows) if b == calib]
    urgent = sum(u for u, _ in own)
    miss_s = sum(w for _, w in own) / urgent if urgent > 0 else fallback_miss_s
    A, ys = [], []
    for (slots, slot, resident_s, r), (u, reads, wait) in zip(rows, c):
        A.append([n_layers, n_layers * slots, reads, reads * slot])
        ys.append(token_s(r, clock) - resident_s - wait)
    if len({b for _, b, _, _ in rows}) == 1:  # one slot size: no per-byte term to fit
        A = [a[:3] for a in A]
    coef, _ = nnls(np.array(A, float), np.array(ys, float))
    turn, per_slot, read, per_byte = (*(float(x) for x in coef), 0.0)[:4]
    return turn, per_slot, read, per_byte, miss_s


def fit_engine(runs: dict, *, cfg, slot_bytes: int, record_bytes: int, gemv, expert, widen: dict, sync_s: float,
               backend: str, gpu: bool, fallback_miss_s: float, clock: str = "wall", kernel_gemv: dict | None = None,
               expert_kernels: dict | None = None) -> EngineCosts:
    """The engine fields (module docstring) from `runs`: "resident", "top1" and capacity -> run."""
    from scipy.optimize import nnls

    streaming = {s: r for s, r in runs.items() if isinstance(s, int)}
    resident, top1 = runs["resident"], runs["top1"]
    n = count_strata(cfg)
    budget = byte_budget(n, slot_bytes=slot_bytes)
    resident_s = token_s(resident, clock)
    L, k = cfg.n_layers, cfg.n_experts_per_token
    # the engine's own cost per routed expert at the calibration size: top-k vs top-1, the rest equal
    expert_call_s = max(0.0, (resident_s - token_s(top1, clock)) / (L * (k - 1)))
    partial = placeholder_profile(gemv=gemv, expert=expert, expert_call_s=expert_call_s,
                                  calibration_record_bytes=record_bytes, widen=widen, kernel_gemv=kernel_gemv or {},
                                  expert_kernels=expert_kernels or {})

    def rest(run, c) -> float:  # what the ops and the round trip leave of an all-resident token
        nc = count_strata(c)
        return token_s(run, clock) - sync_s - ops_seconds(nc, byte_budget(nc, slot_bytes=slot_bytes), partial)

    points = [(resident, cfg)] + [(runs[key], dataclasses.replace(cfg, **fields))
                                  for key, fields in ALL_RESIDENT_POINTS.items() if key in runs]
    if len(points) > 1:  # NNLS over every all-resident point: one disturbed run moves the fit less
        A = np.array([[1.0, c.n_layers] for _, c in points])
        (step_s, layer_s), _ = nnls(A, np.array([rest(run, c) for run, c in points]))
    else:  # runs measured before the short model: every fixed cost priced per layer
        step_s, layer_s = 0.0, max(0.0, rest(resident, cfg) / L)
    rows = [(s, slot_bytes, resident_s, r) for s, r in sorted(streaming.items())]
    if "wide" in runs:  # the wide model's streaming runs, against its own all-resident step
        wide_s, wide_slot = token_s(runs["wide"], clock), wide_slot_bytes()
        rows += [(s, wide_slot, wide_s, r) for (_, s), r in sorted(
            (k, r) for k, r in runs.items() if isinstance(k, tuple))]
    turn_s, turn_slot_s, read_s, read_byte_s, miss_s = fit_streaming(rows, L, fallback_miss_s, clock)
    dense = dense_held(budget, backend, gpu=gpu)
    base = max(0, resident.peak_rss - dense - budget.experts_resident)
    streamed = [r.peak_rss - dense - s * slot_bytes for s, r in streaming.items() if r.peak_rss]
    base_streaming = max(0, int(np.median(streamed))) if streamed else 0
    return EngineCosts(expert_call_s=expert_call_s, step_s=float(step_s), layer_s=float(layer_s), turn_s=turn_s,
                       turn_slot_s=turn_slot_s, read_s=read_s, read_byte_s=read_byte_s, miss_s=miss_s,
                       base_rss=base, base_rss_streaming=base_streaming)


def stored_runs(calibration: dict) -> dict:
    """A profile's `calibration` (case name -> RunMeasurement dict) as fit_engine's runs."""
    from strata.doctor.measure import RunMeasurement

    out = {}
    for name, d in calibration.items():
        key = name
        if name.endswith("slots"):
            key = int(name.removesuffix("slots").removeprefix("wide-"))
            key = ("wide", key) if name.startswith("wide-") else key
        out[key] = RunMeasurement(**d)
    return out


def run_name(key) -> str:
    """A fit_engine run key as its name in a profile's `calibration` (stored_runs reads it back)."""
    if isinstance(key, tuple):
        return f"wide-{key[1]}slots"
    return f"{key}slots" if isinstance(key, int) else key


def refit(profile, clock: str = "wall"):
    """`profile` with its engine fields fitted again, by this file's code, from the runs it keeps
    (clock "cpu": timed by their own CPU seconds, `token_s`)."""
    if not profile.calibration:
        raise ValueError("this profile keeps no engine runs (measured before profile version 6): remeasure")
    costs = fit_engine(stored_runs(profile.calibration), cfg=calibration_config(),
                       slot_bytes=profile.calibration_slot_bytes, record_bytes=profile.calibration_record_bytes,
                       gemv=profile.gemv, expert=profile.expert, widen=profile.widen, kernel_gemv=profile.kernel_gemv,
                       expert_kernels=profile.expert_kernels, sync_s=profile.sync_s,
                       backend=profile.backend,
                       gpu=profile.gpu, fallback_miss_s=profile.read_seconds(profile.calibration_slot_bytes),
                       clock=clock)
    derived = {}
    if profile.backend == "mlx":  # as measure_machine derives it: the device's, from its largest GEMV
        derived["mem_bytes_per_s"] = device_bandwidth(profile.gemv)
    return dataclasses.replace(profile, **dataclasses.asdict(costs), **derived)


def device_bandwidth(gemv) -> float:
    """MLX: the device's bytes per second, as its largest measured GEMV reads them (a host copy
    priced the H200's HBM at its host's 15.6 GB/s, a floor that alone predicted the `demo`
    model's all-resident step at 1.7 ms for 1.06)."""
    nbytes, seconds = gemv.points[-1]
    return nbytes / seconds
