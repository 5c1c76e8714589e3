"""The probe's engine fit (strata.doctor.engine_fit) and the steady rate it is fitted on
(strata.doctor.measure): synthetic runs with known costs, a first step that compiles, the refit
of a stored profile, and a warmed-up batch run."""

from __future__ import annotations

import dataclasses

import pytest

from strata.cache.types import CacheStats
from strata.doctor.engine_fit import (
    ALL_RESIDENT_POINTS, SHORT_LAYERS, WIDE_FFN, calibration_config, fit_engine, fit_streaming, refit, run_name,
    stored_runs, wide_slot_bytes,
)
from strata.doctor.byte_budget import byte_budget
from strata.doctor.families import count_strata
from strata.doctor.measure import WARMUP_TOKENS, RunMeasurement, _steady
from strata.doctor.predict import dense_held
from strata.doctor.probe import MachineProfile, OpCost
from strata.testing.models import make_model

TURN_S, SLOT_S, READ_S, BYTE_S, MISS_S = 9e-4, 2e-7, 4e-5, 2e-9, 3e-4  # the synthetic engine's costs
RESIDENT_S, WIDE_S = 2e-3, 2.5e-3
STEP_S = 6e-4  # a token's fixed cost
L, SLOT = 6, 4096


def _run(slots: int, *, urgent: float, reads: float, compile_s: float = 0.0, slot: int = SLOT,
         resident_s: float = RESIDENT_S) -> RunMeasurement:
    """A streaming run whose steady calls cost exactly the model's sum; its report's mean also
    carries `compile_s` of first-step compiling spread over 24 calls (as a mean-timed run did)."""
    t = resident_s + L * (TURN_S + SLOT_S * slots) + reads * (READ_S + BYTE_S * slot) + urgent * MISS_S
    report = {"ms_per_token": 1e3 * (t + compile_s / 24), "urgent_misses_per_token": urgent,
              "reads_per_token": reads, "waiting_ms_per_window": 1e3 * urgent * MISS_S,
              "host_ms_per_window": 0.0, "after_ms": 0.0}
    return RunMeasurement(decode_tps=1 / (t + compile_s / 24), median_token_s=t, tokens=24, peak_rss=1, streaming=True,
                          report=report, steady_tps=1 / t, steady_urgent=urgent, steady_reads=reads)


STREAMING = {44: _run(44, urgent=7.0, reads=52.0, compile_s=0.08), 192: _run(192, urgent=2.7, reads=20.0, compile_s=0.08),
             384: _run(384, urgent=0.0, reads=9.0, compile_s=0.08)}


WIDE = {("wide", 44): _run(44, urgent=6.0, reads=50.0, slot=8 * SLOT, resident_s=WIDE_S),
        ("wide", 192): _run(192, urgent=2.0, reads=18.0, slot=8 * SLOT, resident_s=WIDE_S)}


def _rows(streaming=STREAMING, wide=WIDE):
    return [(s, SLOT, RESIDENT_S, r) for s, r in streaming.items()] + [
        (s, 8 * SLOT, WIDE_S, r) for (_, s), r in wide.items()]


def test_streaming_fit_recovers_the_costs_from_steady_rates():
    turn, per_slot, read, per_byte, miss = fit_streaming(_rows(), L, fallback_miss_s=1.0)
    assert miss == pytest.approx(MISS_S)
    assert (turn, per_slot, read, per_byte) == pytest.approx((TURN_S, SLOT_S, READ_S, BYTE_S), rel=1e-5)
    # one slot size: no per-byte term, its cost folded into the per-read one
    turn, per_slot, read, per_byte, _ = fit_streaming(_rows(wide={}), L, 1.0)
    assert per_byte == 0.0 and read == pytest.approx(READ_S + BYTE_S * SLOT, rel=1e-5)


def test_streaming_fit_is_never_negative_and_ignores_compile_time_in_the_mean():
    # the steady rates say the same whatever the mean-timed figures carried
    noisy = {s: dataclasses.replace(r, report={**r.report, "ms_per_token": 50.0}) for s, r in STREAMING.items()}
    assert fit_streaming(_rows(noisy), L, 1.0) == pytest.approx(fit_streaming(_rows(), L, 1.0))
    # a run faster than the resident one would need negative costs: clamped as a whole, not one by one
    fast = {s: dataclasses.replace(r, steady_tps=1 / (0.5 * RESIDENT_S)) for s, r in STREAMING.items()}
    assert all(c >= 0 for c in fit_streaming(_rows(fast), L, 1.0))


def test_steady_rate_leaves_out_the_warmup_steps_and_the_last_sample_only_step():
    steps = [2.0] + [0.01] * (WARMUP_TOKENS - 1) + [0.004] * 10 + [1e-5]  # a compile, then steady, then sampling
    caches = [CacheStats(urgent_misses=3 * i, reads_issued=10 * i) for i in range(len(steps))]
    out = _steady(steps, caches, [0.1 * i for i in range(len(steps))])
    assert out["steady_tps"] == pytest.approx(1 / 0.004)
    assert out["steady_urgent"] == pytest.approx(3.0) and out["steady_reads"] == pytest.approx(10.0)
    assert out["steady_cpu_s"] == pytest.approx(0.1)
    assert _steady(steps[:WARMUP_TOKENS + 1], caches) == {}  # no decode call left to time


