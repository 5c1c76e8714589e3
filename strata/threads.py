"""How many threads numpy's BLAS and the compiled CPU kernels use (Config.threads, `--threads`,
STRATA_THREADS): chosen here, deliberately, instead of OpenBLAS's default of one per core.

Why: decode is matrix-vector products, most of them small (the embedded model's are 64-256 wide:
a 256x256 product takes 4 us, less than a BLAS thread handoff), and BLAS workers spin for cores
that the reader threads and every other process also want. On a loaded 2-core machine the
embedded model decoded at 38.6 tok/s with one thread and 12.7 with OpenBLAS's default
(docs/perf.md, "CPU threads"). So `auto` (threads = 0) is one thread for models narrower than
WIDE_HIDDEN, and half the usable cores (at most MAX_AUTO_THREADS) for wider ones, whose
products are large enough to split, less the cores other processes keep busy (the 1-minute
load average when the engine opens): llama.cpp with 2 threads on this shared 2-core machine
collapsed to 0.6-2 tok/s where 1 thread ran at 33-36, because a thread that waits for a busy
core stalls every product it shares. A thread count the user put in the environment
(OPENBLAS_NUM_THREADS, OMP_NUM_THREADS, MKL_NUM_THREADS) is respected under `auto`.

How: with threadpoolctl installed (a dependency) the limit is set at run time, once per value.
Without it, only the CLI can act, by setting the environment variables before numpy is first
imported (`preset_environment`, called by strata/cli/main.py before anything imports numpy).
This module imports nothing heavy at the top, for that reason.
"""

from __future__ import annotations

import os
from typing import Mapping, MutableMapping, Sequence

__all__ = ["BLAS_ENV", "auto_threads", "usable_cores", "busy_cores", "compute_threads", "apply_threads",
           "preset_environment", "blas_threads", "busy_cores_now", "kernel_threads"]

BLAS_ENV = ("OPENBLAS_NUM_THREADS", "OMP_NUM_THREADS", "MKL_NUM_THREADS")
WIDE_HIDDEN = 2048  # products of narrower models are cheaper than a thread handoff (see the docstring)
MAX_AUTO_THREADS = 8

_applied: int | None = None  # the limit last set through threadpoolctl (setting it costs a library scan)


def usable_cores() -> int:
    try:
        return len(os.sched_getaffinity(0))
    except (AttributeError, OSError):  # not on Linux
        return os.cpu_count() or 1


def busy_cores() -> int:
    """Cores other processes keep busy: the 1-minute load average, rounded (0 where the system
    does not report one)."""
    try:
        return int(round(os.getloadavg()[0]))
    except (AttributeError, OSError):
        return 0


BUSY_SAMPLE_S = 0.1  # the window busy_cores_now watches


def busy_cores_now(window_s: float = BUSY_SAMPLE_S) -> float:
    """Cores other processes keep busy right now: the non-idle share of all CPUs' time over
    `window_s` (Linux's /proc/stat; this thread sleeps through it), times the cores; elsewhere
    the 1-minute load average. The load average lags by a minute: right after a benchmark (or a
    build) it still counts cores that are idle now."""
    def sample() -> tuple[int, int] | None:
        try:
            with open("/proc/stat") as f:
                fields = [int(v) for v in f.readline().split()[1:]]
        except (OSError, ValueError):
            return None
        return sum(fields), fields[3] + (fields[4] if len(fields) > 4 else 0)  # all, idle + iowait

    first = sample()
    if first is None:
        return float(busy_cores())
    import time

    time.sleep(window_s)
    second = sample()
    total, idle = second[0] - first[0], second[1] - first[1]
    if total <= 0:
        return float(busy_cores())
    return (total - idle) / total * (os.cpu_count() or 1)


def kernel_threads(threads: int, cores: int | None = None, busy: float | None = None) -> int:
    """The compiled CPU kernels' thread count for `threads` (Config.threads): itself, or under 0
    every core the machine leaves idle now (`busy`: busy_cores_now(), rounded), at most
    MAX_AUTO_THREADS, at least one. Unlike BLAS's (auto_threads) no width rule: the kernels' own
    workers spin between products and hand work over in microseconds, small products stay on
    one thread (quant_kernels.PARALLEL_MIN_WEIGHTS), and a worker descheduled by another process
    costs little (the caller takes the chunks it has not claimed). Measured on the 2-core
    machine, a D 1024 model (docs/cpu.md, "Threads"): 2 threads 1.6x one thread's decode when
    idle; 0.93x beside one busy process, hence a core counts as busy from half a core up."""
    if threads:
        return threads
    cores = usable_cores() if cores is None else cores
    busy = _recent_busy_cores() if busy is None else busy
    return max(1, min(MAX_AUTO_THREADS, cores - int(busy + 0.5)))


