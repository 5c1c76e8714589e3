"""PLE n-gram rows streamed from a row store on disk: the row cache's ms per token, cold cache.

    PYTHONPATH=$PWD python benchmarks/ngram_rows.py [--gb 4] [--dir DIR] [--ple-layers 36] [--heads 16]
        [--width 128] [--tokens 200] [--threads 4,8,16,32] [--layer-ms 0,0.5] [--qtype f16]

Writes (once, kept in DIR) a synthetic row store of `--gb` GB (`--ple-layers` tables of equal
rows, `--width` values a row: the reference engine's shape is 36 PLE layers of 16 heads), then per
(threads, layer-ms) runs `--tokens` tokens of the engine's order with the store's pages dropped
from the page cache first (posix_fadvise DONTNEED): every PLE layer's reads issued before layer
0 (`prefetch`), then each of the model's `--layers` layers computing `--layer-ms` (a sleep: the
GPU's time for that layer) and, at a PLE layer, taking its rows. Ids are uniform random (the
hashed n-grams of new text), so nearly every row is a read: the cold, worst case.

Modes (`--modes`, reader-cache): the reader is `direct` (Python reader threads, O_DIRECT),
`threads` (the same, buffered) or `advise` (the kernel reads ahead, posix_fadvise; the owner
copies); the cache `cold` (the store dropped from the page cache: the disk's random reads) or
`warm` (the store in the page cache: what the host itself costs). Threads apply to the threaded
readers only.
Reported per run: ms/token (the loop), the PLE wait per token (blocked at PLE layers: what the
read-ahead did not hide; the advised reader's copies happen inside it), pages per token, random-read
rate (pages/s, MB/s), the row cache's hit rate, and the row cache's own host cost: `host ms` (the
loop's wall time less the layers' measured sleeps: everything the cache did or waited for) and
`cpu us/page` (the process's CPU time, every thread, user + system, per page read: what the cache
costs the host whether or not a layer hides it), and of it `sys us/page` (the kernel's part: the
syscalls' floor, fadvise and pread and the page copies). A token's ids are drawn before the timed loop. A table, then one JSON line, also written to $OUT/ngram_rows.json ($OUT: the device
run's output folder; ./out when unset).
"""

from __future__ import annotations

import argparse
import json
import os
import resource
import shutil
import sys
import tempfile
import time
from pathlib import Path

import numpy as np

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))
sys.path.insert(0, str(ROOT / "benchmarks"))

from _page_cache import drop_cache  # noqa: E402

from strata.formats.ngram_rows_file import NgramRowsFile  # noqa: E402
from strata.formats.ngram_rows_writer import NgramRowsWriter  # noqa: E402
from strata.formats.quant_types import parse_quant_type  # noqa: E402
from strata.runtime.ngram_rows import StreamedNgramRows  # noqa: E402

CACHE_POSITIONS = 64  # the row cache: strata.runtime.ngram_budget's default, 64 positions of pages


def build(path: Path, *, gb: float, layers: int, width: int, qtype) -> NgramRowsFile:
    """A store of `gb` GB: `layers` tables, PLE layers 0..layers-1. Rows are one random shard
    repeated (the bytes do not matter to a read; generating 36 GB of normals would take minutes)."""
    from strata.formats.ngram_row_types import check_row_type

    row_bytes = check_row_type(qtype, width)
    rows = int(gb * 1e9 / layers / row_bytes)
    if path.exists():
        try:
            store = NgramRowsFile.open(path)
            if len(store.tables) == layers and store.tables[0].rows == rows and store.qtype == qtype \
                    and store.tables[0].width == width:
                return store
            store.close()
        except Exception:  # noqa: BLE001 - rebuild whatever is there
            pass
    shard = 1 << 16
    block = (np.random.default_rng(0).standard_normal((shard, width), dtype=np.float32) * 0.02).astype(np.float16)
    t0 = time.perf_counter()
    with NgramRowsWriter(path, qtype=qtype, shapes={l: (rows, width) for l in range(layers)}) as w:
        for l in range(layers):
            for a in range(0, rows, shard):
                w.write(l, block[: min(shard, rows - a)])
    s = time.perf_counter() - t0
    print(f"wrote {path} ({os.path.getsize(path) / 1e9:.2f} GB) in {s:.1f} s", flush=True)
    return NgramRowsFile.open(path)


def warm(path: Path) -> None:
    """Every page of the store into the page cache (one sequential pass)."""
    with open(path, "rb", buffering=0) as f:
        while f.read(1 << 24):
            pass


MODES = {  # mode -> (StreamedNgramRows reader, O_DIRECT, page cache)
    "direct-cold": ("threads", True, "cold"),
    "advise-cold": ("advise", False, "cold"),
    "threads-warm": ("threads", False, "warm"),
    "advise-warm": ("advise", False, "warm"),
}


