"""Measured runs over a pool of warmed child processes: compiles in parallel, measurements one at a time.

On a GPU the first run of each kernel specialisation in an MLX process compiles it (NVRTC on the
H200: ~1.3 s for a trivial custom kernel, seconds for each of strata's; custom kernels are not
kept on disk, so every process compiles its own), and a model of a new shape brings a handful of
new ones. One process running every case in turn (`measure.measure_batch`) therefore spent its
time compiling, one kernel after another: on the H200 the quick probe's 9 engine cases did not
finish in 64 s (two left out of the fit), and the `demo` model's 4 cases did not start within the
36 s left after `small`'s. Compiling is CPU work and the GPU host has 16 cores, so:

- `RunPool(groups)` starts one child per group of run specs at once; each runs every spec of its
  group once, unmeasured (the warm-up: its compiles, in parallel with the other children's), then
  says it is ready and waits;
- `RunPool.measure(g, i)` has child g run its spec i again and measures it, while every other
  child sits in a blocking read, stopped (SIGSTOP until the run ends: not one of its threads gets
  a CPU): one measured run at a time on the machine, so no run's time or CPU share is another's.

Measured runs of one round can then be interleaved across groups (`interleaved`): probe models
and validated models measured minutes apart on the H200 moved by 20-36% between passes (the
probe's 6-layer model ran 0.88 ms a token in one pass and 1.20 in another; within one batch its
top-1 twin, doing less work, ran 22% slower than it), so a prediction is checked against runs
measured in the same minutes as the runs its profile was fitted on.

Each measured run's peak is its own over what the child held before it (the high-water mark is
reset first, as `measure_batch` does); a child holds one group's models' leftovers only.
"""

from __future__ import annotations

import json
import os
import select
import shutil
import signal
import subprocess
import sys
import tempfile
import time
from pathlib import Path
from typing import Sequence

from strata.doctor.measure import PROMPT, RunMeasurement, _child_env, _one, _reset_peak

__all__ = ["RunPool", "interleaved", "measure_rounds", "READY"]

READY = "READY"  # what a child prints once every spec of its group has run once
CLOSE_WAIT_S = 2.0  # for the children to exit at close, all together


def _readline(proc: subprocess.Popen, deadline: float) -> str | None:
    """One line of the child's stdout, or None past `deadline` (time.monotonic) or at its end."""
    fd = proc.stdout.fileno()
    buf = b""
    while True:
        left = deadline - time.monotonic()
        if left <= 0:
            return None
        ready, _, _ = select.select([fd], [], [], left)
        if not ready:
            return None
        chunk = os.read(fd, 1)  # byte by byte: a line is all a turn says, and nothing may be read past it
        if not chunk:
            return None
        if chunk == b"\n":
            return buf.decode()
        buf += chunk