BUSY_REUSE_S = 2.0  # a sample this recent answers again: engines opened together see one load
_last_busy: tuple[float, object, float] | None = None  # (monotonic time, the sampler, busy cores)


def _recent_busy_cores() -> float:
    """busy_cores_now(), or its answer of the last BUSY_REUSE_S seconds: each sample sleeps
    BUSY_SAMPLE_S, which a server opening sessions (or a test suite opening engines) would pay at
    every open, for a load that has not changed. Kept per sampler, so a replaced one samples anew."""
    global _last_busy
    import time

    sampler, now = busy_cores_now, time.monotonic()
    last = _last_busy
    if last is not None and last[1] is sampler and now - last[0] < BUSY_REUSE_S:
        return last[2]
    busy = sampler()
    _last_busy = (time.monotonic(), sampler, busy)
    return busy


def user_threads(environ: Mapping[str, str] | None = None) -> int | None:
    """A BLAS thread count the environment already names, if any (an int > 0)."""
    environ = os.environ if environ is None else environ
    for key in BLAS_ENV:
        value = environ.get(key, "").strip()
        if value.isdigit() and int(value) > 0:
            return int(value)
    return None


def auto_threads(hidden_size: int | None, cores: int | None = None, busy: int | None = None) -> int:
    """`threads = 0`: one thread below WIDE_HIDDEN (or when the model is not known yet), else half
    the usable cores, at most MAX_AUTO_THREADS, and no more than the cores left idle by `busy`
    (default: busy_cores(); at least one thread)."""
    cores = usable_cores() if cores is None else cores
    if hidden_size is None or hidden_size < WIDE_HIDDEN:
        return 1
    busy = busy_cores() if busy is None else busy
    return max(1, min(MAX_AUTO_THREADS, cores // 2, cores - busy))


def compute_threads(threads: int, hidden_size: int | None = None) -> int:
    """The thread count in force for `threads` (Config.threads): itself, or under 0 the
    environment's count or auto_threads."""
    return threads or user_threads() or auto_threads(hidden_size)


def apply_threads(threads: int, hidden_size: int | None = None) -> int | None:
    """Set numpy's BLAS threads for this process: `threads`, or under 0 the environment's count
    or auto_threads. Returns the count set, or None where it cannot be set (no threadpoolctl:
    then the environment of the process start decides)."""
    global _applied
    n = compute_threads(threads, hidden_size)
    try:
        from threadpoolctl import threadpool_limits
    except ImportError:
        return None
    if n != _applied:
        threadpool_limits(limits=n, user_api="blas")  # process-wide: the object need not be kept
        _applied = n
    return n


def blas_threads() -> int | None:
    """The BLAS thread count in force (threadpoolctl's view), or None without threadpoolctl."""
    try:
        from threadpoolctl import threadpool_info
    except ImportError:
        return None
    counts = [i["num_threads"] for i in threadpool_info() if i.get("user_api") == "blas"]
    return min(counts) if counts else None


def _flag_value(argv: Sequence[str]) -> str | None:
    for i, arg in enumerate(argv):
        if arg == "--threads" and i + 1 < len(argv):
            return argv[i + 1]
        if arg.startswith("--threads="):
            return arg.split("=", 1)[1]
        if arg == "--":
            break
    return None


def preset_environment(argv: Sequence[str], environ: MutableMapping[str, str] | None = None) -> None:
    """Before numpy's first import: put the run's thread count (`--threads N`, else STRATA_THREADS,
    else the model-blind auto of one thread) into the BLAS variables the user left unset, so
    OpenBLAS starts with it even without threadpoolctl. A bad value is left for the Config to
    refuse in one line."""
    environ = os.environ if environ is None else environ
    text = _flag_value(argv) or environ.get("STRATA_THREADS", "")
    n = int(text) if text.strip().isdigit() else 0
    if n == 0 and user_threads(environ) is not None:
        return
    value = str(n or auto_threads(None))
    for key in BLAS_ENV:
        environ.setdefault(key, value) if n == 0 else environ.__setitem__(key, value)
