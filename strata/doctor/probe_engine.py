"""The probe's engine cases: its made models, the runs of each (a case), and how they are measured.

Cases (engine_fit.py fits them): "resident" (the `tiny` shape, CALIBRATION_LAYERS layers of
CALIBRATION_EXPERTS experts, all-resident), "top1" (the same at top-1), "short", "mid" and "e32"
(ALL_RESIDENT_POINTS: fewer layers, fewer experts), "wide" (WIDE_FFN-wide experts), the made
model streaming at several arenas (int keys) and the wide one at two (("wide", slots) keys).

Measured either in a fresh process per run, in interleaved rounds (`run_fresh`: the CPU
machine), or over a `RunPool` (`run_pooled`: a GPU machine, where each case's kernels compile
in its child while the other children compile theirs). A pool's groups keep a model's
all-resident and streaming cases apart: they compile different kernels (the compiled decode
step; the streaming layer's pieces), so two children compile them at once.
"""

from __future__ import annotations

import time
from dataclasses import dataclass
from pathlib import Path

from strata.doctor.engine_fit import (
    ALL_RESIDENT_POINTS, CALIBRATION_EXPERTS, CALIBRATION_LAYERS, WIDE_FFN, run_name, token_s,
)

__all__ = ["EngineCases", "engine_cases", "run_fresh", "run_pooled", "median_run", "CALIBRATION_TOKENS",
           "CALIBRATION_REPEATS", "POOL_ROUNDS"]

CALIBRATION_TOKENS = 32
CALIBRATION_REPEATS = 3  # runs per engine case; the median one counts (a loaded machine's runs scatter)
POOL_ROUNDS = 3  # a pooled probe's rounds, as many as its time allows (at least one)


@dataclass(frozen=True)
class EngineCases:
    """cases: (key, model path, Config overrides, pool group name) in measuring order; the made
    model's ModelConfig, slot and record bytes; `essential`: the keys the fit cannot do without."""

    cases: tuple
    cfg: object
    slot: int
    record: int
    essential: frozenset

    def groups(self) -> list[list[tuple]]:
        """The cases by pool group, in order of first appearance."""
        out: dict[str, list] = {}
        for case in self.cases:
            out.setdefault(case[3], []).append(case)
        return list(out.values())


def engine_cases(d: Path, *, quick: bool) -> EngineCases:
    """Write the probe's made models under `d` and list their cases (quick: three streaming arenas,
    the fewest the least-squares fit of turn_s, turn_slot_s and read_s takes; else four)."""
    from strata.config import Config
    from strata.formats.expert_record import RecordLayout
    from strata.formats.quant_types import QuantType
    from strata.loader import load
    from strata.runtime.decode import cache_config_for
    from strata.testing.models import make_model

    made = make_model(d / "probe", "tiny", n_layers=CALIBRATION_LAYERS, n_experts=CALIBRATION_EXPERTS)
    model = load(made.model_path)
    total = model.experts_file.header.n_records
    least = cache_config_for(model, Config(), 1).min_capacity
    slot = model.experts_file.header.padded_bytes
    record = RecordLayout(QuantType(model.experts_file.header.qtype), made.cfg.hidden_size,
                          made.cfg.expert_ffn_size).record_bytes
    model.experts_file.close()
    arenas = sorted({least, total // 2, total} if quick else {least, total // 3, 2 * total // 3, total})
    one = make_model(d / "probe1", "tiny", n_layers=CALIBRATION_LAYERS, n_experts=CALIBRATION_EXPERTS,
                     n_experts_per_token=1)
    wide = make_model(d / "probe3", "tiny", n_layers=CALIBRATION_LAYERS, n_experts=CALIBRATION_EXPERTS,
                      expert_ffn_size=WIDE_FFN)
    stream = lambda c: {"arena": f"{c}slots", "profile": True}  # noqa: E731
    cases = [("resident", made.model_path, {}, "resident")]
    for key, fields in ALL_RESIDENT_POINTS.items():  # the step fit's other points
        other = make_model(d / f"probe-{key}", "tiny", **{"n_layers": CALIBRATION_LAYERS,
                                                           "n_experts": CALIBRATION_EXPERTS, **fields})
        # fewer layers: "resident"'s kernels, its child; fewer experts: kernels of their own, a child
        cases.append((key, other.model_path, {}, "resident" if "n_experts" not in fields else key))
    cases += [(c, made.model_path, stream(c), "streaming") for c in arenas]
    cases += [("top1", one.model_path, {}, "top1"), ("wide", wide.model_path, {}, "wide")]
    cases += [(("wide", c), wide.model_path, stream(c), "wide-streaming") for c in (least, total // 2)]
    return EngineCases(tuple(cases), made.cfg, slot, record, frozenset(["resident", "top1", *arenas]))


def median_run(runs: list):
    """The median of a case's runs by seconds per decode call (the slower of two)."""
    return sorted(runs, key=token_s)[len(runs) // 2]


def run_fresh(eng: EngineCases, backend: str, progress=None) -> dict:
    """Every case in a fresh process per run (`measure_quiet`), CALIBRATION_REPEATS interleaved
    rounds (a load burst hits every case alike); key -> the median run."""
    from strata.doctor.measure import measure_quiet

    tries: dict = {key: [] for key, _, _, _ in eng.cases}
    for round_ in range(CALIBRATION_REPEATS):
        for key, path, o, _ in eng.cases:
            if progress:
                progress(f"engine: {run_name(key)} ({round_ + 1}/{CALIBRATION_REPEATS})")
            tries[key].append(measure_quiet(path, {"backend": backend, **o}, max_tokens=CALIBRATION_TOKENS))
    return {key: median_run(t) for key, t in tries.items()}


def run_pooled(eng: EngineCases, backend: str, timeout: float, progress=None, rounds: int = POOL_ROUNDS) -> tuple:
    """Every case over a RunPool (module docstring), up to `rounds` interleaved rounds within
    `timeout` seconds; (key -> the median run, keys not measured). Raises if an essential case
    was not measured."""
    from strata.doctor.pool import RunPool, measure_rounds

    deadline = time.monotonic() + timeout
    groups = eng.groups()
    if progress:
        progress(f"engine: {len(eng.cases)} cases in {len(groups)} warmed processes (starting them)")
    done = [0]

    def measured(g: int, i: int, r: int, run) -> None:  # a line per run: the engine part is most of the probe
        done[0] += 1
        if progress:
            progress(f"engine: {run_name(groups[g][i][0])} measured ({done[0]} of up to {len(eng.cases) * rounds})")

    with RunPool([[(path, {"backend": backend, **o}) for _, path, o, _ in g] for g in groups],
                 max_tokens=CALIBRATION_TOKENS) as pool:
        pool.ready(max(1.0, deadline - time.monotonic()))
        got, _, _ = measure_rounds(pool, rounds, deadline, run_timeout=timeout, on_run=measured)
    runs = {g[i][0]: median_run(rs) for (gi, i), rs in got.items() if rs for g in [groups[gi]]}
    missing = [run_name(key) for key, _, _, _ in eng.cases if key not in runs]
    if not eng.essential <= set(runs):
        raise RuntimeError(f"quick probe: engine runs {', '.join(missing)} did not finish within {timeout:.0f} s")
    return runs, missing
