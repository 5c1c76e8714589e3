"""Cost of checking one expert record when it lands, per record size and checksum.

    PYTHONPATH=$PWD python benchmarks/checksum.py [--sizes 16384,1380352,4194304] [--repeat 200] [--pool]

Sizes default to the embedded model's record (16 KB), the 48x256 Q2_0 record of the
format's worked example (1.38 MB) and a large synthetic record (4 MB and 16 MB; Qwen3-235B's Q2_0
record is 4.7 MB). Prints, per checksum, the median microseconds per record and GB/s, and for
reference the cost of reading the record from the page cache (`os.preadv`, a warm file), so
the check is set against the read it guards. Optional packages (xxhash, crc32c, isal) are
measured when importable; strata computes its CRC-32 with ISA-L, zlib where `isal` is missing
(docs/perf.md, "Verifying reads").
"""

from __future__ import annotations

import argparse
import hashlib
import os
import statistics
import tempfile
import time
import zlib

import numpy as np


def _candidates() -> dict:
    out = {
        "zlib.crc32": zlib.crc32,
        "zlib.adler32": zlib.adler32,
        "hashlib.md5": lambda b: hashlib.md5(b).digest(),
        "hashlib.blake2b": lambda b: hashlib.blake2b(b, digest_size=8).digest(),
        "numpy u64 sum": lambda b: int(np.frombuffer(b, np.uint64).sum()),
    }
    try:
        import xxhash

        out["xxhash.xxh3_64"] = xxhash.xxh3_64_intdigest
    except ImportError:
        pass
    try:
        import crc32c

        out["crc32c.crc32c"] = crc32c.crc32c
    except ImportError:
        pass
    try:
        from isal import isal_zlib

        out["isal.crc32"] = isal_zlib.crc32
    except ImportError:
        pass
    return out


def _median_s(fn, repeat: int) -> float:
    times = []
    for _ in range(repeat):
        t = time.perf_counter()
        fn()
        times.append(time.perf_counter() - t)
    return statistics.median(times)


def pool_cost(hidden: int, ffn: int, n: int, threads: int, repeat: int) -> None:
    """Wall time per record for a ReaderPool reading every record of a warm (page-cached)
    `.experts` file of n Q2_0 records, verify off and on, buffered reads."""
    from strata.formats.experts_file import ExpertsFile, write_experts
    from strata.formats.quant_types import QuantType
    from strata.numpy_backend.arena import NumpyArena
    from strata.runtime.io import ReaderPool
    from strata.testing.models import SHAPES, make_expert
    import dataclasses

    cfg = dataclasses.replace(SHAPES["tiny"], hidden_size=hidden, expert_ffn_size=ffn)
    with tempfile.TemporaryDirectory() as d:
        path = os.path.join(d, "x.experts")
        one = make_expert(cfg, 0, 0, 0, QuantType.Q2_0)
        write_experts(path, qtype=QuantType.Q2_0, n_layers=1, n_experts=n, hidden=hidden, expert_ffn=ffn,
                      get_expert=lambda l, e: one)
        xf = ExpertsFile.open(path)
        xf.verify_all()  # warm the page cache
        arena = NumpyArena(n, xf.header.padded_bytes)
        for verify in (False, True):
            pool = ReaderPool(xf, arena, threads=threads, direct=False, verify=verify)
            times = []
            for r in range(repeat):
                t = time.perf_counter()
                base = r * n
                pool.submit_many([(base + e, e, 0, e, True) for e in range(n)])
                pool.wait([base + e for e in range(n)])
                times.append((time.perf_counter() - t) / n)
                pool.completed()
            pool.close()
            s = statistics.median(times)
            print(f"ReaderPool {threads} threads, {xf.header.padded_bytes / 1e6:.3f} MB records, verify "
                  f"{'on ' if verify else 'off'}: {s * 1e6:8.1f} µs/record ({xf.header.padded_bytes / s / 1e9:.1f} GB/s)")
        xf.close()


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--sizes", default="16384,1380352,4194304,16777216", help="record sizes in bytes")
    ap.add_argument("--repeat", type=int, default=200)
    ap.add_argument("--pool", action="store_true", help="also time a ReaderPool over a warm file, verify off/on")
    ap.add_argument("--threads", type=int, default=4, help="reader threads for --pool")
    args = ap.parse_args()
    sizes = [int(s) for s in args.sizes.split(",")]
    cands = _candidates()
    rng = np.random.default_rng(0)
    print(f"{'checksum':<18}" + "".join(f"{s / 1e6:>16.3f} MB" for s in sizes))
    rows: dict[str, list[str]] = {name: [] for name in ["pread (warm)", *cands]}
    with tempfile.TemporaryDirectory() as d:
        for size in sizes:
            buf = rng.integers(0, 256, size, dtype=np.uint8)
            path = os.path.join(d, "r")
            buf.tofile(path)
            fd = os.open(path, os.O_RDONLY)
            out = np.empty(size, np.uint8)
            os.preadv(fd, [out], 0)
            s = _median_s(lambda: os.preadv(fd, [out], 0), args.repeat)
            rows["pread (warm)"].append(f"{s * 1e6:9.1f} µs {size / s / 1e9:5.1f}")
            os.close(fd)
            mv = memoryview(buf)
            for name, fn in cands.items():
                s = _median_s(lambda: fn(mv), args.repeat)
                rows[name].append(f"{s * 1e6:9.1f} µs {size / s / 1e9:5.1f}")
    for name, cells in rows.items():
        print(f"{name:<18}" + "".join(f"{c:>19}" for c in cells))
    print("(median per record; the second number is GB/s)")
    from strata.formats.checksum import CRC32_IMPL

    print(f"strata's checksum() uses {CRC32_IMPL}")
    if args.pool:
        for hidden, ffn in ((256, 64), (2560, 576), (4096, 1536)):
            pool_cost(hidden, ffn, n=48, threads=args.threads, repeat=5)


if __name__ == "__main__":
    main()
