"""PLE rows are never loaded whole: the peak RSS of writing a row store (in shards) and of
streaming rows from it through the row cache, with a store several times larger than the
stated budget (the cache's `ple_reserve`).

    write:  peak - start <= 4 x one shard in float32 (it, its encoded rows, their pages) + PLE_RSS_SLACK
    stream: peak - start <= the row cache (ple_reserve) + PLE_RSS_SLACK

Measured as tests/convert/test_convert_streaming.py does: imports first, then the kernel's high-water
mark reset (5 to /proc/self/clear_refs), the work, and VmHWM against the VmRSS it started from.
"""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

import pytest

from tests.budgets import PLE_RSS_SLACK

REPO = Path(__file__).resolve().parents[2]
MIB = 1 << 20
LAYERS, ROWS, WIDTH, SHARD = (0, 2, 5), 1 << 18, 128, 8192  # 3 tables of 64 MiB in f16; shards of 4 MiB float32
RESERVE = "2MiB"
HEADS, TOKENS = 16, 300

SCRIPT = """
import sys
import numpy as np
from strata.config import Config
from strata.formats.ngram_rows_file import NgramRowsFile
from strata.formats.ngram_rows_writer import NgramRowsWriter
from strata.formats.quant_types import QuantType
from strata.runtime.ngram_budget import plan_row_cache
from strata.runtime.ngram_rows import StreamedNgramRows

path, layers, rows, width, shard, reserve, heads, tokens = sys.argv[1], eval(sys.argv[2]), *map(int, sys.argv[3:6]), \\
    sys.argv[6], *map(int, sys.argv[7:9])

def status(key):
    with open("/proc/self/status") as f:
        return next(int(l.split()[1]) * 1024 for l in f if l.startswith(key + ":"))

def reset():
    with open("/proc/self/clear_refs", "w") as f:
        f.write("5")
    return status("VmRSS")

rng = np.random.default_rng(0)
start = reset()
with NgramRowsWriter(path, qtype=QuantType.F16, shapes={l: (rows, width) for l in layers}) as w:
    for a in range(0, rows, shard):
        for l in layers:  # the tables interleaved, shard by shard, as a sharded checkpoint
            w.write(l, rng.standard_normal((min(shard, rows - a), width), dtype=np.float32))
write_peak = status("VmHWM")
store = NgramRowsFile.open(path)
plan = plan_row_cache(Config(ple_reserve=reserve), store, rows_per_position=heads * len(layers))
start2 = reset()
with StreamedNgramRows(store, capacity=plan.pages) as cache:
    for t in range(tokens):
        ids = {l: rng.integers(0, rows, (1, heads)) for l in layers}
        cache.prefetch(ids)
        for l in layers:
            assert cache.rows(l, ids[l]).shape == (1, heads, width)
    read = cache.stats().total.bytes_read
print(start, write_peak, start2, status("VmHWM"), plan.nbytes, read)
"""


@pytest.mark.skipif(not os.path.exists("/proc/self/clear_refs"), reason="needs Linux's /proc/self/clear_refs")
def test_rows_are_never_loaded_whole(tmp_path):
    path = tmp_path / "big.ngrams"
    env = dict(os.environ, PYTHONPATH=str(REPO))
    args = [str(path), repr(LAYERS), str(ROWS), str(WIDTH), str(SHARD), RESERVE, str(HEADS), str(TOKENS)]
    r = subprocess.run([sys.executable, "-c", SCRIPT, *args], capture_output=True, text=True, env=env, cwd=REPO,
                       check=False, timeout=300)
    assert r.returncode == 0, r.stderr
    start, write_peak, start2, read_peak, cache_bytes, read = map(int, r.stdout.split()[-6:])
    store = os.path.getsize(path)
    shard_f32 = SHARD * WIDTH * 4
    print(f"\nstore {store / MIB:.0f} MiB; write: peak +{(write_peak - start) / MIB:.1f} MiB (shard {shard_f32 / MIB:.0f} "
          f"MiB f32); stream: peak +{(read_peak - start2) / MIB:.1f} MiB, cache {cache_bytes / MIB:.1f} MiB, "
          f"{read / MIB:.1f} MiB read")
    assert store > 4 * (cache_bytes + PLE_RSS_SLACK)  # the store is larger than the budget, several times over
    assert write_peak - start <= 4 * shard_f32 + PLE_RSS_SLACK
    assert read_peak - start2 <= cache_bytes + PLE_RSS_SLACK
    assert read > 2 * cache_bytes  # the run read more than the cache holds: the cache turned over
