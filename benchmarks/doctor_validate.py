"""Validate `strata doctor`: predicted vs measured decode tok/s and peak memory on strata's own
models (the embedded model; made `small` and `demo` models), all-resident and streaming at
several arenas. Prints a markdown table and, last, one JSON line.

    PYTHONPATH=$PWD python benchmarks/doctor_validate.py [--backend numpy|mlx] [--tokens 48]
        [--remeasure] [--cache-dir DIR] [--json-out PATH] [--quick] [--budget-s S] [--case-timeout S]
        [--expert-type q8_0] [--dense-type q8_0]   (the made models' types; give them again with --replay)
    PYTHONPATH=$PWD python benchmarks/doctor_validate.py --replay OUTPUT [--refit]

Each measured run is a fresh process (`strata.doctor.measure`), so its peak memory is its own;
the machine profile the predictions use is the doctor's cached one (--remeasure: measure it
first). Hit rates come from each model's own trace (recorded here on the held-out text).
Targets: |error| <= 25% on decode tok/s, <= 10% on peak memory. Measured tok/s is the steady
rate (decode calls after the first WARMUP_TOKENS steps / their wall time: what the doctor
predicts), and the prediction's hit rate is replayed over the same steps; the rate with the
first steps (compiling MLX's kernels) is printed beside it, not judged. The 1-minute load
average, the share of the CPUs other processes kept busy and the run's own CPU time / wall
time are kept beside each measurement: on a shared machine they explain most of the scatter.
`tok/s by own CPU` is decode calls / the process's CPU seconds over the same steps: a
descheduled run's wall time grows and its CPU time does not, so where a single-threaded run's
two rates part, the load, not the model, moved it (a streaming run's reader threads add CPU).
`--quick` is the bounded variant for a GPU machine (QUICK below): the probe's engine cases and
these measured over one pool of warmed processes (strata.doctor.joint); every measured run
prints a `JSON-PART` line at once, so a run cut off at its limit still says what it measured.
`--replay OUTPUT` predicts again, with this checkout's code, the cases an earlier run (its
printed output or --json-out file, from any machine) measured, against its measurements and
its machine profile; `--refit` also refits the profile's engine costs from the probe runs it
keeps (strata.doctor.engine_fit.refit); `--profile PATH` predicts with another profile of the
same machine (a cached `machine-*.json`, measured at a quieter time). Nothing is measured then.
"""

from __future__ import annotations

import argparse
import json
import os
import sys
import tempfile
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))

ARENA_FRACTIONS = (0.15, 0.3, 0.6)  # of every expert; raised to the smallest legal arena
TPS_TARGET, PEAK_TARGET = 0.25, 0.10
TRACE_TOKENS = 256


def _trace(model_path: Path, out: Path) -> Path:
    from strata.loader import load
    from strata.tools.quality import fast_params
    from strata.tools.trace import record_trace, save_trace

    model = load(model_path)
    text = (ROOT / "strata" / "data" / "heldout.txt").read_text()
    tokens = model.tokenizer.encode(text)[:TRACE_TOKENS]
    save_trace(out, record_trace(fast_params(model.resident_params()), tokens))
    model.experts_file.close()
    return out


def _wait_for_quiet(load: float, most: float) -> None:
    """On a shared machine other jobs' load moves timings 2-3x between identical runs: start
    when the 1-minute load average is below `load` (or after `most` seconds, saying so)."""
    import time

    if load <= 0:
        return
    start = time.time()
    while os.getloadavg()[0] >= load and time.time() - start < most:
        time.sleep(5)
    print(f"# load average {os.getloadavg()[0]:.1f} after waiting {time.time() - start:.0f} s (wanted < {load})",
          file=sys.stderr)


def _wait_idle(max_others: float, most: float) -> float:
    """Wait (at most `most` s) for a 2-second window in which other processes keep at most
    `max_others` of the CPUs busy; returns that share."""
    import time

    from strata.doctor.measure import _cpu_jiffies, others_busy

    start = time.time()
    while True:
        before, own = _cpu_jiffies(), sum(os.times()[:2])
        time.sleep(2)
        share = others_busy(before, _cpu_jiffies(), sum(os.times()[:2]) - own)
        if share <= max_others or time.time() - start > most:
            return share
        time.sleep(3)


