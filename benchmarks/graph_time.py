"""A decoded token's GPU time inside MLX's CUDA graphs against the sum of its kernels' own times:
what the boundaries between a token's launches cost on the GPU.

ncu times each kernel alone by default (`--graph-profiling node`); with `--graph-profiling graph`
it times each CUDA graph MLX launches as one workload, the gaps between its kernels included. The
same steps under both, inside a profiler range (cuProfilerStart / Stop around the measured steps
only: the trace's JIT compiles and the warm-up stay out), give both sums a token:

    ncu --profile-from-start off --graph-profiling graph --metrics gpu__time_duration.sum --csv \\
        python3 benchmarks/graph_time.py --steps 8 | python3 benchmarks/graph_time.py --sum --steps 8
    (the same with --graph-profiling node: the kernels' own times)

Alone (no ncu) it prints the steps' wall time a token, back to back. Seed shape without a shared
expert, all-resident, context 8 (--context: another); --form: one of decode_context.py's
switched forms.
"""

from __future__ import annotations

import argparse
import ctypes
import glob
import json
import sys
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))
sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

def _profiler():
    """(start, stop) of the CUDA profiler range, from the runtime library where one is found
    (it makes the device's context current itself), else the driver's; None where neither loads."""
    names = ["libcudart.so.13", "libcudart.so.12", "libcudart.so"]
    for site in sys.path:
        names += sorted(glob.glob(str(Path(site) / "nvidia" / "*" / "lib" / "libcudart.so*")))
    for name in names:
        try:
            lib = ctypes.CDLL(name)
            return lib.cudaProfilerStart, lib.cudaProfilerStop, name
        except OSError:
            continue
    try:
        lib = ctypes.CDLL("libcuda.so.1")
        return lib.cuProfilerStart, lib.cuProfilerStop, "libcuda.so.1"
    except OSError:
        return None


def run(layers: int, steps: int, form: str, context: int = 8) -> dict:
    import mlx.core as mx
    from decode_context import switched
    from host_cost import _made

    from strata.mlx_backend.compiled import CompiledDecode
    from strata.mlx_backend.greedy import greedy_select
    from strata.mlx_backend.kernels.launch import LAUNCHES, KernelPath, using_path

    # the form's switches for the whole run: the trace takes most, the selection each step's
    with using_path(KernelPath.GPU), switched(form):
        p, state = _made(layers, context)
        step = CompiledDecode(p, state, traced=True)
        before = sum(LAUNCHES.values())
        logits, state = step(state, 1)
        launches = sum(LAUNCHES.values()) - before
        sel = greedy_select(logits)
        mx.eval(sel)
        for _ in range(4):
            logits, state = step(state, sel)
            sel = greedy_select(logits)
            mx.async_eval(sel)
        mx.eval(sel)
        prof = _profiler()
        rc = prof[0]() if prof else None
        t0 = time.perf_counter()
        for _ in range(steps):
            logits, state = step(state, sel)
            sel = greedy_select(logits)
            mx.async_eval(sel)
        mx.eval(sel)
        wall = time.perf_counter() - t0
        if prof:
            prof[1]()
    return {"form": form, "layers": layers, "context": context, "steps": steps, "launches_a_token": launches,
            "wall_ms_a_token": wall / steps * 1e3, "profiler": prof[2] if prof else None, "profiler_start_rc": rc}


def summed(steps: int, lines) -> dict:
    """The gpu__time_duration rows of ncu's CSV in `lines`, summed; other lines printed through."""
    from ncu_summary import gpu_time_rows, row_us

    rows = gpu_time_rows(lines)
    total = sum(row_us(r) for r in rows)
    return {"workloads": len(rows), "total_us": total, "us_a_token": total / steps, "workloads_a_token": len(rows) / steps}


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0],
                                 formatter_class=argparse.RawDescriptionHelpFormatter,
                                 epilog="example: ncu --profile-from-start off --graph-profiling graph --metrics "
                                        "gpu__time_duration.sum --csv python3 benchmarks/graph_time.py | "
                                        "python3 benchmarks/graph_time.py --sum")
    ap.add_argument("--layers", type=int, default=48)
    ap.add_argument("--steps", type=int, default=8, help="measured decode steps (inside the profiler range)")
    ap.add_argument("--form", default="default", help="decode_context.py's switched form, or default")
    ap.add_argument("--context", type=int, default=8, help="positions before the first decoded token (default 8; "
                                                           "past 256 the attention splits)")
    ap.add_argument("--sum", action="store_true", help="read ncu's CSV on stdin and sum its GPU times a step")
    ap.add_argument("--label", default="", help="with --sum: the label of the JSON line")
    args = ap.parse_args()
    if args.sum:
        out = {"bench": "graph_time", "label": args.label, **summed(args.steps, sys.stdin)}
        print(f"{args.label}: {out['workloads']} workloads, {out['us_a_token']:.1f} us of GPU time a step "
              f"({out['workloads_a_token']:.1f} workloads a step)")
    else:
        out = {"bench": "graph_time", **run(args.layers, args.steps, args.form, args.context)}
        print(f"{args.form} at {args.context}: {out['wall_ms_a_token']:.3f} ms a token back to back, {out['launches_a_token']} launches "
              f"(profiler range: {out['profiler']}, rc {out['profiler_start_rc']})")
    print("JSON " + json.dumps(out, sort_keys=True))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
