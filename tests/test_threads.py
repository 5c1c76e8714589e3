"""strata/threads.py: the thread count `auto` chooses for the machine and its load."""

from __future__ import annotations

import os

from strata.threads import (MAX_AUTO_THREADS, WIDE_HIDDEN, auto_threads, busy_cores_now, compute_threads,
                            kernel_threads)


def test_narrow_models_get_one_thread_whatever_the_machine():
    assert auto_threads(WIDE_HIDDEN - 1, cores=64, busy=0) == 1
    assert auto_threads(None, cores=64, busy=0) == 1


def test_wide_models_get_half_the_idle_cores():
    assert auto_threads(WIDE_HIDDEN, cores=16, busy=0) == 8
    assert auto_threads(WIDE_HIDDEN, cores=64, busy=0) == MAX_AUTO_THREADS
    assert auto_threads(WIDE_HIDDEN, cores=16, busy=12) == 4  # only 4 cores idle
    assert auto_threads(WIDE_HIDDEN, cores=2, busy=0) == 1
    assert auto_threads(WIDE_HIDDEN, cores=16, busy=40) == 1  # a loaded machine: one thread, never 0


def test_an_explicit_count_or_the_environments_wins(monkeypatch):
    monkeypatch.delenv("OPENBLAS_NUM_THREADS", raising=False)
    monkeypatch.delenv("OMP_NUM_THREADS", raising=False)
    monkeypatch.delenv("MKL_NUM_THREADS", raising=False)
    assert compute_threads(3, WIDE_HIDDEN) == 3
    monkeypatch.setenv("OMP_NUM_THREADS", "5")
    assert compute_threads(0, WIDE_HIDDEN) == 5
    assert compute_threads(2, WIDE_HIDDEN) == 2


def test_the_kernels_get_every_idle_core_at_any_width():
    """The compiled kernels' count (kernel_threads): an explicit count wins; auto is the cores the
    machine leaves idle (a core counts as busy from half a core up), at most MAX_AUTO_THREADS, never 0."""
    assert kernel_threads(3, cores=64, busy=0) == 3
    assert kernel_threads(0, cores=2, busy=0.2) == 2  # the 2-core machine, quiet: both
    assert kernel_threads(0, cores=2, busy=0.6) == 1  # one competing process: one
    assert kernel_threads(0, cores=16, busy=11.6) == 4
    assert kernel_threads(0, cores=64, busy=0) == MAX_AUTO_THREADS
    assert kernel_threads(0, cores=2, busy=7) == 1


def test_busy_cores_now_is_a_share_of_the_cores():
    busy = busy_cores_now(0.02)
    assert 0 <= busy <= (os.cpu_count() or 1) + 0.5


def test_engines_opened_together_share_one_load_sample(monkeypatch):
    """Each load sample sleeps BUSY_SAMPLE_S: a second open within BUSY_REUSE_S reuses the first's
    answer; a later one, or another sampler (a test's replacement), samples anew."""
    import strata.threads as threads

    calls = []
    monkeypatch.setattr(threads, "busy_cores_now", lambda: calls.append(1) or 0.0)
    clock = [100.0]
    monkeypatch.setattr("time.monotonic", lambda: clock[0])
    assert threads.kernel_threads(0, cores=2) == 2 and threads.kernel_threads(0, cores=2) == 2
    assert len(calls) == 1
    clock[0] += threads.BUSY_REUSE_S + 0.1
    threads.kernel_threads(0, cores=2)
    assert len(calls) == 2
    monkeypatch.setattr(threads, "busy_cores_now", lambda: 1.0)  # another sampler: not the cached answer
    assert threads.kernel_threads(0, cores=2) == 1
