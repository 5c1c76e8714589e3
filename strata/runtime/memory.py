"""What this machine's memory really is: psutil's figures, a container's limit, paging counters,
and the wired-memory ceiling of a Mac's GPU.

- `machine_memory()`: total and available bytes. psutil reads the kernel's own figure on Linux
  (MemAvailable) and macOS (free + inactive, what can be had without swapping). A container's
  memory limit (cgroup v2 `memory.max`, v1 `memory.limit_in_bytes`, the tightest one on the
  path from the process's cgroup to the root) *is* the machine for the budget rule: under a
  300 MB limit the host's MemAvailable says gigabytes, and a run sized by it is killed.
  Inside a limit, available = limit − (usage − inactive file pages), since the kernel reclaims
  inactive file pages before it kills; the active file pages are reported beside it
  (`active_file`), for the budget rule to count the model's own among what an arena may take.
- `paging_snapshot()` / `PagingDelta`: major faults of this process, system swap-in and
  swap-out bytes (and page-ins on macOS), read before and after a run, so a run whose compute
  time rises with the arena (the reference engine's finding: model pages reclaimed and
  re-faulted) shows up as numbers in the stream report.
- `metal_wired_budget()` / `wire_mlx(nbytes)`: on Apple silicon the GPU may keep at most
  `max_recommended_working_set_size` bytes wired; `wire_mlx` raises MLX's wired limit to what a
  plan holds (arena + dense weights), never past that ceiling. Unverified until run on a Mac:
  the Linux CI has no Metal device, so these paths are exercised there only through stubs.
"""

from __future__ import annotations

import os
import resource
from dataclasses import dataclass
from pathlib import Path

__all__ = ["MemoryInfo", "machine_memory", "cgroup_limit", "PagingSnapshot", "PagingDelta", "paging_snapshot",
           "metal_wired_budget", "wire_mlx"]

CGROUP_ROOT = Path("/sys/fs/cgroup")
PROC_SELF_CGROUP = Path("/proc/self/cgroup")
NO_LIMIT = 1 << 62  # cgroup v1 writes 2^63 rounded down to a page for "unlimited"; anything above this is none


@dataclass(frozen=True)
class CgroupLimit:
    """The tightest memory limit on this process's cgroup path: `limit` bytes, of which `used`
    (usage less inactive file pages) are taken; `source` names the file it came from;
    `active_file`: the active file pages counted in `used`."""

    limit: int
    used: int
    source: str
    active_file: int = 0

    @property
    def available(self) -> int:
        return max(0, self.limit - self.used)


@dataclass(frozen=True)
class MemoryInfo:
    total: int  # physical memory, or the container's limit when that is smaller
    available: int  # what a run can take without swapping or being killed
    source: str  # "psutil" or the cgroup file that bounded it
    # file pages counted as taken in `available` (a cgroup's active file pages, where the limit
    # bounded it; 0 for psutil's figure, which counts the page cache as available)
    active_file: int = 0


def _read_int(path: Path) -> int | None:
    try:
        text = path.read_text().strip()
    except OSError:
        return None
    if text == "max":
        return None
    try:
        value = int(text)
    except ValueError:
        return None
    return None if value >= NO_LIMIT else value


def _stat_value(path: Path, key: str) -> int:
    try:
        for line in path.read_text().splitlines():
            name, _, value = line.partition(" ")
            if name == key:
                return int(value)
    except (OSError, ValueError):
        pass
    return 0


def _cgroup_paths(proc_self_cgroup: Path) -> tuple[str | None, str | None]:
    """(v2 path, v1 memory-controller path) of this process, from /proc/self/cgroup."""
    v2 = v1 = None
    try:
        lines = proc_self_cgroup.read_text().splitlines()
    except OSError:
        return None, None
    for line in lines:
        parts = line.split(":", 2)
        if len(parts) != 3:
            continue
        _, controllers, path = parts
        if controllers == "":
            v2 = path
        elif "memory" in controllers.split(","):
            v1 = path
    return v2, v1


def _ancestors(base: Path, path: str) -> list[Path]:
    """base/path, base/parent, ..., base: a limit anywhere above the process bounds it too."""
    parts = [p for p in path.split("/") if p]
    return [base.joinpath(*parts[:n]) for n in range(len(parts), -1, -1)]


