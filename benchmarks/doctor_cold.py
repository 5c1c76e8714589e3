"""`strata doctor` on a cold cache: how long until the first answer (target: within 60 s on the
2-core machine, about half a minute on a quiet one), and what `--calibrate` costs.

Each run is a fresh `strata doctor MODEL --cache-dir EMPTY_DIR` process (so nothing is cached);
`--calibrate` adds a run with the full probe. The 1-minute load average before each run is
printed beside it: on a shared machine the wall time grows with it, the CPU time much less.

    python benchmarks/doctor_cold.py                      # the embedded model, the first answer only
    python benchmarks/doctor_cold.py --calibrate --repeat 2

prints a table and one JSON line (`JSON {...}`).
"""

from __future__ import annotations

import argparse
import json
import os
import resource
import subprocess
import sys
import tempfile
import time

TARGET_S = 60.0  # the first answer on the 2-core machine (docs/doctor.md, "Cold-cache time")


def run_once(model: str, calibrate: bool) -> dict:
    load = os.getloadavg()[0]
    before = resource.getrusage(resource.RUSAGE_CHILDREN)
    with tempfile.TemporaryDirectory() as cache:
        argv = [sys.executable, "-m", "strata.cli.main", "doctor", model, "--cache-dir", cache]
        start = time.perf_counter()
        out = subprocess.run(argv + (["--calibrate"] if calibrate else []), capture_output=True, text=True,
                             timeout=1800)
        wall = time.perf_counter() - start
    after = resource.getrusage(resource.RUSAGE_CHILDREN)
    if out.returncode != 0:
        raise SystemExit(f"{' '.join(argv)} failed:\n{out.stderr[-2000:]}")
    verdict = next((line for line in out.stdout.splitlines() if line.startswith("verdict:")), "")
    cpu = (after.ru_utime - before.ru_utime) + (after.ru_stime - before.ru_stime)
    return {"probe": "full (--calibrate)" if calibrate else "quick (first answer)", "wall_s": round(wall, 1),
            "cpu_s": round(cpu, 1), "load_avg": round(load, 1), "verdict": verdict.removeprefix("verdict: ")}


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--model", default="default", help="what to diagnose (default: the embedded model)")
    ap.add_argument("--repeat", type=int, default=1, help="runs of each probe")
    ap.add_argument("--calibrate", action="store_true", help="also time the full probe (several minutes)")
    args = ap.parse_args()
    rows = []
    for _ in range(args.repeat):
        rows.append(run_once(args.model, calibrate=False))
        if args.calibrate:
            rows.append(run_once(args.model, calibrate=True))
    print("| probe | wall s | CPU s | load avg | verdict |")
    print("| --- | --- | --- | --- | --- |")
    for r in rows:
        print(f"| {r['probe']} | {r['wall_s']} | {r['cpu_s']} | {r['load_avg']} | {r['verdict']} |")
    first = [r["wall_s"] for r in rows if r["probe"].startswith("quick")]
    print("JSON " + json.dumps({"benchmark": "doctor_cold", "model": args.model, "target_s": TARGET_S,
                                "first_answer_max_s": max(first), "within_target": max(first) <= TARGET_S,
                                "runs": rows}))


if __name__ == "__main__":
    main()
