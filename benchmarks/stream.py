"""Streaming benchmark: a made model several times larger than its arena, cold page cache.

    python benchmarks/stream.py [--dir DIR] [--tokens 48] [--arena-fraction 0.25]

Builds (once, cached in DIR) a demo-shaped model with more layers and experts, measures the
disk's random-record and sequential read bandwidth on its `.experts` file, then runs each
configuration in a fresh process (so peak RSS is that run's) with the file's pages dropped
from the page cache first (posix_fadvise DONTNEED): stock (K = 10), K = 16 no-touch, no
prefetch, and the all-resident reference (compute only). Prints a table and one final JSON
line; docs/perf.md records the numbers.
"""

from __future__ import annotations

import argparse
import json
import os
import resource
import subprocess
import sys
import threading
import time
from pathlib import Path

import numpy as np

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))
sys.path.insert(0, str(ROOT / "benchmarks"))

from _page_cache import drop_cache  # noqa: E402

SHAPE = dict(n_layers=16, n_experts=128, n_experts_per_token=8)  # on top of testing's "demo" shape
PROMPT = "def fibonacci(n):\n    if n < 2:\n        return n\n"
RSS_OVERHEAD = 96 * 2**20  # stated: python + numpy + KV + activations + thread stacks + dequantized temporaries
RUNS = {
    "stock K=10": {},
    "K=16 no-touch": {"prefetch": 16, "prefetch_touch": False},
    "no prefetch": {"prefetch": 0},
    "K=16, Python's 5 ms switch": {"prefetch": 16, "io_switch_ms": 0},
}


def disk_bandwidth(path: Path, record: int, offset0: int, n_records: int, threads: int) -> dict:
    """Random whole-record reads (O_DIRECT where allowed; the runtime's access pattern) with
    `threads` readers, and one sequential pass in 1 MiB reads; cold cache before each."""
    import mmap

    def fd_for():
        try:
            return os.open(path, os.O_RDONLY | os.O_DIRECT), True
        except OSError:
            return os.open(path, os.O_RDONLY), False

    from strata.runtime.budget import cached_file_bytes

    drop_cache(path)
    cached_after_drop = cached_file_bytes(path)
    order = np.random.default_rng(0).permutation(n_records)[: min(n_records, 1024)]
    fd, direct = fd_for()
    chunks = np.array_split(order, threads)

    def worker(idx):
        buf = mmap.mmap(-1, record)
        for i in idx.tolist():
            os.preadv(fd, [buf], offset0 + i * record)

    start = time.perf_counter()
    ts = [threading.Thread(target=worker, args=(c,)) for c in chunks]
    for t in ts:
        t.start()
    for t in ts:
        t.join()
    rand_s = time.perf_counter() - start
    os.close(fd)
    drop_cache(path)
    fd, _ = fd_for()
    buf = mmap.mmap(-1, 1 << 20)
    size, off = os.path.getsize(path), 0
    start = time.perf_counter()
    while off < size:
        n = os.preadv(fd, [buf], off)
        if n <= 0:
            break
        off += n
    seq_s = time.perf_counter() - start
    os.close(fd)
    return {"random_GBps": len(order) * record / rand_s / 1e9, "sequential_GBps": size / seq_s / 1e9,
            "random_reads": int(len(order)), "record_bytes": record, "direct": direct,
            "cached_after_drop": cached_after_drop, "cpus": os.cpu_count()}


def child(args) -> None:
    """One run in this process: prints one JSON line."""
    import strata
    from strata.config import load_config
    from strata.formats.dense_weights import stored_bytes
    from strata.numpy_backend.engine import ReferenceEngine
    from strata.testing.engines import open_numpy_streaming

    base_rss = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss * 1024
    model = strata.load(args.model)
    dense = stored_bytes(model.dense)
    prompt = model.tokenizer.encode(PROMPT)
    overrides = json.loads(args.child)
    drop_cache(Path(model.experts_file.path))
    out = {"dense_bytes": dense, "base_rss": base_rss}
    if overrides is None:  # compute only: every expert resident, read before the clock starts
        engine = ReferenceEngine(model.resident_params())
        arena_bytes = model.experts_file.header.n_records * model.experts_file.header.padded_bytes
    else:
        engine = open_numpy_streaming(model, load_config({"arena": args.arena, **overrides}))
        arena_bytes = engine.arena.capacity * engine.arena.slot_bytes
    logits = engine.prefill(prompt)
    start = time.perf_counter()
    for _ in range(args.tokens):
        logits = engine.decode(int(np.argmax(logits)))
    out["ms_per_token"] = 1e3 * (time.perf_counter() - start) / args.tokens
    if overrides is not None:
        out["report"] = engine.report().to_dict()
        engine.close()
    out["peak_rss"] = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss * 1024
    out["rss_bound"] = base_rss + dense + arena_bytes + RSS_OVERHEAD
    print(json.dumps(out))


