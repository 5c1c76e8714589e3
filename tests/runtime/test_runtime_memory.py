"""Memory that holds: a container's limit is the machine, over-budget plans are refused, paging
counters reach the stream report, the wired-memory calls run where MLX has Metal."""

from __future__ import annotations

import re

import pytest

from strata.config import Backend, Config
from strata.errors import ArenaTooSmallError, ConfigError
from strata.cache.types import CacheConfig
from strata.runtime import budget
from strata.runtime.budget import PROCESS_GROWTH, PROCESS_RESERVE, ArenaPlan, budget_bytes, check_wired, keep_bytes, plan_arena
from strata.sizes import parse_size
from strata.runtime.memory import (PagingDelta, PagingSnapshot, cgroup_limit, machine_memory, metal_wired_budget,
                                   paging_snapshot, wire_mlx)

MB = 1_000_000


def _v2(tmp_path, limit="300000000", current=100 * MB, inactive=40 * MB, path="/user.slice/job", active=5):
    root = tmp_path / "cg"
    d = root / path.strip("/")
    d.mkdir(parents=True)
    (d / "memory.max").write_text(f"{limit}\n")
    (d / "memory.current").write_text(f"{current}\n")
    (d / "memory.stat").write_text(f"anon 1\ninactive_file {inactive}\nactive_file {active}\n")
    proc = tmp_path / "cgroup"
    proc.write_text(f"0::{path}\n")
    return root, proc


def test_cgroup_v2_limit(tmp_path):
    root, proc = _v2(tmp_path)
    lim = cgroup_limit(root, proc)
    assert lim.limit == 300 * MB and lim.used == 60 * MB and lim.available == 240 * MB
    mem = machine_memory(cgroup_root=root, proc_self_cgroup=proc)
    assert mem.total == 300 * MB and mem.available == 240 * MB and mem.source.endswith("memory.max")


def test_cgroup_v2_unlimited_and_parent_limit(tmp_path):
    root, proc = _v2(tmp_path, limit="max")
    assert cgroup_limit(root, proc) is None
    (root / "user.slice" / "memory.max").write_text("200000000\n")  # a parent's limit bounds the child
    assert cgroup_limit(root, proc).limit == 200 * MB


def test_cgroup_v1_limit(tmp_path):
    root = tmp_path / "cg"
    d = root / "memory" / "docker" / "abc"
    d.mkdir(parents=True)
    (d / "memory.limit_in_bytes").write_text("500000000\n")
    (d / "memory.usage_in_bytes").write_text("200000000\n")
    (d / "memory.stat").write_text("total_inactive_file 50000000\ntotal_active_file 70000000\n")
    (root / "memory" / "memory.limit_in_bytes").write_text("9223372036854771712\n")  # the root: unlimited
    proc = tmp_path / "cgroup"
    proc.write_text("12:pids:/docker/abc\n4:memory:/docker/abc\n0::/\n")
    lim = cgroup_limit(root, proc)
    assert lim.limit == 500 * MB and lim.available == 350 * MB and lim.active_file == 70 * MB


def test_no_cgroup_files(tmp_path):
    assert cgroup_limit(tmp_path / "none", tmp_path / "missing") is None
    mem = machine_memory(cgroup_root=tmp_path / "none", proc_self_cgroup=tmp_path / "missing")
    assert mem.source == "psutil" and 0 < mem.available <= mem.total


def test_container_limit_sizes_the_budget(tmp_path):
    """The 300 MB container: keep is the measured process growth (more than a 16th of it) and the
    arena what is left in it."""
    root, proc = _v2(tmp_path)
    mem = machine_memory(cgroup_root=root, proc_self_cgroup=proc)
    common = dict(slot_bytes=1 * MB, total_experts=10_000, min_slots=10, dense_bytes=0)
    plan = plan_arena(config=Config(backend="numpy"), available=mem.available, total=mem.total, **common)
    keep = keep_bytes("auto", mem.total)
    assert keep == PROCESS_GROWTH
    assert plan.streaming and plan.slots == (240 * MB - keep) // MB


