"""One GEMV per type on the CPU: the compiled kernel (strata/numpy_backend/native/quant_gemv.c)
against numpy's reference product (dequantize, then a float32 BLAS product), x float32, one
thread; and with --rows, products of several rows of x (a prompt's), where the reference's one
widening is shared by every row (the crossover that MAX_COMPILED_ROWS / MAX_COMPILED_ROWS_BLOCKS
in strata/numpy_backend/quant_kernels.py set). Matrices: Q8_0 / Q4_0 quantized from random
normal weights, llama.cpp's types as random blocks (strata.testing.ggml_random). The kernel is
timed `--reps` times back to back (the matrix in cache) and the reference 3 times; each figure is
the minimum (the machine's other work only ever adds time). Prints a table, then one JSON line.

    python benchmarks/cpu_kernels.py                         # 2048 x 2048, every compiled type
    python benchmarks/cpu_kernels.py --rows 768 --cols 2048 --tokens 16,32,64,128,256 --types q8_0,q4_k,q6_k
"""

from __future__ import annotations

import argparse
import json
import os
import sys
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))
for _var in ("OPENBLAS_NUM_THREADS", "OMP_NUM_THREADS", "MKL_NUM_THREADS"):  # the reference on one thread, as the kernel
    os.environ.setdefault(_var, "1")

import numpy as np  # noqa: E402

from strata.formats.quant_types import QuantType, is_whole_blocks, layout  # noqa: E402
from strata.numpy_backend import native_build, quant_kernels  # noqa: E402
from strata.reference.quants import gemv as reference_gemv, quantize  # noqa: E402
from strata.testing.ggml_random import random_block_matrix  # noqa: E402

TYPES = {q.name.removeprefix("GGML_").lower(): q for q in sorted(quant_kernels.COMPILED_TYPES, key=int)}
REFERENCE_REPS = 3


def _matrix(qtype: QuantType, rows: int, cols: int, rng: np.random.Generator):
    if is_whole_blocks(qtype):
        return random_block_matrix(qtype, rows, cols, rng, rms=cols ** -0.5)
    return quantize(qtype, (rng.standard_normal((rows, cols)) * cols ** -0.5).astype(np.float32))


def _fastest(fn, reps: int) -> float:
    times = []
    for _ in range(reps):
        t = time.perf_counter()
        fn()
        times.append(time.perf_counter() - t)
    return min(times)


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--rows", type=int, default=2048)
    ap.add_argument("--cols", type=int, default=2048)
    ap.add_argument("--tokens", default="1", help="rows of x, comma-separated (default 1: a GEMV)")
    ap.add_argument("--types", default=",".join(TYPES), help=f"comma-separated, of {', '.join(TYPES)}")
    ap.add_argument("--reps", type=int, default=21, help="kernel calls per figure (default 21)")
    args = ap.parse_args()
    names = [t.strip().lower() for t in args.types.split(",") if t.strip()]
    unknown = [n for n in names if n not in TYPES]
    if unknown:
        raise SystemExit(f"cpu_kernels: unknown type {unknown[0]!r}; choose from {', '.join(TYPES)}")
    for n in names:
        block = layout(TYPES[n]).block_size
        if args.cols % block:
            raise SystemExit(f"cpu_kernels: {n} needs --cols a multiple of {block}, got {args.cols}")
    if native_build.library() is None:
        raise SystemExit(f"cpu_kernels: {native_build.reason()}")
    tokens = [int(t) for t in args.tokens.split(",")]
    rng = np.random.default_rng(0)
    results = []
    print(f"\n{args.rows} x {args.cols}, one thread, load avg {os.getloadavg()[0]:.2f}; "
          f"kernel: min of {args.reps}, reference (dequantize + BLAS): min of {REFERENCE_REPS}\n")
    print("| type | stored | rows of x | compiled | numpy reference | ratio |")
    print("|---|---|---|---|---|---|")
    for n in names:
        qtype = TYPES[n]
        m = _matrix(qtype, args.rows, args.cols, rng)
        fn = quant_kernels.kernel(qtype)
        for t in tokens:
            x = rng.standard_normal((t, args.cols)).astype(np.float32)
            kernel_s = _fastest(lambda: quant_kernels.run_kernel(fn, m.codes, m.scales, m.n_rows, m.n_cols, x),
                                args.reps)
            reference_s = _fastest(lambda: reference_gemv(m, x), REFERENCE_REPS)
            results.append(dict(type=n, stored_bytes=int(m.nbytes), tokens=t, compiled_ms=round(kernel_s * 1e3, 4),
                                reference_ms=round(reference_s * 1e3, 3), ratio=round(reference_s / kernel_s, 1)))
            print(f"| {n.upper()} | {m.nbytes / 1e6:.2f} MB | {t} | {kernel_s * 1e3:.3f} ms | "
                  f"{reference_s * 1e3:.1f} ms | {reference_s / kernel_s:.1f}x |")
    print("JSON " + json.dumps(dict(bench="cpu_kernels", rows=args.rows, cols=args.cols, cores=os.cpu_count(),
                                    load_avg=round(os.getloadavg()[0], 2), results=results), sort_keys=True))


if __name__ == "__main__":
    main()
