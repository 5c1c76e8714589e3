"""One measured run in a fresh process: decode speed, peak memory, paging, the stream report.

`measure_run(model, config, ...)` starts `python -m strata.doctor.measure` so that the peak
resident set (ru_maxrss) is the run's own, not the caller's; the child prints one JSON line.
The probe calibrates the engine with it and `benchmarks/doctor_validate.py` measures with it,
so a prediction and its check are timed the same way.

Times: `decode_tps` is tokens / decode wall time (what `strata generate` prints), first tokens
included; `steady_tps` is decode calls / their wall time after `WARMUP_TOKENS` (what the doctor
predicts: the first steps of a process compile MLX's kernels: on the H200 a first run's
decode_tps was 6.3 tok/s where its steady rate was 1,130), with the cache counts of the same
steps (`steady_urgent`, `steady_reads` per decode call); `median_token_s` is the median step
after the warm-up, which a loaded machine's spikes move far less. `cpu_s` / `wall_s`: the
process's own CPU time (every thread) and the wall time of its decode: on a quiet machine
their ratio is the run's own (a streaming run's reader threads wait on the disk), and a run
whose ratio falls was descheduled by other work.
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
import time
from dataclasses import asdict, dataclass, field
from pathlib import Path

__all__ = ["RunMeasurement", "measure_run", "measure_quiet", "measure_batch", "WARMUP_TOKENS", "QUIET_OTHERS"]

QUIET_OTHERS = 0.25  # a run during which other processes kept more than this share of the CPUs busy is redone

WARMUP_TOKENS = 4  # first steps fill the cache and warm numpy's allocator: not counted in the median
PROMPT = "def fibonacci(n):\n    "


@dataclass(frozen=True)
class RunMeasurement:
    decode_tps: float
    median_token_s: float
    tokens: int
    peak_rss: int  # bytes
    streaming: bool
    report: dict = field(default_factory=dict)  # the stream report (empty when all-resident)
    paging: dict = field(default_factory=dict)
    load_before: float = 0.0  # 1-minute load average when the run started
    load_after: float = 0.0
    others_busy: float = 0.0  # share of the machine's CPU time other processes used during the run (Linux)
    steady_tps: float = 0.0  # decode calls / wall time after WARMUP_TOKENS (0: too few tokens)
    steady_urgent: float = 0.0  # urgent misses per decode call over the same steps (streaming)
    steady_reads: float = 0.0  # reads issued per decode call over the same steps (streaming)
    cpu_s: float = 0.0  # the process's CPU time (all threads) during the decode loop
    wall_s: float = 0.0  # the decode loop's wall time
    warmed: bool = False  # a warm-up run of the same spec ran before it in the same process
    steps_s: tuple = ()  # every step's wall time (seconds, to the microsecond): where the compiles fell
    steady_cpu_s: float = 0.0  # the process's CPU seconds (all threads) per decode call over the steady steps

    @property
    def tps(self) -> float:
        """The decode rate the doctor predicts: steady (after the warm-up steps) where measured."""
        return self.steady_tps or self.decode_tps

    def to_dict(self) -> dict:
        return asdict(self)


def measure_run(model: str | os.PathLike, overrides: dict | None = None, *, max_tokens: int = 48,
                prompt: str = PROMPT, timeout: float = 600) -> RunMeasurement:
    """Run `model` with Config `overrides` in a child process and return what it measured."""
    arg = json.dumps({"model": str(model), "overrides": overrides or {}, "max_tokens": max_tokens, "prompt": prompt})
    out = subprocess.run([sys.executable, "-m", "strata.doctor.measure", arg], capture_output=True, text=True,
                         timeout=timeout, env=_child_env())
    if out.returncode != 0:
        raise RuntimeError(f"measured run failed ({out.returncode}): {out.stderr.strip()[-2000:]}")
    return RunMeasurement(**json.loads(out.stdout.strip().splitlines()[-1]))


def _child_env() -> dict:
    env = dict(os.environ)
    root = str(Path(__file__).resolve().parents[2])
    env["PYTHONPATH"] = root + (os.pathsep + env["PYTHONPATH"] if env.get("PYTHONPATH") else "")
    return {k: v for k, v in env.items() if not k.startswith("STRATA_")}  # the overrides say it all


def measure_batch(runs: list[tuple[str | os.PathLike, dict]], *, max_tokens: int = 48, prompt: str = PROMPT,
                  timeout: float = 600, warmup: bool = False) -> list[RunMeasurement | None]:
    """Several runs, one after another, in ONE child process: on a GPU a fresh MLX process
    spent 17-25 s (H200: CUDA start and the kernels' JIT) on a model that decodes in well under
    a second, so a bounded validation cannot afford a process per run. Each run's peak is its
    own from the kernel's high-water mark reset before it (Linux `clear_refs`), over what the
    earlier runs left resident (the interpreter, compiled kernels, the allocators' caches).
    Runs not finished within `timeout` come back as None. `warmup`: each run is done twice and
    the second one measured, so that no measurement pays for compiling kernels its spec is the
    first to use (a later shape bucket, a new expert count) beyond its warm-up steps."""
    arg = json.dumps({"runs": [{"model": str(m), "overrides": o or {}} for m, o in runs], "max_tokens": max_tokens,
                      "prompt": prompt, "warmup": warmup})
    cmd = [sys.executable, "-m", "strata.doctor.measure", "--batch", arg]
    try:
        out = subprocess.run(cmd, capture_output=True, text=True, timeout=timeout, env=_child_env())
        stdout, failed = out.stdout, out.returncode != 0
        err = out.stderr
    except subprocess.TimeoutExpired as e:  # the finished runs' lines are in what it printed so far
        stdout = e.stdout.decode() if isinstance(e.stdout, bytes) else (e.stdout or "")
        failed, err = False, ""
    done = [RunMeasurement(**json.loads(line)) for line in stdout.splitlines() if line.startswith("{")]
    if failed and not done:
        raise RuntimeError(f"measured runs failed: {err.strip()[-2000:]}")
    return done + [None] * (len(runs) - len(done))


def measure_quiet(model: str | os.PathLike, overrides: dict | None = None, *, max_tokens: int = 48,
                  max_others: float = QUIET_OTHERS, tries: int = 3, timeout: float = 600) -> RunMeasurement:
    """`measure_run`, redone (up to `tries` times) while other processes kept more than
    `max_others` of the CPUs busy during it; the least disturbed run is returned. On a shared
    2-core machine identical runs minutes apart differed 2.5x in tok/s at the same load
    average: the disturbance, not the load average, says which runs to trust. `timeout`: seconds
    for all the tries together (subprocess.TimeoutExpired past it)."""
    import time

    best, deadline = None, time.monotonic() + timeout
    for _ in range(max(1, tries)):
        if best is not None and deadline - time.monotonic() < 1:
            return best
        run = measure_run(model, overrides, max_tokens=max_tokens, timeout=max(1.0, deadline - time.monotonic()))
        if best is None or run.others_busy < best.others_busy:
            best = run
        if run.others_busy <= max_others:
            return run
    return best


def _peak_rss() -> int:
    """This process's peak resident set. Linux: VmHWM, which starts afresh at exec (ru_maxrss
    keeps the forking parent's peak across exec); macOS: ru_maxrss, in bytes there."""
    try:
        with open("/proc/self/status") as f:
            for line in f:
                if line.startswith("VmHWM:"):
                    return int(line.split()[1]) * 1024
    except OSError:
        pass
    import resource

    peak = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss
    return int(peak if sys.platform == "darwin" else peak * 1024)  # macOS counts bytes, Linux KiB


def _cpu_jiffies() -> tuple[int, int]:
    """(busy, total) jiffies of the whole machine from /proc/stat; (0, 0) where there is none."""
    try:
        with open("/proc/stat") as f:
            fields = [int(x) for x in f.readline().split()[1:]]
    except (OSError, ValueError):
        return 0, 0
    idle = fields[3] + (fields[4] if len(fields) > 4 else 0)  # idle + iowait
    return sum(fields[:8]) - idle, sum(fields[:8])


def others_busy(before: tuple[int, int], after: tuple[int, int], own_seconds: float) -> float:
    """The share of all CPUs that processes other than this one kept busy between two
    `_cpu_jiffies` readings (the load average lags a minute; this is the run's own window)."""
    busy, total = after[0] - before[0], after[1] - before[1]
    if total <= 0:
        return 0.0
    own = own_seconds * os.sysconf("SC_CLK_TCK")
    return max(0.0, min(1.0, (busy - own) / total))


def _reset_peak() -> None:
    """Start the high-water mark afresh at the current resident set (Linux 4.0+; elsewhere the
    peak stays the process's)."""
    try:
        with open("/proc/self/clear_refs", "w") as f:
            f.write("5")
    except OSError:
        pass


def _one(spec: dict) -> dict:
    import gc

    import numpy as np

    import strata
    from strata.config import from_mapping
    from strata.runtime.memory import PagingDelta, paging_snapshot

    load_before = os.getloadavg()[0]
    config = from_mapping(spec["overrides"])
    model = strata.load(spec["model"])
    before = paging_snapshot()
    cpu0, own0 = _cpu_jiffies(), sum(os.times()[:2])
    steps, caches, cpu, last = [], [], [], None
    wall0 = time.perf_counter()
    for last in strata.stream_generate(model, spec["prompt"], max_tokens=spec["max_tokens"], config=config):
        steps.append(last.token_seconds)
        caches.append(last.cache)
        cpu.append(time.process_time())
    wall = time.perf_counter() - wall0
    own = sum(os.times()[:2]) - own0
    paging = PagingDelta.between(before, paging_snapshot())
    others = others_busy(cpu0, _cpu_jiffies(), own)
    counted = steps[WARMUP_TOKENS:] or steps
    report = last.report.to_dict() if last is not None and last.report is not None else {}
    out = {
        "decode_tps": last.generation_tps if last else 0.0, "median_token_s": float(np.median(counted)),
        "tokens": len(steps), "peak_rss": _peak_rss(), "streaming": bool(report), "report": report,
        "paging": asdict(paging), "load_before": load_before, "load_after": os.getloadavg()[0],
        "others_busy": others, "cpu_s": own, "wall_s": wall, "warmed": bool(spec.get("warmed")),
        "steps_s": [round(t, 6) for t in steps],
        **_steady(steps, caches, cpu),
    }
    model.close()
    del model, last
    gc.collect()
    if "mlx.core" in sys.modules:  # freed MLX buffers stay in its cache otherwise, and count in the next peak
        sys.modules["mlx.core"].clear_cache()
    _trim_heap()
    return out


def _steady(steps: list[float], caches: list, cpu: list[float] | None = None) -> dict:
    """Rate, cache counts and CPU time of the decode calls after WARMUP_TOKENS. Step n samples
    token n and decodes it; the last step samples only, so steps W .. N-2 are the N-1-W decode
    calls (`cpu`: the process's CPU clock after each step)."""
    w, n = WARMUP_TOKENS, len(steps)
    calls = n - 1 - w
    if calls < 1:
        return {}
    out = {"steady_tps": calls / sum(steps[w:n - 1])}
    if cpu:
        out["steady_cpu_s"] = (cpu[n - 2] - cpu[w - 1]) / calls
    first, end = caches[w - 1], caches[n - 2]  # totals after decode w-1 and after the last decode
    if first is not None and end is not None:
        out["steady_urgent"] = (end.urgent_misses - first.urgent_misses) / calls
        out["steady_reads"] = (end.reads_issued - first.reads_issued) / calls
    return out


def _trim_heap() -> None:
    """Give the freed heap back to the system (glibc's malloc_trim): without it a run's freed
    arrays stayed resident and the next run's peak started ~8 MB higher here."""
    import ctypes
    import ctypes.util

    try:
        ctypes.CDLL(ctypes.util.find_library("c")).malloc_trim(0)
    except (OSError, AttributeError, TypeError):
        pass


def _child(arg: str) -> None:
    print(json.dumps(_one(json.loads(arg))))


def _batch(arg: str) -> None:
    spec = json.loads(arg)
    for run in spec["runs"]:
        one = {**run, "max_tokens": spec["max_tokens"], "prompt": spec["prompt"]}
        if spec.get("warmup"):
            _one(one)  # compiles what this spec is the first to use; not measured
            one["warmed"] = True
        _reset_peak()
        print(json.dumps(_one(one)), flush=True)


if __name__ == "__main__":
    if sys.argv[1] == "--batch":
        _batch(sys.argv[2])
    else:
        _child(sys.argv[1])