class RunPool:
    """Child processes, one per group of (model, Config overrides) specs; see the module docstring.

    `ready(timeout)` waits for every child's warm-up and returns which groups are ready; a child
    not ready by then, or one that fails, is stopped and its runs come back as None from
    `measure`. Use as a context manager (children are stopped on exit)."""

    def __init__(self, groups: Sequence[Sequence[tuple[str | os.PathLike, dict]]], *,
                 max_tokens: int | Sequence[int] = 48, prompt: str = PROMPT) -> None:
        """max_tokens: decoded tokens a run, for every group or one a group."""
        self.groups = [list(g) for g in groups]
        tokens = [max_tokens] * len(self.groups) if isinstance(max_tokens, int) else list(max_tokens)
        self.procs: list[subprocess.Popen | None] = []
        self.failed: dict[int, str] = {}  # group -> why it was stopped (with its stderr's last line)
        self._errs = [tempfile.TemporaryFile() for _ in self.groups]
        mlx = any((o or {}).get("backend") == "mlx" for g in self.groups for _, o in g)
        self._jit_dirs: list[Path] = []
        for g, err, n in zip(self.groups, self._errs, tokens):
            arg = json.dumps({"runs": [{"model": str(m), "overrides": o or {}} for m, o in g],
                              "max_tokens": n, "prompt": prompt})
            env = _child_env()
            if mlx:
                env = self._private_jit_cache(env)
            self.procs.append(subprocess.Popen([sys.executable, "-m", "strata.doctor.pool", arg], stdin=subprocess.PIPE,
                                               stdout=subprocess.PIPE, stderr=err, env=env))
        self._ready: set[int] = set()

    def _private_jit_cache(self, env: dict) -> dict:
        """env with MLX_PTX_CACHE_DIR a directory of this child's own, seeded with hard links to the
        shared one's modules. MLX's CUDA build writes a module it compiled in place (an ofstream
        over `<name>.ptx`, jit_module.cpp) and reads a cached one by its size, then its bytes: children
        compiling the same module at once could each read another's half-written file. A child
        writes only modules missing from its directory, so a linked file is never rewritten."""
        from strata.mlx_backend import jit_cache

        shared = Path(jit_cache.set_default(dict(env)))
        mine = shared.parent / f"{shared.name}.pool-{os.getpid()}-{len(self._jit_dirs)}"
        try:
            mine.mkdir(parents=True, exist_ok=True)
            for f in (shared.iterdir() if shared.is_dir() else ()):
                if f.is_file():
                    os.link(f, mine / f.name)
        except OSError:  # no hard links here (another filesystem): share the directory as before
            shutil.rmtree(mine, ignore_errors=True)
            return env
        self._jit_dirs.append(mine)
        return {**env, jit_cache.ENV: str(mine)}

    def _stop(self, g: int, why: str) -> None:
        proc = self.procs[g]
        if proc is not None:
            proc.kill()
            proc.wait()
            self.procs[g] = None
        self.failed.setdefault(g, why + self._stderr_tail(g))
        self._ready.discard(g)

    def _stderr_tail(self, g: int) -> str:
        err = self._errs[g]
        err.seek(0)
        lines = err.read().decode(errors="replace").strip().splitlines()
        return f": {lines[-1][:300]}" if lines else ""

    def ready(self, timeout: float) -> list[bool]:
        """Wait until every child has warmed up (at most `timeout` seconds in all)."""
        deadline = time.monotonic() + timeout
        for g, proc in enumerate(self.procs):
            if proc is None or g in self._ready:
                continue
            line = _readline(proc, deadline)
            while line is not None and line != READY:  # anything else a library printed
                line = _readline(proc, deadline)
            if line == READY:
                self._ready.add(g)
            else:
                self._stop(g, "warm-up not finished in time or failed")
        return [g in self._ready for g in range(len(self.groups))]

    def measure(self, g: int, i: int, timeout: float) -> RunMeasurement | None:
        """Run spec i of group g again in its (warmed) child and return what it measured; None if
        the child is gone or does not answer within `timeout` seconds (it is then stopped)."""
        proc = self.procs[g]
        if proc is None or g not in self._ready:
            return None
        others = [p for h, p in enumerate(self.procs) if p is not None and h != g]
        for p in others:  # frozen while it runs: not a thread of theirs (driver, allocator) gets a CPU
            p.send_signal(signal.SIGSTOP)
        try:
            return self._measure(g, proc, i, timeout)
        finally:
            for p in others:
                if p.poll() is None:
                    p.send_signal(signal.SIGCONT)

    def _measure(self, g: int, proc: subprocess.Popen, i: int, timeout: float) -> RunMeasurement | None:
        try:
            proc.stdin.write(f"{i}\n".encode())
            proc.stdin.flush()
        except BrokenPipeError:
            self._stop(g, "the child ended")
            return None
        deadline = time.monotonic() + timeout
        while (line := _readline(proc, deadline)) is not None:
            try:
                return RunMeasurement(**json.loads(line))
            except (ValueError, TypeError):  # anything else a library printed
                continue
        self._stop(g, "run not finished in time or failed")
        return None

    def keep_only(self, keep: set) -> None:
        """End every child but those of the groups in `keep` (as `close` does): the kept ones run
        with no other process of the pool alive."""
        ending = [(g, proc) for g, proc in enumerate(self.procs) if proc is not None and g not in keep]
        self._end(ending)  # all together: CLOSE_WAIT_S for them all, not each
        for g, _ in ending:
            self.failed.setdefault(g, "ended (keep_only)")
            self._ready.discard(g)

    def _end(self, live: list) -> None:
        for _, proc in live:
            try:
                proc.stdin.close()
            except OSError:  # BrokenPipeError included: it is gone already
                pass
        deadline = time.monotonic() + CLOSE_WAIT_S
        for g, proc in live:
            try:
                proc.wait(timeout=max(0.01, deadline - time.monotonic()))
            except subprocess.TimeoutExpired:
                proc.kill()
                proc.wait()
            self.procs[g] = None

    def close(self) -> None:
        """End every child: its read ends (it exits), or, past CLOSE_WAIT_S for them all, it is
        killed (nothing of it is wanted now, and a bounded run cannot wait on ten exits in turn)."""
        self._end([(g, p) for g, p in enumerate(self.procs) if p is not None])
        for err in self._errs:
            err.close()
        for d in self._jit_dirs:
            shutil.rmtree(d, ignore_errors=True)

    def __enter__(self) -> "RunPool":
        return self

    def __exit__(self, *exc) -> None:
        self.close()