def _profile(runs: dict) -> MachineProfile:
    calibration = {run_name(k): r.to_dict() for k, r in runs.items()}
    return MachineProfile(
        backend="numpy", machine="test", disk_latency_s=1e-4, disk_bytes_per_s=1e9, disk_direct=True,
        mem_bytes_per_s=2e10, gemv=OpCost(((1e4, 2e-6), (1e8, 1e-2))), expert=OpCost(((4e3, 2e-5), (1e6, 3e-2))),
        expert_call_s=0.0, calibration_record_bytes=1920, layer_s=0.0, turn_s=0.0, turn_slot_s=0.0, read_s=0.0,
        miss_s=0.0, calibration_slot_bytes=4096, base_rss=0, load_avg=0.0, measured_at=0.0, calibration=calibration)


def test_refit_recomputes_the_engine_costs_from_the_kept_runs():
    resident = RunMeasurement(decode_tps=1 / RESIDENT_S, median_token_s=RESIDENT_S, tokens=24, peak_rss=90_000_000,
                              streaming=False, steady_tps=1 / RESIDENT_S)
    top1 = dataclasses.replace(resident, steady_tps=1 / (RESIDENT_S - 18 * 5e-5))  # 5e-5 s per routed expert
    wide_slot = wide_slot_bytes()
    wide = {k: _run(k[1], urgent=r.steady_urgent, reads=r.steady_reads, slot=wide_slot, resident_s=WIDE_S)
            for k, r in WIDE.items()}
    runs = {"resident": resident, "top1": top1, "wide": dataclasses.replace(resident, steady_tps=1 / WIDE_S),
            **STREAMING, **wide}
    assert stored_runs(_profile(runs).calibration) == runs  # names and back
    prof = refit(_profile(runs))
    direct = fit_engine(runs, cfg=calibration_config(), slot_bytes=4096, record_bytes=1920, gemv=prof.gemv,
                        expert=prof.expert, widen={}, sync_s=0.0, backend="numpy", gpu=False, fallback_miss_s=1.0)
    assert prof.expert_call_s == pytest.approx(5e-5) == direct.expert_call_s
    assert (prof.turn_s, prof.turn_slot_s, prof.read_s, prof.read_byte_s) == pytest.approx(
        (TURN_S, SLOT_S, READ_S, BYTE_S), rel=1e-5)
    assert 0 < prof.base_rss < resident.peak_rss and prof.layer_s == direct.layer_s
    assert prof.step_s == 0.0  # no short model among the runs: every fixed cost per layer
    with pytest.raises(ValueError, match="remeasure"):
        refit(dataclasses.replace(prof, calibration={}))


def test_streaming_runs_give_their_own_base_rss():
    # an all-resident process holding more than its bytes (the H200's MLX: compiled step, prompt
    # kernels) must not price a streaming run's peak: each kind's base from its own runs
    resident = RunMeasurement(decode_tps=1 / RESIDENT_S, median_token_s=RESIDENT_S, tokens=24, peak_rss=300_000_000,
                              streaming=False, steady_tps=1 / RESIDENT_S)
    top1 = dataclasses.replace(resident, steady_tps=1 / (RESIDENT_S - 18 * 5e-5))
    streaming = {s: dataclasses.replace(r, peak_rss=40_000_000 + s * 4096) for s, r in STREAMING.items()}
    kw = dict(cfg=calibration_config(), slot_bytes=4096, record_bytes=1920, gemv=OpCost(((1e4, 2e-6), (1e8, 1e-2))),
              expert=OpCost(((4e3, 2e-5), (1e6, 3e-2))), widen={}, sync_s=0.0, backend="numpy", gpu=False,
              fallback_miss_s=1.0)
    costs = fit_engine({"resident": resident, "top1": top1, **streaming}, **kw)
    dense = dense_held(byte_budget(count_strata(calibration_config()), slot_bytes=4096), "numpy")
    assert costs.base_rss_streaming == 40_000_000 - dense  # every streaming run's peak less dense and arena
    assert costs.base_rss > costs.base_rss_streaming + 200_000_000
    unmeasured = {s: dataclasses.replace(r, peak_rss=0) for s, r in STREAMING.items()}
    assert fit_engine({"resident": resident, "top1": top1, **unmeasured}, **kw).base_rss_streaming == 0  # base_rss then


