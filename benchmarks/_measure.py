"""Shared measurements for benchmarks/kernels.py and benchmarks/decode.py (METHOD.md: measure the
ceilings in the same run): copy bandwidth, host dispatch per op / per custom kernel, host round
trip, and the kernel launches of a lazy MLX graph (counted from its DOT export)."""

from __future__ import annotations

import contextlib
import json
import os
import re
import statistics
import tempfile
import time

import mlx.core as mx
import numpy as np

# graph nodes that are views or metadata (no kernel of their own)
VIEW_OPS = {"Broadcast", "Reshape", "Squeeze", "ExpandDims", "Slice", "Transpose", "AsStrided", "View",
            "Depends", "StopGradient"}


def median_time(fn, *, warmup: int = 3, reps: int = 10) -> float:
    """Median wall seconds of fn() (which must evaluate / synchronize what it times)."""
    for _ in range(warmup):
        fn()
    times = []
    for _ in range(reps):
        t0 = time.perf_counter()
        fn()
        times.append(time.perf_counter() - t0)
    return statistics.median(times)


def copy_bandwidth(nbytes: int) -> dict:
    """Device copy (read + write counted) and read-only bandwidth, bytes/s."""
    n = nbytes // 4
    x = mx.random.uniform(shape=(n,))
    mx.eval(x)
    t_copy = median_time(lambda: mx.eval(x + 1.0))
    t_read = median_time(lambda: mx.eval(x.sum()))
    return {"bytes": n * 4, "copy_Bps": 2 * n * 4 / t_copy, "read_Bps": n * 4 / t_read,
            "copy_s": t_copy, "read_s": t_read}


def dispatch_costs(n_ops: int = 1000, n_trips: int = 200, kernel_op=None) -> dict:
    """Host seconds per MLX op and per custom-kernel call in a long lazy chain (GPU work per op
    is tiny, so the host's encoding is what the chain costs), and per host round trip (one tiny
    op, then its value on the host)."""
    y0 = mx.zeros((8,), mx.float32)
    mx.eval(y0)

    def chain(op):
        def run():
            y = y0
            for _ in range(n_ops):
                y = op(y)
            mx.eval(y)
        return run

    out = {"op_s": median_time(chain(lambda y: y + 1.0), warmup=2, reps=5) / n_ops}
    if kernel_op is not None:
        out["kernel_s"] = median_time(chain(kernel_op), warmup=2, reps=5) / n_ops

    def trips():
        y = y0
        for _ in range(n_trips):
            y = y + 1.0
            np.array(y)
    out["round_trip_s"] = median_time(trips, warmup=1, reps=5) / n_trips
    return out


def graph_launches(*outputs: mx.array) -> dict[str, int]:
    """Kernel-launching nodes of the lazy graph behind `outputs`, by primitive name."""
    fd, path = tempfile.mkstemp(suffix=".dot")
    os.close(fd)
    try:
        mx.export_to_dot(path, *outputs)
        labels = re.findall(r'\[label ="([^"]+)", shape=rectangle\]', open(path).read())
    finally:
        os.unlink(path)
    counts: dict[str, int] = {}
    for lab in labels:
        if lab not in VIEW_OPS:
            counts[lab] = counts.get(lab, 0) + 1
    return counts


def known_forms(ap, flag: str, forms, known) -> list[str]:
    """forms (a benchmark's form names), each one of `known`; else argparse's one-line error
    naming the flag, the unknown names and the known ones."""
    bad = sorted(set(forms) - set(known))
    if bad:
        ap.error(f"{flag}: {bad} (known: {', '.join(known)})")
    return list(forms)


def ncu_marker():
    """A no-argument function that launches the segment marker kernel benchmarks/ncu_summary.py
    splits an ncu run at (a 32-thread copy of one float, named ncu_summary.MARKER); a no-op off
    MLX's CUDA build (the emulated smoke runs of the --ncu probes)."""
    from ncu_summary import MARKER

    if not mx.cuda.is_available():
        return lambda: None
    kernel = mx.fast.cuda_kernel(name=MARKER, input_names=["a"], output_names=["b"], source="b[0] = a[0];")
    x = mx.zeros((8,))
    mx.eval(x)

    def mark() -> None:
        mx.eval(kernel(inputs=[x], template=[("N", 1)], grid=(32, 1, 1), threadgroup=(32, 1, 1),
                       output_shapes=[(8,)], output_dtypes=[mx.float32])[0])
    return mark


def device_name() -> str:
    try:
        info = mx.device_info() if hasattr(mx, "device_info") else {}
    except Exception:  # noqa: BLE001 - informational only
        info = {}
    return str(info.get("device_name", mx.default_device()))


def kernel_bench_path(small: bool):
    """The path a kernel benchmark runs on: the GPU where MLX has one, else the C++ emulator for
    a `--small` smoke test; None, with the reason printed, where neither can run."""
    from strata.mlx_backend.kernels import emulate
    from strata.mlx_backend.kernels.launch import KernelPath, current_path

    if current_path() is KernelPath.GPU:
        return KernelPath.GPU
    if not emulate.available():
        print("needs an MLX GPU or (for --small) a C++20 compiler for the emulated path")
        return None
    if not small:
        print("full size needs the GPU path (use --small on a CPU)")
        return None
    return KernelPath.EMULATED


def print_rows(rows: list, *, value_width: int = 16) -> None:
    """A benchmark's table: rows of (name, value, note), names padded to the longest, values
    right-aligned in `value_width`."""
    w0 = max(len(r[0]) for r in rows)
    for name, val, note in rows:
        print(f"{name:<{w0}}  {val:>{value_width}}  {note}")


@contextlib.contextmanager
def part(name: str, res: dict, rows: list):
    """One benchmark part: a failure is recorded (`<name>_error`, a FAILED row) instead of losing
    the other parts' numbers, and the results so far are printed as a JSON-PART line, which
    survives a later kill."""
    try:
        yield
    except Exception as exc:  # noqa: BLE001 - one part failing must not lose the others
        res[f"{name}_error"] = f"{type(exc).__name__}: {exc}"
        rows.append((f"{name} FAILED", type(exc).__name__, str(exc)[:120]))
    print("JSON-PART " + json.dumps(res, sort_keys=True, default=str), flush=True)


def phase(res: dict, name: str, since: float) -> float:
    """Seconds since `since` into res["phases_s"][name], printed at once: a run killed at its time
    limit still says where it was (a first call JIT-compiling, or the build). -> now."""
    now = time.perf_counter()
    res.setdefault("phases_s", {})[name] = round(now - since, 3)
    print(f"PHASE {name} {now - since:.2f} s", flush=True)
    return now
