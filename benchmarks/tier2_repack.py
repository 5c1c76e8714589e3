"""The repack's worth: tier 2 reading experts in place from the safetensors shards against the
aligned records `strata convert DIR` writes, on the same checkpoint and arena.

    python benchmarks/tier2_repack.py DIR [--tokens 32] [--prompt-tokens 16] [--arena-fraction 0.25]
                                          [--prefetch 16] [--repeat 2] [--cold]

In place, one expert is one `pread` per piece (3 to 9: codes, scales, biases of each
projection); repacked, one `preadv` of one page-aligned record. The rows: the repack itself
(seconds, GB/s), then decode ms/token, expert reads per token, read calls per token and MB
read per token for each form, the runs alternating (in place, repacked, ...) `--repeat` times,
the median kept. `--cold` drops the files' pages from the page cache (posix_fadvise
DONTNEED) before each run, so first reads come from the disk; without it they are page-cache
copies. After each run, every expert is read once more outside the engine, one thread, as the
reader pool reads it (microseconds per expert, page cache warm, then dropped first): the reads
alone, without the decode's compute beside them. The records file is written into DIR for the
run and deleted after (DIR must not hold one). Prints a table and one JSON line.
"""

from __future__ import annotations

import argparse
import dataclasses
import json
import os
import statistics
import sys
import time
from pathlib import Path

import numpy as np


def drop_from_page_cache(paths) -> None:
    for p in paths:
        fd = os.open(p, os.O_RDONLY)
        try:
            os.fsync(fd)  # a page not yet written back (the records just written) is not dropped
            os.posix_fadvise(fd, 0, 0, os.POSIX_FADV_DONTNEED)
        finally:
            os.close(fd)


def read_every_expert(tensors, *, cold: bool) -> float:
    """Microseconds per expert to read every expert once, in (layer, expert) order, on one thread,
    as the reader pool reads one (strata.tier2.reader: a pread per piece in place, one preadv of
    the record repacked), into one slot's buffers."""
    bufs = [np.empty(p.nbytes, np.uint8) for p in tensors.pieces]
    fds = [os.open(p, os.O_RDONLY) for p in tensors.read_files]
    try:
        if cold:
            drop_from_page_cache(tensors.read_files)
        start = time.perf_counter()
        for m in range(tensors.n_layers):
            mine = [b[:p.nbytes] for b, p in zip(bufs, tensors.layer_pieces[m])]
            for e in range(tensors.n_experts):
                ranges = tensors.piece_ranges(m, e)
                if tensors.records is not None:
                    os.preadv(fds[0], mine, ranges[0][1])
                else:
                    for b, (f, offset, _) in zip(mine, ranges):
                        os.preadv(fds[f], [b], offset)
        return (time.perf_counter() - start) * 1e6 / tensors.n_records
    finally:
        for fd in fds:
            os.close(fd)


def run(directory: Path, prompt: list[int], tokens: int, config, *, repacked: bool, cold: bool) -> dict:
    import strata

    with strata.load(directory) as model:
        if not repacked:  # the shards' own ranges, although a records file is there now
            model.tensors = dataclasses.replace(model.tensors, records=None, records_offset=0)
        t = model.tensors
        calls_per_read = 1 if repacked else len(t.pieces)
        if cold:
            drop_from_page_cache(t.read_files)
        r = strata.generate(model, prompt, max_tokens=tokens, config=config).report
    return {"ms_per_token": r.ms_per_token, "waiting_ms_per_token": r.waiting_ms_per_window,
            "expert_reads_per_token": r.reads_per_token,
            "read_calls_per_token": r.reads_per_token * calls_per_read, "mb_per_token": r.bytes_per_token / 1e6,
            "urgent_misses_per_token": r.urgent_misses_per_token, "io": r.io}


