"""Prompt tok/s of the all-resident numpy engine: the reference `forward` (what
`ReferenceEngine._prefill` ran before: experts token by token, the head on every position)
against the numpy prompt path (strata/numpy_backend/prompt.py: each expert once over its
tokens, the head on the last position), in one process, alternating, on the same prompts.

    python benchmarks/prompt.py --lengths 64,256 --repeat 5
    python benchmarks/prompt.py --mlx --lengths 512,2048   # the MLX engine's prompt path (prompt_mlx.py)
prints a table and one JSON line (`JSON {...}`), with the load average (a shared machine's load
moves both columns alike: the ratio is the figure to read).
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import time
from pathlib import Path

import numpy as np

import strata
from strata.numpy_backend.engine import ReferenceEngine
from strata.reference.model import ModelState, forward
from strata.threads import apply_threads, blas_threads

HELDOUT = Path(strata.__file__).parent / "data" / "heldout.txt"


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--lengths", default="64,256", help="prompt lengths in tokens, comma-separated")
    ap.add_argument("--repeat", type=int, default=5, help="runs per cell (the median is reported)")
    ap.add_argument("--threads", type=int, default=0, help="BLAS threads (0: strata's choice)")
    ap.add_argument("--model", default=None, help="a strata model (default: the embedded one)")
    ap.add_argument("--mlx", action="store_true", help="the MLX engine's prompt path at the seed shape (prompt_mlx.py)")
    ap.add_argument("--small", action="store_true", help="--mlx: a small shape (smoke test)")
    ap.add_argument("--shared", action="store_true", help="--mlx: the seed shape with its shared expert")
    ap.add_argument("--streaming", type=int, default=0, metavar="SLOTS",
                    help="--mlx: also a streaming engine's prompt with an arena of SLOTS slots")
    ap.add_argument("--gemms", default="", help="--mlx: grouped GEMMs to time, comma list of gather,padded,tiled,q2mma "
                    "(default: all but gather where it is not the device's default: on CUDA it runs on SIMT cores)")
    ap.add_argument("--skip-old", action="store_true", help="--mlx: do not time the decode kernels' forward")
    args = ap.parse_args()
    if args.mlx:
        import prompt_mlx  # benchmarks/ is on sys.path when run as a script

        return prompt_mlx.main(args)
    model = strata.load(args.model)
    apply_threads(args.threads, model.cfg.hidden_size)
    params = model.resident_params()
    text = model.tokenizer.encode(HELDOUT.read_text())
    rows = []
    for n in (int(x) for x in args.lengths.split(",")):
        tokens = np.asarray(text[:n], np.int64)
        ways = {
            "reference forward": lambda: forward(params, ModelState.empty(model.cfg), tokens)[0][-1],
            "prompt path": lambda: ReferenceEngine(params).prefill(tokens),
        }
        times = {w: [] for w in ways}
        out = {}
        for _ in range(args.repeat):  # round robin: a drift in the machine's load hits both alike
            for w, run in ways.items():
                t0 = time.perf_counter()
                out[w] = run()
                times[w].append(time.perf_counter() - t0)
        ref, got = out["reference forward"], out["prompt path"]
        same = bool(np.argmax(ref) == np.argmax(got))
        diff = float(np.max(np.abs(ref - got)) / np.max(np.abs(ref)))
        tps = {w: n / statistics.median(t) for w, t in times.items()}
        rows.append(dict(tokens=n, before_tps=tps["reference forward"], after_tps=tps["prompt path"],
                         speedup=tps["prompt path"] / tps["reference forward"], same_argmax=same,
                         max_rel_diff=diff, loadavg=os.getloadavg()[0]))
    print(f"\n## Prompt path: {args.model or 'embedded model'}, {os.cpu_count()} cores, BLAS threads "
          f"{blas_threads()}, median of {args.repeat}")
    print("| prompt tokens | before tok/s (reference forward) | after tok/s (prompt path) | speedup | "
          "same argmax | max rel Δlogit | load avg |")
    print("|---|---|---|---|---|---|---|")
    for r in rows:
        print(f"| {r['tokens']} | {r['before_tps']:.1f} | {r['after_tps']:.1f} | {r['speedup']:.2f}× | "
              f"{r['same_argmax']} | {r['max_rel_diff']:.1e} | {r['loadavg']:.1f} |")
    print("JSON " + json.dumps(dict(bench="prompt", cores=os.cpu_count(), threads=blas_threads(),
                                    model=args.model or "embedded", repeat=args.repeat, rows=rows)))


if __name__ == "__main__":
    main()
