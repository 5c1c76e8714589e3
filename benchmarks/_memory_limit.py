"""Run a command under a memory limit: a child cgroup of this process's own (v2 `memory.max`, or
v1's memory controller `memory.limit_in_bytes`), the command moved into it before it execs, the
group removed after. Page cache the command reads is charged to its group, so a model file larger
than the limit is paged in and out as it would be on a machine of that size. Where neither form
can be written (no delegation, not root), `limit_support()` says why and benchmarks run the
no-limit row only. Also: evicting a file's pages (posix_fadvise DONTNEED), so each limited run
starts cold, and reading it through, so a no-limit run starts warm."""

from __future__ import annotations

import os
import subprocess
import time
import uuid
from dataclasses import dataclass
from pathlib import Path

CGROUP_ROOT = Path("/sys/fs/cgroup")


@dataclass(frozen=True)
class CgroupForm:
    parent: Path  # the directory child groups are made in
    limit_file: str  # memory.max (v2) or memory.limit_in_bytes (v1)


def _own_groups() -> tuple[str | None, str | None]:
    v2 = v1 = None
    for line in Path("/proc/self/cgroup").read_text().splitlines():
        _, controllers, path = line.split(":", 2)
        if controllers == "":
            v2 = path
        elif "memory" in controllers.split(","):
            v1 = path
    return v2, v1


def _probe(form: CgroupForm) -> str | None:
    """None when a child group with a limit can be made under form.parent, else why not."""
    probe = form.parent / f"strata-probe-{uuid.uuid4().hex[:8]}"
    try:
        probe.mkdir()
    except OSError as e:
        return f"cannot make a group under {form.parent} ({e.strerror})"
    try:
        (probe / form.limit_file).write_text(str(64 << 20))
        return None
    except OSError as e:
        return f"cannot write {form.limit_file} under {form.parent} ({e.strerror})"
    finally:
        probe.rmdir()


def limit_support() -> tuple[CgroupForm | None, str]:
    """(the form that works, a line saying which) or (None, why neither does)."""
    v2, v1 = _own_groups()
    whys = []
    if v2 is not None and (CGROUP_ROOT / "cgroup.controllers").exists():
        form = CgroupForm(CGROUP_ROOT / v2.lstrip("/"), "memory.max")
        why = _probe(form)
        if why is None:
            return form, f"cgroup v2 child groups of {form.parent} (memory.max)"
        whys.append(why)
    if v1 is not None and (CGROUP_ROOT / "memory").is_dir():
        form = CgroupForm(CGROUP_ROOT / "memory" / v1.lstrip("/"), "memory.limit_in_bytes")
        why = _probe(form)
        if why is None:
            return form, f"cgroup v1 memory child groups of {form.parent} (memory.limit_in_bytes)"
        whys.append(why)
    return None, "; ".join(whys) or "no cgroup memory controller is mounted"


def run_limited(cmd: list[str], limit_bytes: int | None, form: CgroupForm | None, *, timeout: float,
                env: dict | None = None) -> subprocess.CompletedProcess:
    """Run `cmd` (stdout and stderr captured as text) in a fresh child group limited to
    `limit_bytes` (None: no limit, no group). A command the kernel kills for memory comes back with
    returncode -9 (or 137); one past `timeout` with returncode None and stderr "timeout"."""
    group = None
    if limit_bytes is not None:
        assert form is not None, "run_limited: no cgroup form (limit_support() says why)"
        group = form.parent / f"strata-bench-{uuid.uuid4().hex[:8]}"
        group.mkdir()
        (group / form.limit_file).write_text(str(int(limit_bytes)))
        cmd = ["sh", "-c", f'echo $$ > "{group}/cgroup.procs" && exec "$@"', "sh", *cmd]
    try:
        return subprocess.run(cmd, capture_output=True, text=True, timeout=timeout, env=env)
    except subprocess.TimeoutExpired as e:
        return subprocess.CompletedProcess(cmd, None, e.stdout or "", "timeout")
    finally:
        if group is not None:
            for _ in range(50):  # the group empties once the killed process is reaped
                try:
                    group.rmdir()
                    break
                except OSError:
                    time.sleep(0.1)


def evict(*paths: Path) -> None:
    """Drop the files' clean pages from the page cache (so a run starts cold)."""
    for p in paths:
        fd = os.open(p, os.O_RDONLY)
        try:
            os.posix_fadvise(fd, 0, 0, os.POSIX_FADV_DONTNEED)
        finally:
            os.close(fd)


def warm(*paths: Path) -> None:
    """Read the files through once (so a no-limit run starts with them in the page cache)."""
    for p in paths:
        with open(p, "rb", buffering=0) as f:
            while f.read(16 << 20):
                pass
