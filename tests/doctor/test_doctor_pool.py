"""strata.doctor.pool: warmed child processes that measure one run at a time, interleaved."""

from __future__ import annotations

import time
from pathlib import Path

import pytest

from strata.doctor.pool import RunPool, interleaved
from strata.testing.models import make_model


def test_interleaved_visits_every_run_once_round_robin_and_rotates_the_start():
    order = interleaved([2, 3, 1])
    assert sorted(order) == [(0, 0), (0, 1), (1, 0), (1, 1), (1, 2), (2, 0)]
    assert order[:3] == [(0, 0), (1, 0), (2, 0)]  # one run of each group before any group's second
    assert interleaved([2, 3, 1], 1)[:3] == [(1, 0), (2, 0), (0, 0)]
    assert interleaved([]) == []


@pytest.fixture(scope="module")
def demo(tmp_path_factory):
    return make_model(tmp_path_factory.mktemp("pool") / "demo", "demo")  # 16 MB of experts all-resident


def test_pool_measures_warmed_runs_one_at_a_time_with_each_runs_own_peak(demo):
    resident = (demo.model_path, {"backend": "numpy"})
    streaming = (demo.model_path, {"backend": "numpy", "arena": "76slots"})
    with RunPool([[resident], [streaming, resident]], max_tokens=8) as pool:
        assert pool.ready(timeout=300) == [True, True]
        a = pool.measure(0, 0, timeout=120)
        b = pool.measure(1, 0, timeout=120)
        c = pool.measure(1, 1, timeout=120)
    assert a.warmed and b.warmed and c.warmed  # each spec ran once, unmeasured, before
    assert not a.streaming and b.streaming and b.report["reads_per_token"] > 0 and not c.streaming
    assert a.tokens == b.tokens == c.tokens == 8
    if Path("/proc/self/clear_refs").exists():
        # the streaming run's peak is its own: its child's warm-up of the all-resident spec came after
        # it in the group, and the mark is reset before each measured run
        assert b.peak_rss < c.peak_rss


def test_pool_stops_a_child_past_its_time_and_returns_none(demo):
    spec = (demo.model_path, {"backend": "numpy"})
    with RunPool([[spec]], max_tokens=8) as pool:
        start = time.monotonic()
        assert pool.ready(timeout=0.01) == [False]
        assert time.monotonic() - start < 5
        assert pool.measure(0, 0, timeout=5) is None
        assert "warm-up" in pool.failed[0]


def test_pool_reports_a_failing_child(tmp_path):
    with RunPool([[(tmp_path / "missing.gguf", {"backend": "numpy"})]], max_tokens=8) as pool:
        assert pool.ready(timeout=120) == [False]
    assert "warm-up" in pool.failed[0] and len(pool.failed[0]) > len("warm-up not finished in time or failed")


def test_joint_measures_the_callers_cases_in_rounds_beside_a_cached_profile(tmp_path, demo, monkeypatch):
    """With a cached quick profile nothing is probed: the caller's groups alone, warmed while the
    caller works, measured in interleaved rounds; the profile comes back as cached."""
    import dataclasses

    from strata.doctor.joint import measure_joint
    from strata import threads
    from strata.doctor.probe import _machine_id, products_of, run_kernel_threads, save_profile
    from doctor_profile import PROFILE

    monkeypatch.setattr(threads, "busy_cores_now", lambda *a, **k: 0.0)  # the run's kernel threads: fixed
    cached = dataclasses.replace(PROFILE, machine=_machine_id(), products=products_of("numpy"),
                                 kernel_threads=run_kernel_threads("numpy", True))
    save_profile(cached, tmp_path, quick=True)
    cases = [("res", demo.model_path, {}, "demo-resident"), ("str", demo.model_path, {"arena": "76slots"}, "demo-str")]
    worked = []
    joint = measure_joint("numpy", tmp_path, cases, tokens=8, deadline=time.monotonic() + 300, case_timeout=120,
                          rounds=2, while_warming=lambda: worked.append(1))
    assert worked == [1] and not joint.probed and joint.profile == cached
    assert [len(joint.runs[k]) for k in ("res", "str")] == [2, 2] and joint.cut == []
    assert all(r.warmed for rs in joint.runs.values() for r in rs)
    assert joint.runs["str"][0].streaming and not joint.runs["res"][0].streaming
    # a deadline already near: the first round is cut run by run, and says so
    late = measure_joint("numpy", tmp_path, cases, tokens=8, deadline=time.monotonic() + 0.5, case_timeout=120,
                         rounds=2)
    assert not any(late.runs.values()) and any("no time left" in c for c in late.cut)


def test_mlx_children_get_their_own_jit_cache_linked_to_the_shared_one(tmp_path, monkeypatch, demo):
    """Two MLX children compiling one module at once must not read each other's half-written
    file: each gets a directory of hard links to the shared modules, gone after the pool."""
    shared = tmp_path / "ptx"
    shared.mkdir()
    (shared / "module.ptx").write_bytes(b"cubin")
    monkeypatch.setenv("MLX_PTX_CACHE_DIR", str(shared))
    pool = RunPool([[(demo.model_path, {"backend": "mlx"})], [(demo.model_path, {"backend": "mlx"})]], max_tokens=2)
    try:
        dirs = pool._jit_dirs
        assert len(dirs) == 2 and len(set(dirs)) == 2 and shared not in dirs
        for d in dirs:
            assert (d / "module.ptx").stat().st_ino == (shared / "module.ptx").stat().st_ino
    finally:
        pool.close()
    assert not any(d.exists() for d in dirs) and (shared / "module.ptx").read_bytes() == b"cubin"


def test_keep_only_ends_the_other_children_and_the_kept_one_still_measures(demo):
    spec = (demo.model_path, {"backend": "numpy"})
    with RunPool([[spec], [spec]], max_tokens=4) as pool:
        assert pool.ready(timeout=300) == [True, True]
        pool.keep_only({1})
        assert pool.procs[0] is None and pool.measure(0, 0, timeout=60) is None
        assert pool.measure(1, 0, timeout=120).tokens == 4


@pytest.mark.skipif(not Path("/proc/self/stat").exists(), reason="reads process states from /proc")
def test_the_other_children_are_stopped_while_a_run_is_measured(demo):
    import threading

    spec = (demo.model_path, {"backend": "numpy"})
    with RunPool([[spec], [spec]], max_tokens=8) as pool:
        assert pool.ready(timeout=300) == [True, True]
        other = pool.procs[1].pid
        state = lambda: Path(f"/proc/{other}/stat").read_text().rsplit(")", 1)[1].split()[0]  # noqa: E731
        seen = set()
        run = threading.Thread(target=lambda: seen.add(pool.measure(0, 0, timeout=120) is not None))
        run.start()
        states = set()
        while run.is_alive():
            states.add(state())
            time.sleep(0.002)
        run.join()
        assert seen == {True} and "T" in states  # stopped while group 0's run ran
        assert state() != "T"  # and running on after it
