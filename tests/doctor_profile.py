"""A fixed machine profile and memory reading for the doctor's tests, so its predictions are
exact numbers rather than this machine's measurements; shared by tests/doctor/, tests/tier2/ and
tests/tools/ (tier 2's placement is the doctor's)."""

from __future__ import annotations

from strata.config import Config
from strata.doctor import diagnose
from strata.doctor.probe import MachineProfile, OpCost
from strata.runtime.memory import MemoryInfo

GB = 1_000_000_000

PROFILE = MachineProfile(
    backend="numpy", machine="test", disk_latency_s=1e-4, disk_bytes_per_s=1e9, disk_direct=True,
    mem_bytes_per_s=2e10, gemv=OpCost(((1e4, 2e-6), (1e8, 1e-2))), expert=OpCost(((4e3, 2e-5), (1e6, 3e-2))), expert_call_s=5e-5,
    calibration_record_bytes=1920, layer_s=5e-4, turn_s=3e-4, turn_slot_s=1e-7,
    read_s=3e-5, miss_s=5e-4, calibration_slot_bytes=4096, base_rss=50_000_000, load_avg=0.5, measured_at=0.0)


def memory_with(available):
    return MemoryInfo(total=max(available, 24 * GB), available=available, source="test")


def diagnose_on_profile(source, available=20 * GB, **kw):
    """The doctor's diagnosis of `source` on PROFILE with `available` bytes free (numpy unless
    `config=` says otherwise)."""
    config = kw.pop("config", Config(backend="numpy"))
    return diagnose(source, cache_dir=None, config=config, profile=PROFILE, memory=memory_with(available), **kw)
