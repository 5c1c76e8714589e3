"""The quick probe's engine cases and other runs (a validation's), measured over one pool.

`measure_joint` starts one `RunPool` holding the probe's groups (unless a cached profile is used)
and the caller's, lets every child compile while the caller does its own work (`while_warming`:
the validation records its traces then), measures interleaved rounds of every run, fits the
profile from the probe's runs only and caches it. The profile never sees the caller's runs: they
are measured beside the probe's, in the same minutes, so that a drift of the machine moves both
alike, not fitted on (fitting the validated models would make the validation circular).

On the H200 the sequential form (the probe's batch, then the validation's) spent its 110 s
compiling: the probe's 9 cases were cut at 64 s with 2 left out, and the `demo` model's 4 cases
never started in the 36 s left (pool.py says why a pool does better).
"""

from __future__ import annotations

import dataclasses
import tempfile
import time
from dataclasses import dataclass, field
from pathlib import Path
from typing import Callable

__all__ = ["Joint", "measure_joint", "WARM_SHARE"]

WARM_SHARE = 0.65  # of the time left when the pool starts: the most its children's warm-ups may take
# The alone check: after the rounds every process but those of the chosen all-resident cases is
# ended and those are measured ALONE_ROUNDS times more, with no other process of the pool alive
# (the H200 mid pass measured `small` all-resident at 1.00 ms a token in the pool where a batch
# of one process had measured 0.69: was it the nine idle processes beside it, or the machine?)
ALONE_ROUNDS = 2
ALONE_S = 8.0  # kept from the rounds' time for it
PROBE_ALONE = ("resident", "e32", "top1")  # the probe's all-resident groups (by a case of each) in it


@dataclass
class Joint:
    """profile: the probe's (fitted now, or the cached one); runs: the caller's case key -> its
    measured runs (one a round); cut: what was not measured, and why; seconds: by phase; alone:
    the alone check's runs (the probe's by run_name, the caller's by key)."""

    profile: object
    runs: dict
    cut: list = field(default_factory=list)
    seconds: dict = field(default_factory=dict)
    probed: bool = False
    alone: dict = field(default_factory=dict)  # name -> runs measured with the rest of the pool ended
    pooled: dict = field(default_factory=dict)  # name -> the rounds' runs, the probe's and the caller's


