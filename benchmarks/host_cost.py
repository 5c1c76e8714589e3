"""Where a decoded token's wall time goes on the GPU (issue 19): the host's encoding against the GPU.

The compiled decode step at context 8 (the seed shape without a shared expert, as
decode_context.py) pushed back to back the way generate's device loop pushes it: each step's
token is the previous step's device selection, nothing read back until the end. Per step the
host's two parts are timed apart: the compiled call (MLX replays the traced graph: lazy arrays)
and `mx.async_eval` (MLX runs every node's `eval_gpu` on this thread: the custom kernels'
arguments, the CUDA graph's nodes, a graph commit every `max_ops_per_graph` nodes). If the
host's per-step sum is about the wall time per step, the token is host-bound and launches (or
what each costs to encode) are the lever; if the wall is larger, the GPU is.

The step is also timed alone (one step from an idle queue, read back: host + GPU in series)
and at fewer layers (what a layer costs against what a token costs once), and, in child
processes, under MLX's other launch modes (read when MLX starts): CUDA graphs off, and larger
or smaller graphs.

    python3 benchmarks/host_cost.py                        # GPU: 48 and 12 layers, the env variants
    python3 benchmarks/host_cost.py --layers 48 --no-env   # one process only

Prints a table and one JSON line.
"""

from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
import time
from dataclasses import replace
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))
sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

import mlx.core as mx  # noqa: E402
import numpy as np  # noqa: E402

from _measure import known_forms  # noqa: E402
from decode_context import SHAPE, SWITCHES, state_at, switched  # noqa: E402
from decode_memory import resident_distinct  # noqa: E402
from strata.mlx_backend.compiled import CompiledDecode  # noqa: E402
from strata.mlx_backend.greedy import greedy_select  # noqa: E402
from strata.mlx_backend.kernels import launch  # noqa: E402
from strata.mlx_backend.kernels.launch import LAUNCHES, KernelPath, current_path, using_path  # noqa: E402
from strata.testing.mlx_params import random_params  # noqa: E402

# (name, environment) of the child processes: MLX reads these once, when it makes the CUDA encoder
ENV_VARIANTS = (
    ("graphs_off", {"MLX_USE_CUDA_GRAPHS": "0"}),
    ("ops_per_graph_1000", {"MLX_MAX_OPS_PER_BUFFER": "1000"}),
    ("ops_per_graph_25", {"MLX_MAX_OPS_PER_BUFFER": "25"}),
    ("full_prelude", {"STRATA_CUDA_FULL_PRELUDE": "1"}),  # every CUDA kernel with the whole 6 KB prelude, as before
)


def _made(layers: int, context: int = 8):
    """The issue's shape at `layers` layers, all-resident, and a made context of `context` positions."""
    cfg = replace(SHAPE, n_layers=layers)
    return (random_params(cfg, seed=0, pred_q8=False, distinct_records=resident_distinct(cfg)),
            state_at(cfg, context, seed=8))