def test_a_container_reports_its_active_file_pages(tmp_path):
    root, proc = _v2(tmp_path, active=30 * MB)
    assert cgroup_limit(root, proc).active_file == 30 * MB
    assert machine_memory(cgroup_root=root, proc_self_cgroup=proc).active_file == 30 * MB
    assert machine_memory(cgroup_root=tmp_path / "none", proc_self_cgroup=tmp_path / "missing").active_file == 0


def test_keep_auto_is_the_process_reserve():
    """What the process needs beyond its arena, not 7/24 of the machine: PROCESS_RESERVE on a large
    machine (measured 350-450 MB), the measured growth after engine start (27-31 MB, with a
    margin) on a small one, a 16th of the machine between."""
    assert keep_bytes("auto", 24 << 30) == PROCESS_RESERVE == 512 << 20
    assert keep_bytes("auto", 300 * MB) == PROCESS_GROWTH == 40 << 20
    assert keep_bytes("auto", 2 << 30) == (2 << 30) // 16 == 128 << 20
    assert keep_bytes("2GB") == parse_size("2GB", allow_slots=False).nbytes  # an explicit keep is kept


def test_the_model_page_cache_is_not_charged_to_the_arena(tmp_path, monkeypatch):
    """The model file's cached pages are the arena's to take: in a container, those the limit
    counts as used (at most its active file pages) are added back; psutil's figure already
    counts them as available, so nothing is added or taken there."""
    model = (tmp_path / "m.gguf", tmp_path / "m.experts")
    monkeypatch.setattr(budget, "cached_file_bytes", {model[0]: 80 * MB, model[1]: 15 * MB}.__getitem__)
    cfg = Config(keep="100MB")
    keep = keep_bytes("100MB")
    got, reason = budget_bytes(cfg, model_files=model, available=500 * MB, total=10**10, active_file=60 * MB)
    assert got == 500 * MB + 60 * MB - keep and "model page cache" in reason  # capped at the active pages
    got, _ = budget_bytes(cfg, model_files=model, available=500 * MB, total=10**10, active_file=200 * MB)
    assert got == 500 * MB + 95 * MB - keep  # capped at the model's own cached bytes
    got, _ = budget_bytes(cfg, model_files=model, available=500 * MB, total=10**10, active_file=0)
    assert got == 500 * MB - keep


# A 16-layer, 64-expert Qwen3-MoE-like model, everything Q8_0 (34 bytes per 32 weights): D 1024,
# experts of F 512 top-8, 16 query and 4 KV heads of 128, Qwen3's vocabulary, untied head.
Q8 = 34 / 32
SLOT_16x64 = int(3 * 1024 * 512 * Q8)  # one expert record
DENSE_16x64 = int((2 * 151_936 * 1024 + 16 * (2 * 2048 * 1024 + 2 * 512 * 1024)) * Q8) + 16 * 64 * 1024 * 4
INTERPRETER = 150 * MB  # Python, numpy and strata before the engine starts