def measure_joint(backend: str, cache_dir: Path, cases: list[tuple], *, tokens: int, deadline: float,
                  case_timeout: float, rounds: int, remeasure: bool = False, progress=None,
                  while_warming: Callable[[], None] | None = None, on_run=None, alone: tuple = ()) -> Joint:
    """cases: (key, model path, Config overrides, group name) of the caller's runs; a group's runs
    share a child (put a model's all-resident and streaming cases in different groups: they compile
    different kernels). deadline: time.monotonic() by which the last run must have ended.
    on_run(name, round, run, alone): each measured run as it comes in, the probe's (by run_name) and
    the caller's (by key), so that a run cut off at its limit still leaves them. alone: caller keys
    whose groups, with the probe's all-resident ones (PROBE_ALONE), get the alone check
    (ALONE_ROUNDS) after the rounds; its runs are reported apart (`Joint.alone`), not fitted."""
    from strata.doctor.pool import RunPool, measure_rounds
    from strata.doctor.probe import cached_profile, measure_parts, profile_from_runs, save_profile
    from strata.doctor.probe_engine import CALIBRATION_TOKENS, engine_cases, median_run
    from strata.doctor.engine_fit import run_name

    say = progress or (lambda _msg: None)
    seconds: dict = {}
    t = time.monotonic()
    profile = None if remeasure else cached_profile(backend, cache_dir, quick=True)
    with tempfile.TemporaryDirectory() as d:
        eng = parts = None
        probe_groups: list = []
        if profile is None:
            parts = measure_parts(backend, Path(cache_dir), progress=say, quick=True)
            eng = engine_cases(Path(d), quick=True)
            if parts["kernel_threads"]:  # the engine runs on the threads the products were timed on
                eng = dataclasses.replace(eng, cases=tuple((key, path, {**o, "threads": parts["kernel_threads"]}, group)
                                                           for key, path, o, group in eng.cases))
            probe_groups = eng.groups()
        seconds["parts"] = time.monotonic() - t
        mine: dict[str, list] = {}
        for case in cases:
            mine.setdefault(case[3], []).append(case)
        groups = probe_groups + list(mine.values())
        n_tokens = [CALIBRATION_TOKENS] * len(probe_groups) + [tokens] * len(mine)
        say(f"engine: {sum(map(len, groups))} cases in {len(groups)} warmed processes")
        t = time.monotonic()
        with RunPool([[(path, {"backend": backend, **o}) for _, path, o, _ in g] for g in groups],
                     max_tokens=n_tokens) as pool:
            warm_by = t + WARM_SHARE * (deadline - t)  # the caller's work runs inside it, not after it
            if while_warming is not None:
                while_warming()
            pool.ready(max(1.0, warm_by - time.monotonic()))
            seconds["warm_up"] = time.monotonic() - t
            say(f"warmed up in {seconds['warm_up']:.1f} s; measuring")
            t = time.monotonic()
            names = {(gi, i): run_name(case[0]) if gi < len(probe_groups) else case[0]
                     for gi, g in enumerate(groups) for i, case in enumerate(g)}
            tell = None if on_run is None else (lambda g, i, r, run: on_run(names[(g, i)], r, run, False))
            got, cut, took = measure_rounds(pool, rounds, deadline - (ALONE_S if alone else 0.0),
                                            run_timeout=case_timeout, on_run=tell)
            seconds["rounds"] = time.monotonic() - t
            seconds.update({f"round_{r + 1}": s for r, s in enumerate(took)})
            keep = {gi for gi, g in enumerate(groups) for case in g  # the caller's chosen, the probe's resident
                    if case[0] in alone if gi >= len(probe_groups)} | {
                gi for gi, g in enumerate(groups[:len(probe_groups)]) for case in g if case[0] in PROBE_ALONE}
            solo = _alone(pool, sorted(keep), deadline, case_timeout, names, on_run) if alone else {}
        cut = [_named(c, names) for c in cut]
        runs = {groups[gi][i][0]: rs for (gi, i), rs in got.items() if gi >= len(probe_groups)}
        pooled = {names[key]: rs for key, rs in got.items() if rs}
        if eng is not None:
            probe_runs = {groups[gi][i][0]: median_run(rs) for (gi, i), rs in got.items()
                          if gi < len(probe_groups) and rs}
            missing = [run_name(k) for k, _, _, _ in eng.cases if k not in probe_runs]
            if not eng.essential <= set(probe_runs):
                raise RuntimeError(f"quick probe: engine runs {', '.join(missing)} not measured ({'; '.join(cut)})")
            profile = profile_from_runs(backend, parts, eng, probe_runs, quick=True, missing=tuple(missing))
            save_profile(profile, cache_dir, quick=True)
    return Joint(profile=profile, runs=runs, cut=cut, seconds=seconds, probed=eng is not None, alone=solo,
                 pooled=pooled)


def _alone(pool, keep: list, deadline: float, case_timeout: float, names: dict, on_run) -> dict:
    """The alone check (ALONE_ROUNDS): end every child but `keep`'s, measure theirs again."""
    pool.keep_only(set(keep))
    out: dict = {}
    for r in range(ALONE_ROUNDS):
        for g in keep:
            for i in range(len(pool.groups[g])):
                left = deadline - time.monotonic()
                run = pool.measure(g, i, timeout=min(case_timeout, left)) if left > 1 else None
                if run is None:
                    continue
                out.setdefault(names[(g, i)], []).append(run)
                if on_run is not None:
                    on_run(names[(g, i)], r, run, True)
    return out


def _named(cut: str, names: dict) -> str:
    """'group G run I round R: why' with the run's name for G, I."""
    head, _, why = cut.partition(": ")
    words = head.split()
    g, i = int(words[1]), int(words[3])
    return f"{names[(g, i)]} {' '.join(words[4:])}: {why}"
