"""Does asking a matrix into L2 make the next GEMV over it faster? Two questions the decode step's
L2 forms (the expert launches asking the next layer's QKV matrix and W_o into L2: built, measured
no faster on the H200, removed; docs/perf.md) could not tell apart: whether a line or bulk
prefetch leaves the matrix in the H200's L2, and whether a decode GEMV reading its matrix from L2
is faster than one reading it from HBM.

One matrix the size of the seed shape's QKV projection (3072 x 2560 float16, 15.7 MB), the decode
GEMV over it (kernels/dense_gemv.py, one token), in five sequences, each after a 256 MB copy that
evicts L2 and ending with a small GEMV that hands the measured one its output buffer:
    cold        the GEMV alone (its matrix from HBM)
    warm        the GEMV, then the GEMV again (the second reads what the first left in L2)
    bulk        a launch asking the matrix into L2 by bulk prefetch (a span a block), then the GEMV
    lines       the same by 128-byte line prefetches (prefetch_l2 a line a thread)
    copy        a launch reading the whole matrix into registers (a demand load), then the GEMV
Run under ncu with no cache flush between kernels and one metric (no kernel replay), so each
GEMV's time is what the L2 held for it; the marker kernel splits the sequences:

    ncu --cache-control none --clock-control none --metrics gpu__time_duration.sum --csv \\
        python3 benchmarks/l2_probe.py | python3 benchmarks/ncu_summary.py

Without ncu it runs the sequences once (a smoke test; on the emulator the prefetches are no-ops).
"""

from __future__ import annotations

import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))
sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

import mlx.core as mx  # noqa: E402
import numpy as np  # noqa: E402

from _measure import ncu_marker  # noqa: E402
from strata.mlx_backend.kernels.dense_gemv import dense_gemv  # noqa: E402
from strata.mlx_backend.kernels.launch import launch  # noqa: E402
from strata.mlx_backend.kernels.source import KernelSource  # noqa: E402

ROWS, COLS = 3072, 2560
BLOCKS = 384  # spans a launch (the QKV GEMV's grid)
EVICT_BYTES = 256 << 20

CHUNK = 1 << 16  # bytes a bulk prefetch instruction asks for
# The asks into L2, this probe's own (no library kernel asks since the forms above were removed):
# on CUDA a line prefetch, and for a span one bulk prefetch on sm_90 (the copy engine walks its
# lines) or a line each 128 bytes before it; on the emulator no-ops (its smoke test checks values)
_PREFETCH = r"""
#if defined(__CUDA_ARCH__)
INLINE void prefetch_l2(const uint8_t* p) { asm volatile("prefetch.global.L2 [%0];" :: "l"(p)); }
INLINE void prefetch_l2_span(const uint8_t* p, uint32_t n) {
#if __CUDA_ARCH__ >= 900
  asm volatile("cp.async.bulk.prefetch.L2.global [%0], %1;" :: "l"(p), "r"(n) : "memory");
#else
  for (uint32_t o = 0; o < n; o += 128u) prefetch_l2(p + o);
#endif
}
#else
INLINE void prefetch_l2(const uint8_t*) {}
INLINE void prefetch_l2_span(const uint8_t*, uint32_t) {}
#endif
"""
# a block's span of pf (PFB bytes in all, PFS a block) into L2, asked by one thread
_ASK = KernelSource("strata_probe_l2_ask", ("pf",), ("out",), r"""
  if (tid == 0u) {
    const uint64_t lo = (uint64_t)bx * (uint64_t)PFS;
    const uint64_t hi = lo + (uint64_t)PFS < (uint64_t)PFB ? lo + (uint64_t)PFS : (uint64_t)PFB;
    for (uint64_t o = lo; o + 16u <= hi; o += (uint64_t)PF_CHUNK) {
      const uint64_t n = hi - o < (uint64_t)PF_CHUNK ? hi - o : (uint64_t)PF_CHUNK;
      prefetch_l2_span((const DEVICE uint8_t*)pf + o, (uint32_t)(n & ~(uint64_t)15u));
    }
    out[bx] = 0.0f;
  }
""", _PREFETCH)
_LINES = KernelSource("strata_probe_l2_lines", ("pf",), ("out",), r"""
  const DEVICE uint8_t* p = (const DEVICE uint8_t*)pf;
  for (uint64_t o = ((uint64_t)bx * NT + tid) * 128u; o < (uint64_t)PFB; o += (uint64_t)NB * NT * 128u) prefetch_l2(p + o);
  if (tid == 0u) out[bx] = 0.0f;
""", _PREFETCH)
_READ = KernelSource("strata_probe_l2_read", ("pf",), ("out",), r"""
  const DEVICE uint4* p = (const DEVICE uint4*)pf;
  uint32_t acc = 0u;
  for (uint64_t o = (uint64_t)bx * NT + tid; o < (uint64_t)(PFB / 16); o += (uint64_t)NB * NT) acc ^= p[o].x ^ p[o].w;
  out[bx * NT + tid] = (float)(acc & 1u);
""")


def _run(src: KernelSource, w: mx.array, template: tuple, threads: int = 256) -> mx.array:
    return launch(src, [w], [(BLOCKS * threads,)], [mx.float32], blocks=(BLOCKS, 1, 1), threads=threads,
                  template=template)[0]


def main() -> int:
    rng = np.random.default_rng(0)
    # in device memory (an op's output): an array made from host memory is managed memory on MLX's
    # CUDA build, which a kernel faults in (a first run of this probe timed those faults, 150-450 us)
    w = mx.array((rng.standard_normal((ROWS, COLS)) * 0.02).astype(np.float16)) + 0
    x = mx.array(rng.standard_normal((1, COLS)).astype(np.float32)) + 0
    evict = mx.zeros((EVICT_BYTES // 4,), mx.float32) + 0
    # A GEMV whose output is the measured one's size and whose matrix is small (0.4 MB): the
    # measured GEMV's output then takes the buffer it freed. Without it the first run with device
    # arrays timed the first GEMV after other launches at 140-320 us and the second at 6 us: a
    # fresh output buffer's first touch, not the matrix's bytes
    w_small = mx.array((rng.standard_normal((ROWS, 64)) * 0.02).astype(np.float16)) + 0
    x_small = mx.array(rng.standard_normal((1, 64)).astype(np.float32)) + 0
    mx.eval(w, x, evict, w_small, x_small)
    per_block = -(-int(w.nbytes) // BLOCKS)
    span = (("PFB", int(w.nbytes)), ("PFS", -(-per_block // 128) * 128), ("PF_CHUNK", CHUNK))
    plain = (("PFB", int(w.nbytes)), ("NB", BLOCKS), ("NT", 256))
    mark = ncu_marker()
    first = None
    sequences = {
        "cold": [],
        "warm": [lambda: dense_gemv(w, x)],
        "bulk": [lambda: _run(_ASK, w, span)],
        "lines": [lambda: _run(_LINES, w, plain)],
        "copy": [lambda: _run(_READ, w, plain)],
    }
    for rep in range(2):
        for name, before in sequences.items():
            mx.eval(evict + 1.0)  # a 256 MB read and write: L2 holds none of w
            for f in before:
                mx.eval(f())
            mx.eval(dense_gemv(w_small, x_small))  # its output's buffer is the next one's (see below)
            y = dense_gemv(w, x)
            mx.eval(y)
            mark()
            first = np.array(y) if first is None else first
            assert np.array_equal(np.array(y), first), name  # the prefetches change no values
            print(f"l2_probe segment: pass {rep + 1}, {name}", flush=True)
    return 0


if __name__ == "__main__":
    sys.exit(main())