@pytest.mark.parametrize("share", [0.30, 0.15])
def test_a_model_larger_than_memory_starts_with_default_settings(tmp_path, monkeypatch, share):
    """A container sized for `share` of the experts (the interpreter, the dense weights, that
    share of the experts and the process reserve): the loader has just read the model file,
    whose pages sit in the container's page cache, all active. The default budget rule streams
    with a legal arena of at least that share (344 and 236 slots of 1024; the legal least is
    148), leaving the reserve inside the limit. (The rule used to charge the model's page cache
    and 7/24 of the limit against the arena: less than nothing at both: refused.)"""
    experts = 16 * 64 * SLOT_16x64
    limit = INTERPRETER + DENSE_16x64 + int(share * experts) + PROCESS_RESERVE
    used = INTERPRETER + DENSE_16x64 + DENSE_16x64  # the dense weights' anonymous copy, and the file's cache
    root, proc = _v2(tmp_path, limit=str(limit), current=used, inactive=0, active=DENSE_16x64)
    mem = machine_memory(cgroup_root=root, proc_self_cgroup=proc)
    gguf = tmp_path / "m.gguf"
    monkeypatch.setattr(budget, "cached_file_bytes", lambda p: DENSE_16x64 if p == gguf else 0)
    least = CacheConfig(capacity=1, n_layers=16, n_experts=64, top_k=8, prefetch_depth=10).min_capacity
    plan = plan_arena(config=Config(backend=Backend.NUMPY), slot_bytes=SLOT_16x64, total_experts=16 * 64,
                      min_slots=least, dense_bytes=DENSE_16x64, model_files=(gguf, tmp_path / "m.experts"),
                      available=mem.available, total=mem.total, active_file=mem.active_file)
    assert plan.streaming and plan.slots >= least
    assert plan.nbytes >= share * experts - SLOT_16x64
    assert INTERPRETER + DENSE_16x64 + plan.nbytes + keep_bytes("auto", mem.total) <= limit


def test_arena_above_budget_is_refused_unless_forced():
    common = dict(slot_bytes=1000, total_experts=500, min_slots=40, dense_bytes=0, available=100_000, total=10**9)
    cfg = Config(arena="200slots", keep="0", backend="numpy")
    with pytest.raises(ConfigError, match=r"above this machine's budget.*force_arena=True"):  # Python's spelling
        plan_arena(config=cfg, **common)
    from strata.option_names import command_line

    with command_line(), pytest.raises(ConfigError, match=r"above this machine's budget.*--force-arena to run"):
        plan_arena(config=cfg, **common)
    forced = plan_arena(config=cfg.replace(force_arena=True), **common)
    assert forced.slots == 200
    assert plan_arena(config=Config(arena="90slots", keep="0"), **common).slots == 90


def test_wired_ceiling_refuses_with_numbers():
    plan = ArenaPlan(True, 100, 1000, 40, 500, "test")
    with pytest.raises(ConfigError, match=r"wires 150.00 kB .* at most 120.00 kB"):
        check_wired(plan, 50_000, Config(), wired_budget=120_000)
    check_wired(plan, 50_000, Config(), wired_budget=200_000)  # fits
    check_wired(plan, 50_000, Config(backend=Backend.NUMPY), wired_budget=1)  # numpy memory is not wired
    check_wired(plan, 50_000, Config(force_arena=True), wired_budget=1)
    check_wired(plan, 50_000, Config(), wired_budget=None)  # no Metal device: nothing to check


class _FakeMetal:
    def __init__(self, available=True):
        self._available = available

    def is_available(self):
        return self._available

    def device_info(self):
        return {"max_recommended_working_set_size": 16_000_000_000}


class _FakeMx:
    def __init__(self, available=True):
        self.metal = _FakeMetal(available)
        self.limits = []

    def set_wired_limit(self, n):
        self.limits.append(n)


def test_wire_mlx_caps_at_the_device_ceiling():
    mx = _FakeMx()
    assert metal_wired_budget(mx) == 16_000_000_000
    assert wire_mlx(5_000_000_000, mx) == 5_000_000_000 and mx.limits == [5_000_000_000]
    assert wire_mlx(20_000_000_000, mx) == 16_000_000_000
    assert wire_mlx(1, _FakeMx(available=False)) is None


def test_wiring_on_this_platform():
    """The real calls, where MLX has a Metal device; skipped cleanly elsewhere."""
    budget = metal_wired_budget()
    if budget is None:
        pytest.skip("no Metal device here: the wired-memory path runs only on Apple silicon")
    import mlx.core as mx

    old = mx.set_wired_limit(0)
    try:
        assert wire_mlx(1 << 20) == 1 << 20
    finally:
        mx.set_wired_limit(old)