def test_a_short_model_splits_a_tokens_fixed_cost_from_its_layers():
    """Two all-resident models of L and SHORT_LAYERS layers: t = step + layers * layer_s + ops."""
    layer = 1e-4
    ops = {n: _ops(n) for n in (L, SHORT_LAYERS)}
    resident = RunMeasurement(decode_tps=1.0, median_token_s=1.0, tokens=24, peak_rss=90_000_000, streaming=False,
                              steady_tps=1 / (STEP_S + L * layer + ops[L]))
    short = dataclasses.replace(resident, steady_tps=1 / (STEP_S + SHORT_LAYERS * layer + ops[SHORT_LAYERS]))
    runs = {"resident": resident, "top1": resident, "short": short, **STREAMING}
    prof = refit(_profile(runs))
    assert (prof.step_s, prof.layer_s) == pytest.approx((STEP_S, layer), rel=1e-6)


def _ops(n_layers: int, **fields) -> float:
    from strata.doctor.byte_budget import byte_budget
    from strata.doctor.families import count_strata
    from strata.doctor.predict import ops_seconds

    prof = _profile({})
    n = count_strata(calibration_config(n_layers, **fields))
    return ops_seconds(n, byte_budget(n, slot_bytes=4096), prof)


def _resident_points(layer: float, disturb: dict | None = None) -> dict:
    """The all-resident runs of every ALL_RESIDENT_POINTS model at step STEP_S + layer a layer
    + its ops; `disturb`: key -> factor on its time (a run slowed by the machine)."""
    base = RunMeasurement(decode_tps=1.0, median_token_s=1.0, tokens=24, peak_rss=90_000_000, streaming=False)
    runs = {}
    for key, fields in {"resident": {}, **ALL_RESIDENT_POINTS}.items():
        n = fields.get("n_layers", L)
        t = (STEP_S + n * layer + _ops(n, **{k: v for k, v in fields.items() if k != "n_layers"})) * (
            (disturb or {}).get(key, 1.0))
        runs[key] = dataclasses.replace(base, steady_tps=1 / t)
    return runs


def test_every_all_resident_point_goes_into_the_step_fit_and_one_slow_run_weighs_less():
    layer = 1e-4
    runs = {**_resident_points(layer), "top1": _resident_points(layer)["resident"], **STREAMING}
    prof = refit(_profile(runs))
    assert (prof.step_s, prof.layer_s) == pytest.approx((STEP_S, layer), rel=1e-6)
    # the 2-layer run 30% slow (as a probe run measured minutes before its validation was on the H200):
    # the four points' fit misses a 4-layer token by less than the two points' did (here 0.73x)
    slow = {**_resident_points(layer, {"short": 1.3}), **STREAMING}
    slow["top1"] = slow["resident"]
    four = refit(_profile(slow))
    two = refit(_profile({k: r for k, r in slow.items() if k not in ("mid", "e32")}))
    truth = STEP_S + 4 * layer
    assert abs(four.step_s + 4 * four.layer_s - truth) < 0.8 * abs(two.step_s + 4 * two.layer_s - truth)


def test_calibration_configs_are_the_probes_made_models(tmp_path):
    made = make_model(tmp_path / "probe", "tiny", n_layers=6, n_experts=64)
    assert calibration_config() == made.cfg
    wide = make_model(tmp_path / "wide", "tiny", n_layers=6, n_experts=64, expert_ffn_size=WIDE_FFN)
    from strata.formats.experts_file import ExpertsFile

    with ExpertsFile.open(wide.experts_path) as xf:
        assert xf.header.padded_bytes == wide_slot_bytes() == 8 * SLOT


def test_a_warmed_batch_run_reports_its_steady_rate(tmp_path):
    from strata.doctor.measure import measure_batch

    small = make_model(tmp_path / "small", "small")
    (run,) = measure_batch([(small.model_path, {"backend": "numpy", "arena": "38slots"})], max_tokens=12, warmup=True)
    assert run.warmed and run.streaming and run.steady_tps > 0 and run.cpu_s > 0 and run.wall_s > 0
    assert run.steady_cpu_s > 0
    assert run.steady_reads > 0 and run.steady_urgent <= run.steady_reads  # 38 of 128 experts: it reads


def test_the_cpu_clock_fits_what_a_descheduled_probe_did_not_lose():
    """A probe on a loaded machine: every run's wall time 1.5x its own CPU time. Timed by the
    CPU clock the fit recovers the costs the wall clock overstates."""
    slow = {k: dataclasses.replace(r, steady_cpu_s=1 / r.steady_tps, steady_tps=r.steady_tps / 1.5)
            for k, r in STREAMING.items()}
    resident = RunMeasurement(decode_tps=1.0, median_token_s=1.0, tokens=24, peak_rss=90_000_000, streaming=False,
                              steady_tps=1 / (1.5 * RESIDENT_S), steady_cpu_s=RESIDENT_S)
    prof = _profile({"resident": resident, "top1": resident, **slow})
    by_cpu, by_wall = refit(prof, clock="cpu"), refit(prof)
    assert (by_cpu.turn_s, by_cpu.turn_slot_s) == pytest.approx((TURN_S, SLOT_S), rel=1e-5)
    assert by_wall.turn_s > 1.2 * TURN_S
