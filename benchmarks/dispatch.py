"""Why a custom kernel costs more to dispatch than an MLX op (issue 19): one factor at a time.

What MLX 0.32's CUDA build does per custom-kernel call (mlx/backend/cuda/custom_kernel.cpp,
mlx/backend/cuda/device.cpp, mlx/backend/cuda/eval.cpp):
- building the graph (each Python call, skipped by mx.compile's replay): `build_kernel` writes the
  whole translation unit again (header + body + the signature + one `constexpr int` per template
  argument) and the `CustomKernel` primitive keeps that string;
- evaluating (every call, compiled or not): `std::hash` of the whole source to name the JIT module,
  two string-keyed map lookups (module, kernel), the argument pack, a CUDA graph kernel node;
- after every primitive `gpu::eval` asks `needs_commit()`: the encoder commits its CUDA graph
  (instantiate or update + launch) when it holds more than `max_ops_per_graph` nodes (100 on
  sm_90) or when the bytes of the arrays its nodes were GIVEN exceed `max_mb_per_graph` (1000 MB on
  sm_90). `set_input_array` adds `arr.data_size()`: the whole array, not what the kernel reads. A
  custom kernel handed the expert arena (17 GB at the seed shape) or a KV cache at max_context
  therefore ends the graph after itself.

Each row below is host microseconds per call in a lazy chain of N calls (then one mx.eval), with
one factor changed from the row `kernel, made once`:

    python benchmarks/dispatch.py          # the rows (GPU; on the CPU only the MLX-op rows)
    python benchmarks/dispatch.py --quick  # fewer repetitions

It prints a table and one JSON line (`JSON {...}`); the subprocess rows rerun the arena-sized
input rows with MLX_MAX_MB_PER_BUFFER / MLX_MAX_OPS_PER_BUFFER raised, and every row with
MLX_USE_CUDA_GRAPHS=0 (each read once, when MLX makes the CUDA encoder).
"""

from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))
sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

import mlx.core as mx  # noqa: E402
import numpy as np  # noqa: E402

from _measure import device_name, median_time  # noqa: E402

N = 400  # calls per chain: enough that the one eval's fixed cost is noise
PAD_BYTES = 16 << 10  # the fused expert kernel's source is ~15 KB, attend's ~9 KB
BIG_BYTES = 2 << 30  # past max_mb_per_graph (1000 MB on sm_90): like the arena or a long KV cache
MID_BYTES = 64 << 20  # a dense weight's size (W_qkv 15.7 MB, the LM head 168 MB at the seed)


def _dialect() -> str | None:
    if mx.metal.is_available():
        return "metal"
    if hasattr(mx, "cuda") and mx.cuda.is_available():
        return "cuda"
    return None


_BODY = {"cuda": "const uint32_t i = blockIdx.x * blockDim.x + threadIdx.x;\n  if (i < 8) out[i] = y[i] + 1.0f;\n",
         "metal": "const uint32_t i = thread_position_in_grid.x;\n  if (i < 8) out[i] = y[i] + 1.0f;\n"}


