"""Cost of checking one expert record when it lands, per record size and checksum.

    PYTHONPATH=$PWD python benchmarks/checksum.py [--sizes 16384,1380352,4194304] [--repeat 200]

Sizes default to the embedded model's record (16 KB), the 48x256 Q2_0 record of the
format's worked example (1.38 MB) and a large synthetic record (4 MB and 16 MB; Qwen3-235B's Q2_0
record is 4.7 MB). Prints, per checksum, the median microseconds per record and GB/s, and for
reference the cost of reading the record from the page cache (`os.preadv`, a warm file), so
the check is set against the read it guards. Optional packages (xxhash, crc32c, isal) are
measured when importable; strata itself uses only zlib.crc32 (docs/perf.md, "Verifying reads").
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


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--sizes", default="16384,1380352,4194304,16777216", help="record sizes in bytes")
    ap.add_argument("--repeat", type=int, default=200)
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


if __name__ == "__main__":
    main()