def test_paging_counters_and_delta():
    s = paging_snapshot()
    assert min(s.major_faults, s.swap_in_bytes, s.swap_out_bytes, s.page_ins) >= 0
    d = PagingDelta.between(PagingSnapshot(1, 10, 20, 1), PagingSnapshot(4, 10, 25, 3))
    assert d == PagingDelta(major_faults=3, swap_in_bytes=0, swap_out_bytes=5, page_ins=2)


def test_paging_in_the_stream_report():
    from strata.cache.types import CacheStats
    from dataclasses import asdict

    from strata.runtime.report import build_report

    common = dict(decode=asdict(CacheStats()), tokens=4, seconds=0.1, host_s=0.01, waiting_s=0.0, after_s=0.0,
                  slot_bytes=4096, arena_slots=10, io="O_DIRECT reads")
    plain = build_report(**common)
    assert plain.paging is None and "paging" not in plain.text()
    rep = build_report(**common, paging=PagingDelta(major_faults=7, swap_in_bytes=4096))
    assert "paging 7 major faults" in rep.text()
    assert rep.to_dict()["paging"] == {"major_faults": 7, "swap_in_bytes": 4096, "swap_out_bytes": 0, "page_ins": 0}
    assert '"major_faults": 7' in rep.to_json()


def test_a_short_arena_is_fitted_and_says_so():
    """Below the default settings' least (16 x 8 + 2 x 10 = 148 slots), a synchronous backend's
    budget arena runs with decode pins of one layer (8 + 2K) at the configured read-ahead depth
    where that fits, else at the deepest depth that does; the plan names the knobs it changed,
    and the config it hands the engine carries them. An asynchronous backend keeps window pins
    (only the depth may go), a caller that does not apply knobs (None) and an explicit --arena
    are refused as before."""
    from strata.runtime.budget import engine_arena_plan

    common = dict(slot_bytes=MB, moe_layers=16, top_k=8, n_experts=64, total_experts=1024, dense_bytes=0,
                  total=10**10, active_file=0)
    config = Config(backend="numpy", keep="0")
    plan = engine_arena_plan(config=config, available=60 * MB, synchronous=True, **common)
    assert (plan.slots, plan.min_slots, plan.prefetch, plan.layer_pins) == (60, 28, 10, True)
    assert "148" in plan.knobs and "layer_pins on" in plan.knobs and "read-ahead depth" not in plan.knobs
    plan = engine_arena_plan(config=config, available=20 * MB, synchronous=True, **common)
    assert (plan.slots, plan.min_slots, plan.prefetch, plan.layer_pins) == (20, 20, 6, True)
    assert "read-ahead depth 10 -> 6 (prefetch)" in plan.knobs
    ran = plan.applied(config)
    assert (ran.prefetch, ran.layer_pins) == (6, True)
    assert CacheConfig(capacity=20, n_layers=16, n_experts=64, top_k=8, prefetch_depth=ran.prefetch,
                       layer_pins=ran.layer_pins).min_capacity == 20
    plan = engine_arena_plan(config=config, available=140 * MB, synchronous=False, **common)
    assert (plan.min_slots, plan.prefetch, plan.layer_pins) == (140, 6, False)  # window pins, depth 6
    for sync, available in ((False, 100 * MB), (None, 140 * MB), (True, 7 * MB)):
        with pytest.raises(ArenaTooSmallError, match="needs at least 148 slots") as err:
            engine_arena_plan(config=config, available=available, synchronous=sync, **common)
        least = {False: "128 slots .* prefetch=0$", True: "8 slots .* prefetch=0 and layer_pins=True$"}.get(sync)
        assert least is None and "the least this backend runs" not in str(err.value) or re.search(least, str(err.value))
    with pytest.raises(ArenaTooSmallError, match="8 slots .* prefetch=0 and layer_pins=True$"):  # named, not taken
        engine_arena_plan(config=config.replace(arena="60slots"), available=200 * MB, synchronous=True, **common)
    full = engine_arena_plan(config=config, available=200 * MB, synchronous=True, **common)
    assert (full.min_slots, full.knobs, full.applied(config)) == (148, "", config)  # nothing changed where it fits