def make_kernel(dialect: str, *, name: str = "dispatch_probe", pad: int = 0, extra_inputs: int = 0):
    """A kernel adding 1 to 8 floats; `pad` bytes of comment in its header (the source MLX hashes
    and copies), `extra_inputs` inputs it never reads."""
    header = ("// " + "x" * 76 + "\n") * (pad // 80)
    inputs = ["y"] + [f"e{i}" for i in range(extra_inputs)]
    make = mx.fast.cuda_kernel if dialect == "cuda" else mx.fast.metal_kernel
    return make(name=name, input_names=inputs, output_names=["out"], source=_BODY[dialect], header=header)


def per_call(step, y0: mx.array, n: int, reps: int) -> dict:
    """Host us per call: the whole chain (build + eval), and the build alone."""
    def chain():
        y = y0
        for _ in range(n):
            y = step(y)
        mx.eval(y)

    total = median_time(chain, warmup=2, reps=reps) / n
    t0 = time.perf_counter()
    y = y0
    for _ in range(n):
        y = step(y)
    build = (time.perf_counter() - t0) / n
    mx.eval(y)
    return {"us": total * 1e6, "build_us": build * 1e6}


def compiled_call(step, y0: mx.array, n: int, reps: int) -> float:
    """Host us per call of a chain of n calls under mx.compile (the graph replayed: no Python, no
    build_kernel; what the compiled decode step pays)."""
    def chain(y):
        for _ in range(n):
            y = step(y)
        return y

    f = mx.compile(chain)
    mx.eval(f(y0))
    return median_time(lambda: mx.eval(f(y0)), warmup=2, reps=reps) / n * 1e6


def rows_for(dialect: str | None, reps: int, only_big: bool = False) -> dict:
    res: dict = {}
    y0 = mx.zeros((8,), mx.float32) + 0
    mx.eval(y0)
    if not only_big:
        res["op"] = per_call(lambda y: y + 1.0, y0, N, reps)
        res["op_compiled_us"] = compiled_call(lambda y: y + 1.0, y0, N, reps)
    if dialect is None:
        return res
    common = dict(output_shapes=[(8,)], output_dtypes=[mx.float32], grid=(32, 1, 1), threadgroup=(32, 1, 1))
    big = mx.zeros((BIG_BYTES // 4,), mx.float32)
    mid = mx.zeros((MID_BYTES // 4,), mx.float32)
    mx.eval(big, mid)
    k1 = make_kernel(dialect, extra_inputs=1)
    cases = {
        "kernel_big_input": lambda y: k1(inputs=[y, big], **common)[0],
        "kernel_big_input_view": lambda y: k1(inputs=[y, big[:8]], **common)[0],
    }
    if not only_big:
        k0 = make_kernel(dialect, name="dispatch_probe0")
        kp = make_kernel(dialect, name="dispatch_probe_pad", pad=PAD_BYTES)
        k8 = make_kernel(dialect, name="dispatch_probe8", extra_inputs=8)
        small = [mx.zeros((8,), mx.float32) + i for i in range(8)]
        mx.eval(*small)
        tmpl = [(f"T{i}", i + 1) for i in range(8)]
        cases = {
            "kernel": lambda y: k0(inputs=[y], **common)[0],
            "kernel_made_per_call": lambda y: make_kernel(dialect, name="dispatch_probe0")(inputs=[y], **common)[0],
            "kernel_template_8": lambda y: k0(inputs=[y], template=tmpl, **common)[0],
            "kernel_source_16k": lambda y: kp(inputs=[y], **common)[0],
            "kernel_9_inputs": lambda y: k8(inputs=[y, *small], **common)[0],
            "kernel_mid_input": lambda y: k1(inputs=[y, mid], **common)[0],
            **cases,
        }
    for name, step in cases.items():
        res[name] = per_call(step, y0, N, reps)
        if name in ("kernel", "kernel_source_16k", "kernel_template_8", "kernel_big_input", "kernel_big_input_view"):
            res[name]["compiled_us"] = compiled_call(step, y0, N // 4, reps)
        print(f"ROW {name} " + json.dumps(res[name]), flush=True)  # survives a kill
    return res


NOTES = {
    "op": "y + 1.0: MLX's own kernel (compiled: fused into one kernel)",
    "kernel": "8 floats, made once, no template, one input",
    "kernel_made_per_call": "mx.fast.cuda_kernel(...) rebuilt every call",
    "kernel_template_8": "8 int template arguments",
    "kernel_source_16k": "16 KB of header (hashed per eval, rewritten per call)",
    "kernel_9_inputs": "8 more 8-element inputs",
    "kernel_mid_input": "plus a 64 MB input it does not read",
    "kernel_big_input": "plus a 2 GB input it does not read (bytes_in_graph)",
    "kernel_big_input_view": "the 2 GB array as an 8-element view",
}


def main() -> int:
    ap = argparse.ArgumentParser()
    ap.add_argument("--quick", action="store_true", help="3 repetitions instead of 7")
    ap.add_argument("--child", action="store_true", help=argparse.SUPPRESS)
    ap.add_argument("--all", action="store_true", help=argparse.SUPPRESS)  # a child: every row
    args = ap.parse_args()
    reps = 3 if args.quick else 7
    dialect = _dialect()
    if args.child:  # the rows again under the environment the parent set
        print("JSON " + json.dumps(rows_for(dialect, reps, only_big=not args.all)))
        return 0
    res = {"device": device_name(), "mlx": mx.__version__, "dialect": dialect, "calls_per_chain": N,
           "rows": rows_for(dialect, reps)}
    if dialect == "cuda":
        # (variable, value, every row): the commit limits (arena-sized rows), and CUDA graphs off
        # (MLX then launches each kernel directly: no graph node, no graph update per commit)
        for env_name, val, every in (("MLX_MAX_MB_PER_BUFFER", "1000000", False), ("MLX_MAX_OPS_PER_BUFFER", "1000", False),
                                     ("MLX_USE_CUDA_GRAPHS", "0", True)):
            env = {**os.environ, env_name: val}
            out = subprocess.run([sys.executable, __file__, "--child"] + (["--quick"] if args.quick else [])
                                 + (["--all"] if every else []), env=env, capture_output=True, text=True, timeout=120)
            line = [l for l in out.stdout.splitlines() if l.startswith("JSON ")]
            res[f"{env_name}={val}"] = json.loads(line[-1][5:]) if line else {"error": out.stderr[-400:]}
    print(f"## custom-kernel dispatch on {res['device']} (MLX {mx.__version__}, {dialect or 'no GPU'})")
    print(f"{'case':<28} {'us/call':>8} {'build':>8} {'compiled':>9}  what changes")
    for name, r in res["rows"].items():
        if isinstance(r, dict):
            print(f"{name:<28} {r['us']:8.2f} {r['build_us']:8.2f} {r.get('compiled_us', float('nan')):9.2f}  "
                  f"{NOTES.get(name, '')}")
    if "op_compiled_us" in res["rows"]:
        print(f"{'op, compiled':<28} {res['rows']['op_compiled_us']:8.2f}")
    for key in [k for k in res if k.startswith("MLX_")]:
        for name, r in res[key].items():
            if isinstance(r, dict) and "us" in r:
                print(f"{name + ' [' + key + ']':<28} {r['us']:8.2f} {r['build_us']:8.2f} "
                      f"{r.get('compiled_us', float('nan')):9.2f}")
    print("JSON " + json.dumps(res, sort_keys=True))
    return 0


if __name__ == "__main__":
    sys.exit(main())