def interleaved(sizes: Sequence[int], round_: int = 0) -> list[tuple[int, int]]:
    """(group, spec) pairs of one round, round-robin over the groups (each group's specs in
    order), the groups' starting turn rotated by `round_`: a drift over a round spreads over
    every group rather than landing on the last ones."""
    n = len(sizes)
    order = [(g + round_) % n for g in range(n)] if n else []
    out, depth = [], max(sizes, default=0)
    for j in range(depth):
        out += [(g, j) for g in order if j < sizes[g]]
    return out


def measure_rounds(pool: RunPool, rounds: int, deadline: float, run_timeout: float,
                   on_run=None) -> tuple[dict, list[str], list]:
    """Up to `rounds` interleaved rounds of every ready run of `pool`, each run started only while
    `deadline` (time.monotonic) is ahead; a round after the first only if the first round's
    duration still fits; `on_run(group, spec, round, run)` as each run comes in. Returns ((group,
    spec) -> its measurements, what was not measured, the seconds each round took)."""
    sizes = [len(g) for g in pool.groups]
    got: dict = {(g, i): [] for g, n in enumerate(sizes) for i in range(n)}
    cut: list[str] = []
    took: list[float] = []
    gone: set = set()
    for r in range(max(1, rounds)):
        start = time.monotonic()
        if took and start + took[0] > deadline:
            break  # another round would not fit: the rounds done so far stand
        for g, i in interleaved(sizes, r):
            if (g, i) in gone:
                continue  # its child was stopped: said once
            left = deadline - time.monotonic()
            run = pool.measure(g, i, timeout=min(run_timeout, left)) if left > 1 else None
            if run is None:
                cut.append(f"group {g} run {i} round {r + 1}: " + ("no time left" if left <= 1 else
                                                                  pool.failed.get(g, "not measured")))
                if g in pool.failed:
                    gone.add((g, i))
                continue
            got[(g, i)].append(run)
            if on_run is not None:
                on_run(g, i, r, run)
        took.append(time.monotonic() - start)
    return got, cut, took


def _child(arg: str) -> None:
    spec = json.loads(arg)
    runs = [{**run, "max_tokens": spec["max_tokens"], "prompt": spec["prompt"]} for run in spec["runs"]]
    for run in runs:
        _one(run)  # the warm-up: compiles what this spec is the first to use; not measured
    print(READY, flush=True)
    for line in sys.stdin:
        i = int(line)
        _reset_peak()
        print(json.dumps(_one({**runs[i], "warmed": True})), flush=True)


if __name__ == "__main__":
    _child(sys.argv[1])