def run_child(args, overrides) -> dict:
    cmd = [sys.executable, __file__, "--child", json.dumps(overrides), "--model", str(args.model),
           "--arena", args.arena, "--tokens", str(args.tokens)]
    env = {k: v for k, v in os.environ.items() if not k.startswith("STRATA_")}  # the runs' configs only
    # one BLAS thread: the matrices are tiny (D=256), and BLAS threads spinning beside the
    # reader threads made run-to-run times swing by 50% on a 16-core machine
    env.update(OPENBLAS_NUM_THREADS="1", OMP_NUM_THREADS="1", MKL_NUM_THREADS="1")
    done = subprocess.run(cmd, capture_output=True, text=True, env=env)
    if done.returncode:
        sys.exit(f"run failed: {overrides}\n{done.stderr}")
    return json.loads(done.stdout.strip().splitlines()[-1])


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--dir", default="/tmp/strata-bench", help="where the made model is cached")
    ap.add_argument("--tokens", type=int, default=48, help="decoded tokens per run")
    ap.add_argument("--arena-fraction", type=float, default=0.25, help="arena slots / all experts")
    ap.add_argument("--child", help=argparse.SUPPRESS)
    ap.add_argument("--model", help=argparse.SUPPRESS)
    ap.add_argument("--arena", help=argparse.SUPPRESS)
    args = ap.parse_args()
    if args.child is not None:
        return child(args)

    from strata.formats.experts_file import ExpertsFile
    from strata.testing.models import make_model, model_paths

    model_path, experts_path = model_paths(Path(args.dir) / "stream-demo16x128")
    if not experts_path.exists():
        print(f"building the benchmark model in {args.dir} ...", file=sys.stderr)
        make_model(model_path, "demo", seed=0, **SHAPE)
    with ExpertsFile.open(experts_path) as xf:
        h = xf.header
        n_records, record, data0 = h.n_records, h.padded_bytes, h.data_offset
    slots = int(n_records * args.arena_fraction)
    args.model, args.arena = model_path, f"{slots}slots"
    disk = disk_bandwidth(experts_path, record, data0, n_records, threads=4)
    results = {"compute only (all resident)": run_child(args, None)}
    for label, overrides in RUNS.items():
        results[label] = run_child(args, overrides)

    compute_ms = results["compute only (all resident)"]["ms_per_token"]
    bw = disk["random_GBps"] * 1e9
    print(f"model: demo shape + {SHAPE}, {n_records} experts x {record} B = {n_records * record / 1e6:.1f} MB; "
          f"arena {slots} slots = {slots * record / 1e6:.1f} MB ({args.arena_fraction:.0%}); {args.tokens} tokens")
    print(f"disk: random {record} B records {disk['random_GBps']:.2f} GB/s, sequential {disk['sequential_GBps']:.2f} GB/s "
          f"({'O_DIRECT' if disk['direct'] else 'buffered'}; {disk['cached_after_drop']} B cached after the drop; "
          f"{disk['cpus']} CPUs; one BLAS thread)")
    print(f"{'run':<28} {'ms/tok':>7} {'urgent/tok':>10} {'ra hits/tok':>11} {'reads/tok':>9} {'MB/tok':>7} "
          f"{'hit %':>6} {'host ms':>7} {'wait ms':>7} {'late':>5} {'target x':>8} {'RSS MB':>7} {'bound MB':>8}")
    summary = {"disk": disk, "compute_ms_per_token": compute_ms, "arena_slots": slots, "runs": {}}
    for label, r in results.items():
        rep = r.get("report")
        rss_ok = r["peak_rss"] <= r["rss_bound"]
        row = {"ms_per_token": r["ms_per_token"], "peak_rss": r["peak_rss"], "rss_bound": r["rss_bound"], "rss_ok": rss_ok}
        if rep is None:
            print(f"{label:<28} {r['ms_per_token']:7.2f} {'':>10} {'':>11} {'':>9} {'':>7} {'':>6} {'':>7} {'':>7} {'':>5} "
                  f"{'':>8} {r['peak_rss'] / 1e6:7.0f} {r['rss_bound'] / 1e6:8.0f}")
        else:
            unhidden_ms = 1e3 * rep["urgent_misses_per_token"] * record / bw
            target = r["ms_per_token"] / max(compute_ms, unhidden_ms)
            row.update(report=rep, unhidden_miss_ms=unhidden_ms, target_ratio=target)
            print(f"{label:<28} {r['ms_per_token']:7.2f} {rep['urgent_misses_per_token']:10.2f} "
                  f"{rep['readahead_hits_per_token']:11.2f} {rep['reads_per_token']:9.2f} {rep['bytes_per_token'] / 1e6:7.2f} "
                  f"{100 * rep['hit_rate']:6.2f} {rep['host_ms_per_window']:7.2f} {rep['waiting_ms_per_window']:7.2f} "
                  f"{rep['late']:5d} {target:8.2f} {r['peak_rss'] / 1e6:7.0f} {r['rss_bound'] / 1e6:8.0f}")
        summary["runs"][label] = row
    print(json.dumps(summary, sort_keys=True))


if __name__ == "__main__":
    main()