def run(store: NgramRowsFile, *, mode: str, threads: int, layer_ms: float, tokens: int, heads: int, n_layers: int,
        ple_at: list[int], seed: int) -> dict:
    reader, direct, cache_state = MODES[mode]
    if cache_state == "cold":
        drop_cache(Path(store.path))
    else:
        warm(Path(store.path))
    rng = np.random.default_rng(seed)
    tables = sorted(store.tables)
    capacity = CACHE_POSITIONS * heads * len(tables) + 1
    at = dict(zip(ple_at, tables))  # model layer -> PLE table
    every = [{l: rng.integers(0, store.tables[l].rows, (1, heads)) for l in tables} for _ in range(tokens)]
    with StreamedNgramRows(store, capacity=capacity, threads=threads, direct=direct, reader=reader) as cache:
        t0, r0 = time.perf_counter(), resource.getrusage(resource.RUSAGE_SELF)
        slept = 0.0
        for ids in every:
            cache.prefetch(ids)
            for layer in range(n_layers):
                if layer in at:
                    cache.rows(at[layer], ids[at[layer]])
                if layer_ms:
                    t1 = time.perf_counter()
                    time.sleep(layer_ms / 1e3)  # the GPU's layer: the host waits, the GIL released
                    slept += time.perf_counter() - t1
        s, r1 = time.perf_counter() - t0, resource.getrusage(resource.RUSAGE_SELF)
        user, system = r1.ru_utime - r0.ru_utime, r1.ru_stime - r0.ru_stime
        cpu = user + system
        tot = cache.stats().total
        note = cache.reader.note
    pages = tot.pages_read
    return {"mode": mode, "threads": threads, "layer_ms": layer_ms, "tokens": tokens, "ms_per_token": 1e3 * s / tokens,
            "compute_ms_per_token": 1e3 * slept / tokens, "ple_wait_ms_per_token": 1e3 * tot.wait_s / tokens,
            "pages_per_token": pages / tokens, "rows_per_token": (tot.rows_read + tot.rows_hit) / tokens,
            "hit_rate": tot.rows_hit / max(1, tot.rows_hit + tot.rows_read),
            "pages_per_s": pages / s, "mb_per_s": tot.bytes_read / s / 1e6, "io": note,
            "bytes_per_token": tot.bytes_read / tokens, "cache_pages": capacity,
            "host_ms_per_token": 1e3 * (s - slept) / tokens, "cpu_ms_per_token": 1e3 * cpu / tokens,
            "cpu_us_per_page": 1e6 * cpu / max(1, pages), "sys_us_per_page": 1e6 * system / max(1, pages)}


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--gb", type=float, default=4.0)
    ap.add_argument("--dir", default=None, help="where the store is kept (default: a temporary directory, removed)")
    ap.add_argument("--ple-layers", type=int, default=36)
    ap.add_argument("--layers", type=int, default=48, help="model layers (the PLE layers spread evenly over them)")
    ap.add_argument("--heads", type=int, default=16)
    ap.add_argument("--width", type=int, default=128, help="values a row (Qwen4-Exp: ple_embed_dim 2048 / 16 heads)")
    ap.add_argument("--qtype", default="f16")
    ap.add_argument("--tokens", type=int, default=200)
    ap.add_argument("--threads", default="4,8,16,32")
    ap.add_argument("--layer-ms", default="0,0.5")
    ap.add_argument("--modes", default="direct-cold,advise-cold,threads-warm,advise-warm",
                    help="reader-cache: direct (threads, O_DIRECT), threads (buffered) or advise (the kernel's "
                         "read-ahead); cold (the store dropped from the page cache: the disk) or warm (in the page "
                         "cache: the host's own cost)")
    args = ap.parse_args()
    qtype = parse_quant_type(args.qtype)
    tmp = None
    if args.dir is None:
        tmp = tempfile.mkdtemp(prefix="strata-ngram-")
        directory = Path(tmp)
    else:
        directory = Path(args.dir)
        directory.mkdir(parents=True, exist_ok=True)
    # PLE layers spread over the model's layers as the reference engine's (PLE on 36 of 48: the linear ones)
    ple_at = sorted({int(i * args.layers / args.ple_layers) for i in range(args.ple_layers)})
    try:
        store = build(directory / f"bench.{args.qtype}.ngrams", gb=args.gb, layers=args.ple_layers, width=args.width,
                      qtype=qtype)
        results = []
        print(f"{'mode':>13} {'threads':>7} {'layer ms':>8} {'ms/token':>9} {'compute':>8} {'ple wait':>9} {'pages/tok':>9} "
              f"{'hit %':>6} {'kpages/s':>9} {'MB/s':>7} {'host ms':>8} {'cpu us/page':>11} {'sys us/page':>11}  io")
        runs = [(m, float(x), int(t)) for m in args.modes.split(",") for x in args.layer_ms.split(",")
                for t in args.threads.split(",")]
        for mode, layer_ms, threads in runs:
            r = run(store, mode=mode, threads=threads, layer_ms=layer_ms, tokens=args.tokens, heads=args.heads,
                    n_layers=args.layers, ple_at=ple_at, seed=threads)
            results.append(r)
            print(f"{mode:>13} {threads:7d} {layer_ms:8.2f} {r['ms_per_token']:9.2f} {r['compute_ms_per_token']:8.2f} "
                  f"{r['ple_wait_ms_per_token']:9.2f} {r['pages_per_token']:9.1f} {100 * r['hit_rate']:6.2f} "
                  f"{r['pages_per_s'] / 1e3:9.1f} {r['mb_per_s']:7.1f} {r['host_ms_per_token']:8.2f} {r['cpu_us_per_page']:11.2f} {r['sys_us_per_page']:11.2f}  "
                  f"{r['io']}", flush=True)
        summary = {"store_bytes": os.path.getsize(store.path), "page_bytes": store.page_bytes, "qtype": store.qtype.name,
                   "ple_layers": args.ple_layers, "layers": args.layers, "heads": args.heads, "width": args.width,
                   "runs": results}
        line = json.dumps(summary, sort_keys=True)
        print(line)
        out = Path(os.environ.get("OUT") or "out")
        out.mkdir(parents=True, exist_ok=True)
        (out / "ngram_rows.json").write_text(line + "\n")
        store.close()
    finally:
        if tmp is not None:
            shutil.rmtree(tmp, ignore_errors=True)


if __name__ == "__main__":
    main()