def measure(layers: int, tokens: int, form: str = "default") -> dict:
    """One process's timings of the compiled step; form: "default" or one of decode_context's
    switched forms (e.g. traced_views, unchained), switched for the whole run."""
    if current_path() is not KernelPath.GPU:
        raise SystemExit("host_cost.py: needs MLX's GPU kernel path (a CUDA or Metal device)")
    # the form's switches for the whole run: the trace takes most, the selection each step's
    with using_path(KernelPath.GPU), switched(form):
        p, state = _made(layers)
        step = CompiledDecode(p, state, traced=True)
        before = sum(LAUNCHES.values())
        views_before = dict(launch.VIEW_COUNTS)
        logits, state = step(state, 1)  # the trace (every kernel JIT-compiled)
        views = {k: v - views_before.get(k, 0) for k, v in launch.VIEW_COUNTS.items()}
        sel = greedy_select(logits)
        mx.eval(sel)
        launches = sum(LAUNCHES.values()) - before
        for _ in range(4):  # warm: the selection's kernels, the graph execs
            logits, state = step(state, sel)
            sel = greedy_select(logits)
            mx.async_eval(sel)
        mx.eval(sel)
        # alone: one step from an idle queue, read back (the host's encoding and the GPU in series)
        alone = []
        for _ in range(5):
            t0 = time.perf_counter()
            logits, state = step(state, sel)
            sel = greedy_select(logits)
            mx.eval(sel)
            alone.append(time.perf_counter() - t0)
        # back to back: each step takes the previous selection; nothing read until the end
        call, enq = [], []
        t_start = time.perf_counter()
        for _ in range(tokens):
            t0 = time.perf_counter()
            logits, state = step(state, sel)
            sel = greedy_select(logits)
            t1 = time.perf_counter()
            mx.async_eval(sel)
            t2 = time.perf_counter()
            call.append(t1 - t0)
            enq.append(t2 - t1)
        t_enqueued = time.perf_counter()
        mx.eval(sel)
        t_end = time.perf_counter()
    ms = 1e3
    return {
        "layers": layers, "tokens": tokens, "wrapper_launches": launches, "views": views,
        "wall_ms": (t_end - t_start) / tokens * ms,
        "host_ms": (sum(call) + sum(enq)) / tokens * ms,
        "call_ms": float(np.median(call)) * ms, "async_eval_ms": float(np.median(enq)) * ms,
        "drain_ms": (t_end - t_enqueued) * ms,
        "alone_ms": float(np.median(alone)) * ms,
        "async_eval_us_per_launch": float(np.median(enq)) * 1e6 / max(launches, 1),
    }


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0],
                                 formatter_class=argparse.RawDescriptionHelpFormatter,
                                 epilog="example: python3 benchmarks/host_cost.py --layers 48,12 --tokens 32")
    ap.add_argument("--layers", default="48,12", help="comma list of layer counts (default 48,12)")
    ap.add_argument("--tokens", type=int, default=32)
    ap.add_argument("--no-env", action="store_true", help="skip the child processes under MLX's other launch modes")
    ap.add_argument("--env", default="", help="comma list of the child variants to run (default: all): "
                    + ", ".join(n for n, _ in ENV_VARIANTS))
    ap.add_argument("--default-only", action="store_true", help="only the default form (no other forms, no control)")
    ap.add_argument("--forms", default="traced_views,unchained",
                    help="comma list of decode_context's switched forms measured beside the default, in one process")
    ap.add_argument("--child", action="store_true", help=argparse.SUPPRESS)
    args = ap.parse_args()
    layer_counts = [int(x) for x in args.layers.split(",") if x]
    forms = known_forms(ap, "--forms", [f for f in args.forms.split(",") if f], SWITCHES)
    rows = {f"default/{n}": measure(n, args.tokens) for n in layer_counts}
    if not args.default_only:
        for n in layer_counts[:1]:
            # e.g. the trace's own views (the form before CONSTANT_VIEWS), the QKV GEMV a launch of
            # its own (attend_project.CHAIN_QKV off), in the same process
            for form in forms:
                rows[f"{form}/{n}"] = measure(n, args.tokens, form)
        rows[f"default/{layer_counts[0]}#2"] = measure(layer_counts[0], args.tokens)  # order control
    if args.child:
        print("CHILD " + json.dumps(rows))
        return 0
    if not args.no_env:
        wanted = {n for n in args.env.split(",") if n}
        for name, env in ENV_VARIANTS:
            if wanted and name not in wanted:
                continue
            cmd = [sys.executable, __file__, "--child", "--layers", str(layer_counts[0]), "--tokens", str(args.tokens)]
            try:
                out = subprocess.run(cmd, env={**os.environ, **env}, capture_output=True, text=True, timeout=120)
                line = next((l for l in out.stdout.splitlines() if l.startswith("CHILD ")), None)
                if line is None:
                    rows[f"{name}/{layer_counts[0]}"] = {"error": (out.stderr or out.stdout)[-300:]}
                    continue
                for key, r in json.loads(line[6:]).items():
                    rows[key.replace("default", name)] = r
            except subprocess.TimeoutExpired:
                rows[f"{name}/{layer_counts[0]}"] = {"error": "timed out (120 s)"}
    print("| run | launches | views constant / traced | wall ms/token | host ms/token | compiled call | async_eval | us/launch | drain | one step alone |")
    print("|---|---|---|---|---|---|---|---|---|---|")
    for key, r in rows.items():
        if "error" in r:
            print(f"| {key} | error: {r['error']!r} |")
            continue
        v = r.get("views", {})
        print(f"| {key} | {r['wrapper_launches']} | {v.get('constant', 0)} / {v.get('traced', 0)} | {r['wall_ms']:.2f} | {r['host_ms']:.2f} | {r['call_ms']:.3f} | "
              f"{r['async_eval_ms']:.2f} | {r['async_eval_us_per_launch']:.1f} | {r['drain_ms']:.2f} | {r['alone_ms']:.2f} |")
    print("JSON " + json.dumps({"mlx": mx.__version__, "rows": rows}, sort_keys=True))
    return 0


if __name__ == "__main__":
    sys.exit(main())