def cgroup_limit(root: str | os.PathLike = CGROUP_ROOT,
                 proc_self_cgroup: str | os.PathLike = PROC_SELF_CGROUP) -> CgroupLimit | None:
    """The tightest cgroup memory limit over this process (v2 first, then v1), or None."""
    root, proc = Path(root), Path(proc_self_cgroup)
    v2, v1 = _cgroup_paths(proc)
    candidates: list[tuple[Path, str, str, str]] = []  # (dir, limit file, usage file, memory.stat prefix)
    if v2 is not None:
        candidates += [(d, "memory.max", "memory.current", "") for d in _ancestors(root, v2)]
    if v1 is not None:
        base = root / "memory"
        candidates += [(d, "memory.limit_in_bytes", "memory.usage_in_bytes", "total_")
                       for d in _ancestors(base, v1)]
    best: CgroupLimit | None = None
    for d, limit_file, usage_file, prefix in candidates:
        limit = _read_int(d / limit_file)
        if limit is None:
            continue
        usage = _read_int(d / usage_file) or 0
        used = max(0, usage - _stat_value(d / "memory.stat", prefix + "inactive_file"))
        active = min(used, _stat_value(d / "memory.stat", prefix + "active_file"))
        found = CgroupLimit(limit, used, str(d / limit_file), active)
        if best is None or found.available < best.available:
            best = found
    return best


def machine_memory(*, cgroup_root: str | os.PathLike = CGROUP_ROOT,
                   proc_self_cgroup: str | os.PathLike = PROC_SELF_CGROUP) -> MemoryInfo:
    """Total and available memory for the budget rule: psutil's, bounded by a container limit."""
    import psutil

    vm = psutil.virtual_memory()
    total, available, source, active = int(vm.total), int(vm.available), "psutil", 0
    limit = cgroup_limit(cgroup_root, proc_self_cgroup)  # no such files on macOS: None
    if limit is not None:
        if limit.limit < total:
            total, source = limit.limit, limit.source
        if limit.available < available:
            available, source, active = limit.available, limit.source, limit.active_file
    return MemoryInfo(total, available, source, active)


# ---------------------------------------------------------------- paging counters


@dataclass(frozen=True)
class PagingSnapshot:
    major_faults: int  # this process (getrusage ru_majflt)
    swap_in_bytes: int  # system-wide, since boot (psutil.swap_memory().sin)
    swap_out_bytes: int
    page_ins: int  # this process's page-ins where the system counts them (macOS), else major faults


@dataclass(frozen=True)
class PagingDelta:
    """Paging during a run: what rose between two snapshots."""

    major_faults: int = 0
    swap_in_bytes: int = 0
    swap_out_bytes: int = 0
    page_ins: int = 0

    @classmethod
    def between(cls, before: PagingSnapshot, after: PagingSnapshot) -> "PagingDelta":
        return cls(*(max(0, getattr(after, f) - getattr(before, f)) for f in cls.__dataclass_fields__))


def paging_snapshot() -> PagingSnapshot:
    """The counters now. Each is 0 where the platform does not count it."""
    majflt = resource.getrusage(resource.RUSAGE_SELF).ru_majflt
    sin = sout = 0
    page_ins = majflt
    try:
        import psutil

        sw = psutil.swap_memory()
        sin, sout = int(sw.sin), int(sw.sout)
        mem = psutil.Process().memory_info()
        page_ins = int(getattr(mem, "pageins", majflt))  # macOS has per-process page-ins
    except (ImportError, OSError, RuntimeError):
        pass
    return PagingSnapshot(int(majflt), sin, sout, page_ins)


# ---------------------------------------------------------------- wired memory (Apple silicon)


def metal_wired_budget(mx=None) -> int | None:
    """The most the GPU may keep wired (`max_recommended_working_set_size`), or None where MLX
    has no Metal device."""
    try:
        if mx is None:
            import mlx.core as mx
        if not mx.metal.is_available():
            return None
        info = mx.metal.device_info() if hasattr(mx.metal, "device_info") else mx.device_info()
        return int(info["max_recommended_working_set_size"])
    except (ImportError, AttributeError, KeyError, RuntimeError):
        return None


def wire_mlx(nbytes: int, mx=None) -> int | None:
    """Raise MLX's wired limit to hold `nbytes` (a plan's arena + dense weights), capped at the
    device's ceiling; returns the limit set, or None where there is no Metal device. The
    engine calls this once before it loads; a plan over the ceiling was already refused by
    `plan_arena`, so the cap only guards against a stale plan."""
    budget = metal_wired_budget(mx)
    if budget is None:
        return None
    if mx is None:
        import mlx.core as mx
    limit = min(int(nbytes), budget)
    mx.set_wired_limit(limit)
    return limit
