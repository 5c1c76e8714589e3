"""`strata doctor` against `generate` under cgroup memory limits: at each limit the doctor runs
in the limited group (as a user on a machine of that size would run it), then the side-by-side
benchmark's strata worker (default settings) in a fresh group of the same limit; the table puts
the doctor's plan (arena slots, read-ahead depth), its kernel threads and its decode tok/s beside
the run's, with the doctor's per-part costs (ms a token) and the load average around each pair.
Last, one JSON line.

    nice -n 10 python benchmarks/doctor_under_limits.py --expert-type q8_0 --limits none,75%,50%,30%,15%

The models are the side-by-side's (benchmarks/llama_cpp_side_by_side.py: made, exported by
llama.cpp's tools, converted by strata); a limit is that share of llama.cpp's GGUF, as there.
The doctor's machine profile must be cached before (a probe inside a limited group would measure
the limit): run `strata doctor MODEL --backend numpy` once without a limit.
"""

from __future__ import annotations

import argparse
import json
import os
import re
import sys
from pathlib import Path

HERE = Path(__file__).resolve()
sys.path.insert(0, str(HERE.parent))

from _memory_limit import evict, limit_support, run_limited, warm  # noqa: E402
from llama_cpp_side_by_side import DEFAULT_WORK, _parse_limits, strata_run  # noqa: E402

DOCTOR_TIMEOUT_S = 300


def doctor_run(model: Path, limit: int | None, form) -> dict:
    """`strata doctor MODEL --backend numpy --json` in a group limited to `limit`: its plan, tok/s
    and per-part costs, or the error it ended with."""
    cmd = [sys.executable, "-c", "import sys; from strata.cli.main import main; sys.exit(main(sys.argv[1:]))",
           "doctor", str(model), "--backend", "numpy", "--json"]
    if limit is not None:
        evict(model, model.with_suffix(".experts"))
    env = {**os.environ, "PYTHONPATH": str(HERE.parents[1])}
    r = run_limited(cmd, limit, form, timeout=DOCTOR_TIMEOUT_S, env=env)
    if r.returncode != 0:
        return dict(error=(r.stderr.strip().splitlines() or [f"exit {r.returncode}"])[-1][:160])
    d = json.loads(r.stdout)
    p = d["prediction"]
    depth = re.search(r"depth \d+ -> (\d+)", p.get("plan_reason", ""))  # a short arena's fitted read-ahead
    return dict(tok_s=round(p["tok_per_s"], 2), verdict=p["verdict"], arena_slots=p["arena_slots"],
                depth=int(depth.group(1)) if depth else None, plan=p.get("plan_reason", ""),
                kernel_threads=d["machine"].get("kernel_threads"),
                ms_per_token={k: round(v, 2) for k, v in p.get("breakdown", {}).items()},
                reads_per_token=round((p.get("locality") or {}).get("reads_per_token", 0.0), 1))


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--expert-type", choices=("q8_0", "q4_0"), default="q8_0")
    ap.add_argument("--bench-dir", type=Path, default=DEFAULT_WORK,
                    help="folder of the side-by-side's models (its --work; default: %(default)s)")
    ap.add_argument("--limits", default="none,75%,50%,30%,15%", help="shares of llama.cpp's GGUF (default: %(default)s)")
    ap.add_argument("--tokens", type=int, default=16, help="decode tokens per run (default 16)")
    ap.add_argument("--prompt", type=int, default=32, help="prompt tokens per run (default 32)")
    ap.add_argument("--threads", type=int, default=0,
                    help="the kernels' threads of the doctor and the run (STRATA_THREADS; default 0: each picks "
                         "the cores idle at its own start, as a user's would)")
    args = ap.parse_args()
    if args.threads:  # both children read it (Config's STRATA_<FIELD>)
        os.environ["STRATA_THREADS"] = str(args.threads)
    stem = f"qwen3moe_{args.expert_type}_d1024_f512_l16_e64k8_v4096"
    gguf, model = args.bench_dir / f"{stem}.llama.gguf", args.bench_dir / f"{stem}-strata.gguf"
    if not (gguf.exists() and model.exists()):
        raise SystemExit(f"doctor_under_limits: no {gguf.name} and {model.name} in {args.bench_dir}; make them with "
                         "benchmarks/llama_cpp_side_by_side.py (docs/cpu.md) and pass --bench-dir")
    form, how = limit_support()
    rows = []
    for share in _parse_limits(args.limits):
        limit = None if share is None else int(gguf.stat().st_size * share)
        if limit is not None and form is None:
            raise SystemExit(f"doctor_under_limits: memory limits not available here ({how})")
        if limit is None:
            warm(model, model.with_suffix(".experts"))
        load_before = os.getloadavg()[0]
        doc = doctor_run(model, limit, form)
        if limit is None:
            warm(model, model.with_suffix(".experts"))
        run = strata_run(model, limit, form, args)
        row = dict(limit="none" if share is None else f"{share:.0%}", limit_bytes=limit, doctor=doc, run=run,
                   load_avg=[round(load_before, 2), round(os.getloadavg()[0], 2)])
        if args.threads and "decode_tok_s" in run:
            run["kernel_threads"] = args.threads
        if "tok_s" in doc and "decode_tok_s" in run:
            row["error"] = round(doc["tok_s"] / run["decode_tok_s"] - 1, 3)
        rows.append(row)
        print(json.dumps(row), file=sys.stderr, flush=True)
    print(f"\n{args.expert_type.upper()} experts ({model.name}); {args.prompt} prompt + {args.tokens} decode tokens; "
          f"kernel threads {args.threads or 'auto'}\n")
    print("| limit | doctor plan | run plan | doctor threads | run threads | predicted tok/s | measured tok/s | error "
          "| doctor ms/token (layers, weights, reads, turns, urgent waits) | load avg |")
    print("|---|---|---|---|---|---|---|---|---|---|")
    for r in rows:
        d, g = r["doctor"], r["run"]
        dp = "resident" if not d.get("arena_slots") else f"{d['arena_slots']} slots" + (
            f", read-ahead depth {d['depth']}" if d.get("depth") is not None else "")
        gp = "resident" if not g.get("arena_slots") else f"{g['arena_slots']} slots ({g.get('io', '')[:40]})"
        ms = d.get("ms_per_token", {})
        parts = ", ".join(f"{ms.get(k, 0):.1f}" for k in ("layers", "weights", "reads", "turns", "urgent_waits"))
        err = f"{r['error']:+.1%}" if "error" in r else d.get("error", "") or g.get("error", "")
        print(f"| {r['limit']} | {dp} | {gp} | {d.get('kernel_threads')} | {g.get('kernel_threads')} | "
              f"{d.get('tok_s', '-')} | {g.get('decode_tok_s', '-')} | {err} | {parts} | "
              f"{r['load_avg'][0]}-{r['load_avg'][1]} |")
    print("JSON " + json.dumps(dict(bench="doctor_under_limits", expert_type=args.expert_type, limits_by=how,
                                    tokens=args.tokens, prompt=args.prompt, threads=args.threads or "auto",
                                    rows=rows), sort_keys=True))


if __name__ == "__main__":
    main()