def main(argv=None) -> int:
    from strata.config import Config
    from strata.tier2.engine import cache_config_for
    from strata.tier2.records import RECORDS_NAME, use_records, write_records

    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("directory", type=Path)
    ap.add_argument("--tokens", type=int, default=32)
    ap.add_argument("--prompt-tokens", type=int, default=16)
    ap.add_argument("--arena-fraction", type=float, default=0.25, help="of the experts (default 0.25)")
    ap.add_argument("--prefetch", type=int, default=16, help="read-ahead depth (default 16; 0: off)")
    ap.add_argument("--repeat", type=int, default=2)
    ap.add_argument("--cold", action="store_true", help="drop the files' pages before each run")
    args = ap.parse_args(argv)
    import strata

    records = args.directory / RECORDS_NAME
    if records.exists():
        print(f"tier2_repack: {records} exists; this benchmark writes and deletes its own (delete it first)",
              file=sys.stderr)
        return 2
    with strata.load(args.directory) as model:
        least = cache_config_for(model, Config(prefetch=args.prefetch), 1).min_capacity
        slots = max(int(model.tensors.n_records * args.arena_fraction), least)
        vocab, tensors = model.cfg.vocab_size, model.tensors
    config = Config(prefetch=args.prefetch, arena=f"{slots}slots")
    prompt = np.random.default_rng(0).integers(0, min(vocab, 256), args.prompt_tokens).tolist()
    run(args.directory, prompt[:4], 2, config, repacked=False, cold=False)  # warm up: imports, kernels
    start = time.perf_counter()
    write_records(tensors)
    repack_s = time.perf_counter() - start
    try:
        repacked_tensors = use_records(tensors)
        runs: dict[str, list[dict]] = {"in place": [], "repacked": []}
        for _ in range(args.repeat):
            for name in runs:
                runs[name].append(run(args.directory, prompt, args.tokens, config, repacked=name == "repacked",
                                      cold=args.cold))
                t = repacked_tensors if name == "repacked" else tensors
                runs[name][-1]["us_per_expert_read_warm"] = read_every_expert(t, cold=False)
                runs[name][-1]["us_per_expert_read_cold"] = read_every_expert(t, cold=True)
    finally:
        records.unlink(missing_ok=True)
    rows = {}
    for name, rs in runs.items():
        rows[name] = {k: (statistics.median(r[k] for r in rs) if k != "io" else rs[0][k]) for k in rs[0]}
        rows[name]["ms_per_token_runs"] = [round(r["ms_per_token"], 2) for r in rs]
    gb = tensors.n_records * tensors.slot_bytes / 1e9
    print(f"repack: {tensors.n_records} experts, {gb:.3f} GB in {repack_s:.2f} s ({gb / repack_s:.2f} GB/s)   "
          f"({args.directory.name}, arena {slots} of {tensors.n_records} slots, read-ahead {args.prefetch}, "
          f"{args.tokens} tokens, {'cold' if args.cold else 'warm'} page cache, median of {args.repeat})")
    print(f"{'form':10} {'ms/token':>9} {'waiting ms/tok':>14} {'expert reads/tok':>16} {'read calls/tok':>14} "
          f"{'MB/tok':>7} {'misses/tok':>10} {'us/expert warm':>14} {'us/expert cold':>14}")
    for name, r in rows.items():
        print(f"{name:10} {r['ms_per_token']:9.2f} {r['waiting_ms_per_token']:14.2f} "
              f"{r['expert_reads_per_token']:16.2f} "
              f"{r['read_calls_per_token']:14.2f} {r['mb_per_token']:7.2f} {r['urgent_misses_per_token']:10.2f} "
              f"{r['us_per_expert_read_warm']:14.1f} {r['us_per_expert_read_cold']:14.1f}")
    print(json.dumps({"benchmark": "tier2_repack", "model": args.directory.name, "slots": slots,
                      "experts": tensors.n_records, "prefetch": args.prefetch, "tokens": args.tokens,
                      "cold": args.cold, "repack_s": repack_s, "repack_gb": gb, "rows": rows}))
    return 0


if __name__ == "__main__":
    sys.exit(main())
