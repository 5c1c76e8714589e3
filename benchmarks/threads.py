"""numpy's BLAS threads on the CPU path: decode and prompt tok/s of `strata generate` per thread
setting, on an idle machine and under load (N busy processes competing for the cores).

Each run is a fresh `strata generate` process (the thread count is fixed at its start), greedy,
on the embedded model unless --model names another. Settings: `auto` (strata's choice,
strata/threads.py), a number (`--threads N`), and `default` (OpenBLAS's own: one thread per
core, what strata did before it chose; reproduced with OPENBLAS_NUM_THREADS = nproc).

    python benchmarks/threads.py --threads default,auto,1,2 --load 0,2 --repeat 3
prints a table and one JSON line (`JSON {...}`).
"""

from __future__ import annotations

import argparse
import json
import os
import re
import statistics
import subprocess
import sys
import time

SUMMARY = re.compile(r"\[(\d+) prompt tokens at ([0-9.]+) tok/s, (\d+) generated at ([0-9.]+) tok/s")
BLAS_ENV = ("OPENBLAS_NUM_THREADS", "OMP_NUM_THREADS", "MKL_NUM_THREADS")
BUSY = "while True: pass"


def run_once(setting: str, model: str | None, prompt: str, tokens: int) -> tuple[float, float]:
    env = {k: v for k, v in os.environ.items() if k not in BLAS_ENV and not k.startswith("STRATA_")}
    argv = [sys.executable, "-m", "strata.cli.main", "generate", *([model] if model else []), prompt, "-n", str(tokens),
            "--temp", "0"]  # greedy on every model (the embedded one samples by default: its demo)
    if setting == "default":
        env.update({k: str(os.cpu_count()) for k in BLAS_ENV})
    elif setting != "auto":
        argv += ["--threads", setting]
    out = subprocess.run(argv, env=env, capture_output=True, text=True, timeout=600)
    m = SUMMARY.search(out.stderr)
    if not m:
        raise SystemExit(f"no summary line from {' '.join(argv)}:\n{out.stderr[-2000:]}")
    return float(m.group(2)), float(m.group(4))


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--threads", default="default,auto,1,2", help="settings, comma-separated (default, auto, N)")
    ap.add_argument("--load", default="0,2", help="busy processes running beside it, comma-separated")
    ap.add_argument("--repeat", type=int, default=3, help="runs per cell (the median is reported)")
    ap.add_argument("--tokens", type=int, default=64)
    ap.add_argument("--model", default=None, help="a strata model (default: the embedded one)")
    ap.add_argument("--prompt", default="def fibonacci(n):")
    args = ap.parse_args()
    settings = [s.strip() for s in args.threads.split(",") if s.strip()]
    loads = [int(x) for x in args.load.split(",")]
    rows = []
    for load in loads:
        busy = [subprocess.Popen([sys.executable, "-c", BUSY]) for _ in range(load)]
        try:
            time.sleep(0.5 if load else 0)
            runs = {s: [] for s in settings}
            for _ in range(args.repeat):  # round robin: a drift in the machine's load hits every setting alike
                for s in settings:
                    runs[s].append(run_once(s, args.model, args.prompt, args.tokens))
            for s in settings:
                rows.append(dict(load=load, threads=s, prompt_tps=statistics.median(r[0] for r in runs[s]),
                                 decode_tps=statistics.median(r[1] for r in runs[s]),
                                 decode_all=[r[1] for r in runs[s]], loadavg=os.getloadavg()[0]))
        finally:
            for p in busy:
                p.kill()
                p.wait()
    print(f"\n## BLAS threads: {args.model or 'embedded model'}, {args.tokens} tokens, {os.cpu_count()} cores, "
          f"median of {args.repeat}")
    print("| busy processes | threads | prompt tok/s | decode tok/s | decode runs | load avg |")
    print("|---|---|---|---|---|---|")
    for r in rows:
        print(f"| {r['load']} | {r['threads']} | {r['prompt_tps']:.1f} | {r['decode_tps']:.1f} | "
              f"{', '.join(f'{x:.1f}' for x in r['decode_all'])} | {r['loadavg']:.1f} |")
    print("JSON " + json.dumps(dict(bench="threads", cores=os.cpu_count(), model=args.model or "embedded",
                                    tokens=args.tokens, rows=rows)))


if __name__ == "__main__":
    main()