def _median_run(runs):
    return sorted(runs, key=lambda r: -r.tps)[len(runs) // 2]


def _models(names: str, d: Path, types: dict | None = None) -> dict[str, Path]:
    """--models (a comma list) -> name: model path; `default` the embedded model, others made in d
    (`types`: make_model's expert_type / dense_type, from --expert-type / --dense-type)."""
    from strata.default_model import default_model_path
    from strata.testing.models import make_model

    wanted = [m.strip() for m in names.split(",") if m.strip()]
    return {name: default_model_path() if name == "default" else make_model(d / name, name, **(types or {})).model_path
            for name in wanted}


def _types(args) -> dict:
    """make_model's types from --expert-type / --dense-type (absent: its defaults, Q2_0 and F32)."""
    from strata.formats.quant_types import QuantType

    return {key: QuantType[value.upper()] for key, value in
            (("expert_type", args.expert_type), ("dense_type", args.dense_type)) if value}


def _cases(models: dict[str, Path], fractions: tuple[float, ...]) -> list[tuple[str, Path, str]]:
    from strata.config import Config
    from strata.loader import load
    from strata.runtime.decode import cache_config_for

    out = []
    for name, path in models.items():
        model = load(path)
        total = model.experts_file.header.n_records
        least = cache_config_for(model, Config(), 1).min_capacity
        model.experts_file.close()
        out.append((name, path, ""))
        for f in fractions:
            out.append((name, path, f"{max(least, int(f * total))}slots"))
    return out


# --quick: the bounded variant for a lent GPU machine, where a fresh MLX process costs seconds and
# the full run (12 cases x 3 rounds after a 21-process probe) ran past 200 s on the H200: the
# `small` model all-resident and at one arena, one round, 24 tokens, the quick probe, no waiting
# for a quiet machine (a lent GPU host is nobody else's), a 150 s budget.
# Measured there (mid-session run): a fresh MLX process took 17-25 s for a run that decodes in well
# under a second, so --quick also runs every case of a round in one process (`measure_batch`, each
# run's peak from a reset high-water mark) and gives the probe at most PROBE_SHARE of the budget.
# Measured there again (this session's first pass, `--models small,demo`, 110 s): the probe's 9
# engine cases in one process were cut at 64 s (kernels compiling one after another) and `demo`'s
# 4 cases never started, so --quick now measures the probe's cases and its own over one pool of
# warmed processes (strata.doctor.joint: every child compiles at once, runs are measured one at a
# time, in up to `repeats` interleaved rounds, probe and cases alike, in the same minutes).
# The H200's mid pass (pooled): warm-ups 39 s, a round of all 19 runs 4.2 s, single runs of one case
# 0.82-1.15 ms a token apart: up to 5 rounds, the median run.
QUICK = {"models": "small", "arenas": "0.3", "repeats": 5, "tries": 1, "tokens": 24, "wait_run": 0.0,
         "budget_s": 150.0, "case_timeout": 45.0, "one_process": True}
PROBE_SHARE = 0.6
RESERVE_S = 6.0  # of a --budget-s run: for the predictions (each replays its model's trace) and the table


def _row(name: str, arena: str, pred, runs: list) -> dict:
    m = _median_run(runs)
    median_tps = 1.0 / m.median_token_s if m.median_token_s else 0.0
    return {
        "model": name, "arena": arena or "resident", "streaming": m.streaming,
        "pred_tps": pred.tok_per_s, "tps": m.tps, "median_tps": median_tps, "first_tps": m.decode_tps,
        "tps_err": pred.tok_per_s / m.tps - 1 if m.tps else None,
        "median_tps_err": pred.tok_per_s / median_tps - 1 if median_tps else None,
        "pred_peak": pred.peak_memory, "peak": m.peak_rss, "peak_err": pred.peak_memory / m.peak_rss - 1,
        "pred_urgent": pred.locality.urgent_per_token if pred.locality else 0.0,
        "urgent": m.steady_urgent if m.steady_tps else m.report.get("urgent_misses_per_token", 0.0),
        "pred_hit": pred.locality.hit_rate if pred.locality else 1.0,
        "hit": m.report.get("hit_rate", 1.0),
        "pred_reads": pred.locality.reads_per_token if pred.locality else 0.0,
        "reads": m.steady_reads if m.steady_tps else m.report.get("reads_per_token", 0.0),
        "load": (m.load_before + m.load_after) / 2,
        "paging": m.paging, "runs_tps": [r.tps for r in runs],
        "others_busy": m.others_busy, "cpu_wall": m.cpu_s / m.wall_s if m.wall_s else 0.0, "warmed": m.warmed,
        "cpu_tps": 1.0 / m.steady_cpu_s if m.steady_cpu_s else 0.0,
        "run": m.to_dict(),
    }


def _part(kind: str, **fields) -> None:
    """One JSON line as soon as a part is done (`JSON-PART`, as benchmarks/device_run.sh's stages
    print them): a run cut off at its time limit still leaves every finished case."""
    print("JSON-PART " + json.dumps({"part": kind, **fields}, sort_keys=True), flush=True)


def _load_output(path: str) -> tuple[dict, list[dict]]:
    """(profile dict, case rows) of an earlier run: its summary line, else its JSON-PART lines."""
    profile, rows = None, []
    for line in Path(path).read_text().splitlines():
        if line.startswith("{"):
            summary = json.loads(line)
            return summary["profile"], summary["rows"]
        if line.startswith("JSON-PART "):
            part = json.loads(line[len("JSON-PART "):])
            if part["part"] == "profile":
                profile = part["profile"]
            elif part["part"] == "case":
                rows.append(part)
    if profile is None:
        raise SystemExit(f"{path}: no profile in it")
    return profile, rows


def main(argv=None) -> int:
    import subprocess
    import time

    from strata.doctor.measure import QUIET_OTHERS, measure_quiet
    from strata.doctor.engine_fit import refit
    from strata.doctor.measure import RunMeasurement
    from strata.doctor.probe import MachineProfile, default_cache_dir, machine_profile

    t0 = time.time()
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--backend", default="numpy", choices=("numpy", "mlx"))
    p.add_argument("--quick", action="store_true",
                   help="the bounded variant (QUICK in this file): small model, resident + one arena, the quick "
                        "probe's cases and these over one pool of warmed processes, --budget-s 150; explicit "
                        "flags override it")
    p.add_argument("--tokens", type=int, default=None, help="decoded tokens per run (48; --quick: 24)")
    p.add_argument("--remeasure", action="store_true")
    p.add_argument("--cache-dir", default=None)
    p.add_argument("--json-out", default=None)
    p.add_argument("--models", default=None, help="which of default, small, demo (comma-separated; all three)")
    p.add_argument("--arenas", default=None,
                   help="streaming arenas as shares of every expert, comma-separated (0.15,0.3,0.6; --quick: 0.3)")
    p.add_argument("--repeats", type=int, default=None,
                   help="measured runs per case, in interleaved rounds (the median counts; 3; --quick: at most 5, "
                        "as many whole rounds as --budget-s allows)")
    p.add_argument("--tries", type=int, default=None,
                   help="redo a run up to this many times while other processes keep >25%% of the CPUs busy (3)")
    p.add_argument("--wait-load", type=float, default=0.0,
                   help="before measuring, wait until the 1-minute load average is below this (0: do not wait)")
    p.add_argument("--wait-run", type=float, default=None,
                   help="before each run, wait up to this many seconds for the other processes to go quiet "
                        "(120; 0: do not wait)")
    p.add_argument("--wait-max", type=float, default=600.0, help="seconds to wait for --wait-load at most")
    p.add_argument("--budget-s", type=float, default=None,
                   help="wall seconds for the whole run (0: none; --quick: 150): no run starts past it")
    p.add_argument("--case-timeout", type=float, default=None, help="seconds one measured run may take (600; --quick: 45)")
    p.add_argument("--one-process", action=argparse.BooleanOptionalAction, default=None,
                   help="measure the probe's cases and these over one pool of warmed processes, a process a "
                        "model's all-resident or streaming cases (--quick: yes), not a fresh process a run")
    p.add_argument("--expert-type", default=None, help="the made models' expert type (q2_0, q4_0, q8_0; q2_0)")
    p.add_argument("--dense-type", default=None, help="the made models' dense matrices' type (f32, f16, q8_0; f32)")
    p.add_argument("--replay", default=None, help="predict again the cases an earlier run's output measured")
    p.add_argument("--refit", action="store_true", help="with --replay: refit the profile's engine costs too")
    p.add_argument("--refit-clock", default="wall", choices=("wall", "cpu"),
                   help="with --refit: time the probe's runs by wall time or by their own CPU time (a probe that "
                        "ran on a loaded machine; numpy)")
    p.add_argument("--profile", default=None,
                   help="with --replay: predict with this machine profile (a machine-*.json) instead of the run's")
    args = p.parse_args(argv)
    replayed = _load_output(args.replay) if args.replay else None
    if replayed:  # its backend, models and token count; nothing measured, nothing waited for
        args.backend = replayed[0]["backend"]
        args.tokens = replayed[1][0]["run"]["tokens"] if replayed[1] else 24
        args.models = ",".join(dict.fromkeys(r["model"] for r in replayed[1]))
        args.repeats, args.wait_load = 0, 0.0
    base = {"models": "default,small,demo", "arenas": "0.15,0.3,0.6", "repeats": 3, "tries": 3, "tokens": 48,
            "wait_run": 120.0, "budget_s": 0.0, "case_timeout": 600.0, "one_process": False}
    for key, value in (QUICK if args.quick else base).items():
        if getattr(args, key) is None:
            setattr(args, key, value)
    fractions = tuple(float(f) for f in args.arenas.split(",") if f.strip())
    left = lambda: args.budget_s - (time.time() - t0) if args.budget_s else float("inf")  # noqa: E731
    _wait_for_quiet(args.wait_load, args.wait_max)
    cache = Path(args.cache_dir) if args.cache_dir else default_cache_dir(os.environ)
    pooled = args.one_process and not replayed and args.repeats > 0
    if pooled:
        return _pooled(args, fractions, t0, cache)
    if replayed:
        stored = json.loads(Path(args.profile).read_text()) if args.profile else replayed[0]
        profile = MachineProfile.from_dict(stored)
        profile = refit(profile, clock=args.refit_clock) if args.refit else profile
    else:
        profile = machine_profile(args.backend, cache, remeasure=args.remeasure, quick=args.quick,
                                  timeout=min(600.0, max(10.0, PROBE_SHARE * left())),
                                  progress=lambda m: print(f"# {time.time() - t0:6.1f} s measuring this machine: {m}",
                                                           file=sys.stderr, flush=True))
    _part("profile", seconds=round(time.time() - t0, 1), profile=profile.to_dict())
    rows, cut = [], []
    with tempfile.TemporaryDirectory() as d:
        d = Path(d)
        models = _models(args.models, d, _types(args))
        traces = {name: _trace(path, d / f"{name}.trace.npz") for name, path in models.items()}
        cases = _cases(models, fractions) if not replayed else [
            (r["model"], models[r["model"]], "" if r["arena"] == "resident" else r["arena"]) for r in replayed[1]]
        preds = _predictions(args, cases, traces, profile, cache)  # before measuring: they read no measurement
        measured: dict[int, list] = {i: [] for i in range(len(cases))}
        for i, r in enumerate(replayed[1] if replayed else ()):
            measured[i].append(RunMeasurement(**r["run"]))
        for round_ in range(args.repeats):  # interleaved: a load spike hits all alike
            for i, (name, path, arena) in enumerate(cases):
                overrides = {"backend": args.backend, "profile": True, **({"arena": arena} if arena else {})}
                limit = min(args.case_timeout, left())
                if limit < 5:
                    cut.append(f"{name} {arena or 'resident'} round {round_ + 1}: no time left")
                    continue
                if args.wait_run > 0:
                    _wait_idle(QUIET_OTHERS, min(args.wait_run, limit / 2))
                try:
                    measured[i].append(measure_quiet(path, overrides, max_tokens=args.tokens, tries=args.tries,
                                                     timeout=limit))
                except subprocess.TimeoutExpired:
                    cut.append(f"{name} {arena or 'resident'} round {round_ + 1}: past {limit:.0f} s")
                    continue
                if round_ == args.repeats - 1 or not left() > 0:
                    row = _row(name, arena, preds[i], measured[i])
                    _part("case", seconds=round(time.time() - t0, 1), **row)
        for i, (name, path, arena) in enumerate(cases):
            if not measured[i]:
                continue
            rows.append(row := _row(name, arena, preds[i], measured[i]))
            print(f"# {name} {row['arena']}: predicted {row['pred_tps']:.1f} tok/s, measured {row['tps']:.1f} "
                  f"(median {row['median_tps']:.1f}), load {row['load']:.1f}", file=sys.stderr, flush=True)
    return _report(args, profile, rows, cut, t0)


def _predictions(args, cases, traces, profile, cache) -> list:
    """The doctor's prediction of every case: steady decode over the measured steps (WARMUP_TOKENS
    .. tokens-2, after the prompt and the warm-up), from the model's own trace."""
    from strata.config import Config
    from strata.doctor import diagnose
    from strata.doctor.measure import PROMPT, WARMUP_TOKENS
    from strata.loader import load

    preds = []
    for name, path, arena in cases:  # a prediction reads no measurement
        config = Config(backend=args.backend, **({"arena": arena} if arena else {}))
        n_prompt = len(load(path).tokenizer.encode(PROMPT))
        preds.append(diagnose(path, cache_dir=cache, config=config, trace=traces[name], profile=profile,
                              context=n_prompt + args.tokens, horizon=max(1, args.tokens - 1 - WARMUP_TOKENS),
                              prompt=n_prompt + WARMUP_TOKENS).prediction)
    return preds


def _case_name(cases: list, key) -> str:
    """A case's name (model and arena) by its index; a probe run's name as it is."""
    if isinstance(key, int):
        name, _, arena = cases[key]
        return f"{name} {arena or 'resident'}"
    return f"probe {key}"


def _pooled(args, fractions: tuple[float, ...], t0: float, cache: Path) -> int:
    """--quick (one process a group): the probe's engine cases and every case over one pool of
    warmed processes (strata.doctor.joint), predictions after, from the profile fitted on the
    probe's runs alone."""
    import time

    from strata.doctor.joint import measure_joint

    say = lambda m: print(f"# {time.time() - t0:6.1f} s {m}", file=sys.stderr, flush=True)  # noqa: E731
    budget = args.budget_s or 600.0
    deadline = time.monotonic() + budget - (time.time() - t0) - RESERVE_S
    with tempfile.TemporaryDirectory() as d:
        d = Path(d)
        models = _models(args.models, d, _types(args))
        cases = _cases(models, fractions)
        # a model's all-resident and streaming cases compile different kernels: two children
        keyed = [(i, path, {"profile": True, **({"arena": arena} if arena else {})},
                  f"{name}-{'streaming' if arena else 'resident'}") for i, (name, path, arena) in enumerate(cases)]
        traces: dict = {}

        def record_traces():  # CPU work of this process while the children compile
            traces.update({name: _trace(path, d / f"{name}.trace.npz") for name, path in models.items()})
            say(f"traces recorded ({', '.join(models)})")

        joint = measure_joint(args.backend, cache, keyed, tokens=args.tokens, deadline=deadline,
                              case_timeout=args.case_timeout, rounds=args.repeats, remeasure=args.remeasure,
                              progress=say, while_warming=record_traces,
                              alone=tuple(i for i, (_, _, arena) in enumerate(cases) if not arena),
                              on_run=lambda name, r, run, alone: _part(
                                  "run", seconds=round(time.time() - t0, 1), case=_case_name(cases, name),
                                  round=r + 1, alone=alone, run=run.to_dict()))
        profile = joint.profile
        _part("profile", seconds=round(time.time() - t0, 1), profile=profile.to_dict(), probed=joint.probed,
              phases={k: round(v, 1) for k, v in joint.seconds.items()})
        preds = _predictions(args, cases, traces, profile, cache)
        rows = []
        for i, (name, path, arena) in enumerate(cases):
            runs = joint.runs.get(i, [])
            if not runs:
                continue
            rows.append(row := _row(name, arena, preds[i], runs))
            _part("case", seconds=round(time.time() - t0, 1), **row)
            print(f"# {name} {row['arena']}: predicted {row['pred_tps']:.1f} tok/s, measured {row['tps']:.1f} "
                  f"(median {row['median_tps']:.1f}; {len(runs)} rounds)", file=sys.stderr, flush=True)
        try:  # a report of its own: whatever it meets, the table and the summary still come
            alone = _alone_check(joint, cases, args, traces, cache)
        except Exception as exc:  # noqa: BLE001
            print(f"alone check failed: {type(exc).__name__}: {exc}")
            alone = {"error": f"{type(exc).__name__}: {exc}"}
    cut = [f"{_case_name(cases, int(c.split()[0]))} {c.split(' ', 1)[1]}" if c.split()[0].isdigit() else c
           for c in joint.cut]
    return _report(args, profile, rows, cut, t0, phases={k: round(v, 1) for k, v in joint.seconds.items()},
                   alone=alone)


def _alone_check(joint, cases: list, args, traces: dict, cache: Path) -> dict:
    """Each all-resident case measured again with the rest of the pool ended (strata.doctor.joint's
    alone check) against its runs in the pool: ms a token (the median run each), printed as a
    table; the pool's idle processes cost nothing if the two agree within the runs' spread. With
    a probe measured now, the validated all-resident cases are also predicted from the profile
    refitted on the probe's alone runs (the streaming fit as it was) against their alone runs."""
    import dataclasses

    from strata.doctor.engine_fit import refit, token_s
    from strata.doctor.probe_engine import median_run

    out = {}  # the probe's keys in joint.alone are its run names, the calibration's keys
    for key, solo in joint.alone.items():
        pooled = joint.pooled.get(key)
        if not pooled:
            continue
        out[_case_name(cases, key)] = {
            "pool_ms": 1e3 * token_s(median_run(pooled)), "alone_ms": 1e3 * token_s(median_run(solo)),
            "pool_runs_ms": [1e3 * token_s(r) for r in pooled], "alone_runs_ms": [1e3 * token_s(r) for r in solo]}
    if out:
        print("\nalone check (ms a token: the pool's median run / the median run with every other process ended)")
    for name, d in out.items():
        runs = " / ".join(" ".join(f"{t:.3f}" for t in d[k]) for k in ("pool_runs_ms", "alone_runs_ms"))
        print(f"  {name:24s} pool {d['pool_ms']:.3f}  alone {d['alone_ms']:.3f}  "
              f"({d['alone_ms'] / d['pool_ms']:.2f}x)  runs {runs}")
    probe_alone = {k: median_run(rs) for k, rs in joint.alone.items() if isinstance(k, str)}
    mine = [k for k in joint.alone if isinstance(k, int)]
    if joint.probed and probe_alone and mine:
        calibration = {**joint.profile.calibration, **{k: r.to_dict() for k, r in probe_alone.items()}}
        solo_profile = refit(dataclasses.replace(joint.profile, calibration=calibration))
        preds = _predictions(args, [cases[k] for k in mine], traces, solo_profile, cache)
        print(f"  alone profile: step {1e3 * solo_profile.step_s:.3f} ms, layer {1e3 * solo_profile.layer_s:.3f} ms")
        for k, pred in zip(mine, preds):
            tps = 1.0 / token_s(median_run(joint.alone[k]))
            d = out.setdefault(_case_name(cases, k), {})
            d.update(alone_pred_tps=pred.tok_per_s, alone_tps=tps, alone_tps_err=pred.tok_per_s / tps - 1)
            print(f"  {_case_name(cases, k):24s} alone: predicted {pred.tok_per_s:.1f} tok/s, measured {tps:.1f} "
                  f"({100 * d['alone_tps_err']:+.0f}%)")
    return out


def _report(args, profile, rows: list, cut: list, t0: float, **extra) -> int:
    """The table, what was not measured, and the summary JSON line (last)."""
    import time

    print(f"machine profile: {profile.backend}, measured at load {profile.load_avg:.1f}; "
          f"base RSS {profile.base_rss / 1e6:.1f} MB, step {1e3 * profile.step_s:.3f} ms, "
          f"round trip {1e6 * profile.sync_s:.1f} us, layer {1e3 * profile.layer_s:.3f} ms, "
          f"read {1e9 * profile.read_byte_s:.3f} ns/B beyond the per-read cost, "
          f"turn {1e3 * profile.turn_s:.3f} ms + {1e6 * profile.turn_slot_s:.3f} us/slot, read {1e3 * profile.read_s:.3f} ms, miss {1e3 * profile.miss_s:.3f} ms\n")
    print("| model | arena | pred tok/s | tok/s | err | median tok/s | err | with first steps tok/s "
          "| pred peak MB | peak MB | err "
          "| pred urgent/tok | urgent/tok | pred reads/tok | reads/tok | pred hit | hit | load | others busy "
          "| own CPU / wall | tok/s by own CPU |")
    print("|---|---|---|---|---|---|---|---|---|---|---|---|---|---|---|---|---|---|---|---|---|")
    for r in rows:
        print(f"| {r['model']} | {r['arena']} | {r['pred_tps']:.1f} | {r['tps']:.1f} | {100 * r['tps_err']:+.0f}% "
              f"| {r['median_tps']:.1f} | {100 * r['median_tps_err']:+.0f}% | {r['first_tps']:.1f} "
              f"| {r['pred_peak'] / 1e6:.1f} "
              f"| {r['peak'] / 1e6:.1f} | {100 * r['peak_err']:+.1f}% | {r['pred_urgent']:.2f} | {r['urgent']:.2f} "
              f"| {r['pred_reads']:.1f} | {r['reads']:.1f} | {100 * r['pred_hit']:.1f}% | {100 * r['hit']:.1f}% "
              f"| {r['load']:.1f} | {100 * r['others_busy']:.0f}% | {r['cpu_wall']:.2f} "
              f"| {r.get('cpu_tps', 0.0):.1f} |")
    for c in cut:
        print(f"not measured: {c}")
    summary = {
        "backend": args.backend, "tokens": args.tokens, "cases": len(rows), "quick": args.quick,
        "replay": args.replay, "refit": args.refit and args.refit_clock, "replay_profile": args.profile,
        "seconds": round(time.time() - t0, 1), "cut": cut,
        "max_abs_tps_err": max((abs(r["tps_err"]) for r in rows), default=None),
        "max_abs_median_tps_err": max((abs(r["median_tps_err"]) for r in rows), default=None),
        "max_abs_peak_err": max((abs(r["peak_err"]) for r in rows), default=None),
        "tps_within_target": sum(abs(r["tps_err"]) <= TPS_TARGET for r in rows),
        "median_tps_within_target": sum(abs(r["median_tps_err"]) <= TPS_TARGET for r in rows),
        "peak_within_target": sum(abs(r["peak_err"]) <= PEAK_TARGET for r in rows),
        "rows": rows, "profile": profile.to_dict(), **extra,
    }
    line = json.dumps(summary, sort_keys=True)
    if args.json_out:
        Path(args.json_out).write_text(line + "\n")
    print()
    print(line)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
