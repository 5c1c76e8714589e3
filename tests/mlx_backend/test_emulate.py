"""The CPU emulator (strata/mlx_backend/kernels/emulate.py) checks barrier discipline: a read
that a barrier should order after another thread's write reads the stale value in every run
(the broadcast and the reduction alike), and a thread that skips a barrier is reported as a
deadlock at once, not after the timeout. The kernels' own tests check their arithmetic."""

from __future__ import annotations

import numpy as np
import pytest

from strata.mlx_backend.kernels import emulate
from strata.mlx_backend.kernels.source import KernelSource

pytestmark = pytest.mark.skipif(not emulate.available(), reason="no C++20 compiler")

NT = 64  # two warps: the barriers cross warps


def _broadcast(barrier: bool) -> KernelSource:  # thread 0 writes, every thread reads
    return KernelSource(f"emu_broadcast_{int(barrier)}", ("x",), ("out",), f"""
  SHARED float s[1];
  if (tid == 0) s[0] = x[0] + (float)bx;
  {"BARRIER();" if barrier else ""}
  out[bx * NT + tid] = s[0];
""")


def _reduction(barrier: bool) -> KernelSource:  # every thread writes, thread 0 reads them all
    return KernelSource(f"emu_reduction_{int(barrier)}", ("x",), ("out",), f"""
  SHARED float s[NT];
  s[tid] = (x[0] + (float)bx) * (float)(tid + 1);
  {"BARRIER();" if barrier else ""}
  if (tid == 0) {{
    float total = 0.0f;
    for (int i = 0; i < NT; ++i) total += s[i];
    out[bx] = total;
  }}
  BARRIER();
""")


def _launch(src: KernelSource, value: float, out_size: int, blocks: int = 1) -> np.ndarray:
    x = np.full(8, value, np.float32)  # MIN_INPUT_SIZE
    return emulate.run(src, [x], [(out_size,)], [np.float32], (blocks * NT, 1, 1), (NT, 1, 1), (("NT", NT),))[0]


# The written values differ by block and by launch: SHARED arrays outlive a block and a launch,
# so a stale read is a value of the previous block or launch.
@pytest.mark.parametrize("value", [3.0, 5.0])
def test_a_broadcast_needs_its_barrier(value):
    want = np.repeat(np.float32(value) + np.arange(2, dtype=np.float32), NT)
    assert np.array_equal(_launch(_broadcast(True), value, 2 * NT, blocks=2), want)
    stale = _launch(_broadcast(False), value, 2 * NT, blocks=2) != want
    assert stale[:NT].sum() >= NT // 4 and stale[NT:].sum() >= NT // 4, "read thread 0's write without the barrier"


@pytest.mark.parametrize("value", [3.0, 5.0])
def test_a_reduction_needs_its_barrier(value):
    want = (value + np.arange(2)) * NT * (NT + 1) / 2
    assert np.array_equal(_launch(_reduction(True), value, 8, blocks=2)[:2], want)
    got = _launch(_reduction(False), value, 8, blocks=2)[:2]
    assert np.all(got != want), "thread 0 read every thread's write without the barrier"


def test_a_thread_that_skips_a_barrier_is_a_deadlock():
    src = KernelSource("emu_skipped_barrier", ("x",), ("out",), """
  if (tid < 32) BARRIER();
  out[tid] = x[0];
""")
    with pytest.raises(RuntimeError, match="skipped a barrier"):  # the scheduler's finding (the timeout
        _launch(src, 1.0, NT)                                      # says "did not finish in 120 s")


def test_warp_sums_and_the_block_barrier_agree_with_numpy():
    src = KernelSource("emu_warp_sum", ("x",), ("out",), """
  SHARED float s[NT / 32];
  const float v = x[bx * NT + tid];
  const float w = warp_sum(v);
  if (lane == 0) s[warp_id] = w;
  BARRIER();
  if (tid == 0) {
    float total = 0.0f;
    for (int i = 0; i < NT / 32; ++i) total += s[i];
    out[bx] = total;
  }
  BARRIER();
""")
    x = np.arange(3 * NT, dtype=np.float32)
    got = emulate.run(src, [x], [(3,)], [np.float32], (3 * NT, 1, 1), (NT, 1, 1), (("NT", NT),))[0]
    assert np.array_equal(got, x.reshape(3, NT).sum(axis=1))
