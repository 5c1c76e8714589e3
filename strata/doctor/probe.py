"""This machine, measured once and cached: disk, memory, compute and strata's own engine costs.

`machine_profile(backend, cache_dir)` returns the cached `MachineProfile` for the backend, or
measures one (about 15-30 s) and caches it as `cache_dir/machine-<backend>.json`:

- disk: 4 KiB random reads at queue depth 1 (latency) and 1 MiB random reads from 4 threads
  (bandwidth), O_DIRECT where the filesystem allows, on a scratch file in the cache dir;
- memory bandwidth: a 64 MB array copy (bytes read + written per second); on MLX its largest
  GEMV's bytes per second on the device (the floor a token's bytes set);
- compute: a float32 GEMV at five sizes and one routed expert's SwiGLU at six sizes on the
  backend's own path: seconds per call as a function of bytes read (`OpCost`, a table). On
  numpy the products are the ones a run computes with (`numpy_ops`: the compiled CPU kernels
  under Config.cpu_kernels where they build, `products` "compiled", else numpy's float32
  widen + BLAS, "float32"); on the compiled ones also a Q8_0 and a Q6_K dense GEMV (`kernel_gemv`) and
  experts of every compiled type but Q2_0 (`expert_kernels`: Q8_0, Q4_0 and llama.cpp's
  K-quants, IQ4_NL / IQ4_XS, MXFP4, Q5_1). A float32 profile is cached apart
  (`machine-numpy-float32.json`): a profile answers only for runs on its own products;
- the engine: a made model (`tiny` shape, 6 layers of 64 experts) run in a fresh process
  all-resident at top-4 and at top-1 (the difference is the engine's own cost per routed
  expert, `expert_call_s`; the microbenchmark only scales it with the record's size), then
  streaming at four arenas from the smallest legal one to every expert. What the ops do not
  explain is strata's per-layer cost (`layer_s`); the streaming runs
  give the wait per urgent miss (`miss_s`, from the report's waiting time) and, by
  non-negative least squares, the streamer's per-layer turn (`turn_s` + `turn_slot_s` per
  arena slot: measured to grow with the arena) and the host's cost per read issued (`read_s`).
  The resident run's peak RSS less the model's bytes is the process's base memory. The fit is
  engine_fit.py's; the runs are kept in the profile (`calibration`) so it can be redone; the
  cases and how they are run (fresh processes, or a pool of warmed ones) are probe_engine.py's.

Engine times are per decode call after the warm-up steps (the first steps of an MLX process
compile kernels); the 1-minute load average at measurement time is kept with the profile.
"""

from __future__ import annotations

import dataclasses
import json
import os
import platform
import tempfile
import threading
import time
from pathlib import Path
from typing import Mapping

import numpy as np

from strata.doctor.engine_fit import device_bandwidth, fit_engine, run_name
from strata.doctor.probe_engine import POOL_ROUNDS
from strata.doctor.profile import COMPILED, FLOAT32, PROFILE_VERSION, QUICK_NOTE, MachineProfile, OpCost

__all__ = ["MachineProfile", "machine_profile", "first_answer_profile", "default_cache_dir", "measure_machine", "measure_parts",
           "profile_from_runs", "save_profile", "cached_profile", "PROFILE_VERSION"]

SCRATCH_BYTES = 64 << 20
SMALL_READ, LARGE_READ = 4096, 1 << 20
READ_THREADS = 4
# The quick probe (`quick=True`, for a bounded run on a lent GPU machine where a fresh MLX process
# cost 17-25 s on the H200): the engine cases over a pool of warmed processes (probe_engine.py,
# pool.py: their kernels compile in parallel, runs measured one at a time in interleaved rounds),
# three streaming arenas (the fewest the least-squares fit of turn_s, turn_slot_s and read_s
# takes), one compute round. Cached apart from the full one.
QUICK_COMPUTE_ROUNDS = 1
# `strata doctor`'s first answer on a cold cache: the quick probe with one measured round (the
# median of 1). Its engine part is most of the probe and each round repeats every case: on the
# 2-core machine at load ~10, three rounds took 79 s (25 s of CPU), one 55 s (17 s of CPU), the
# full probe 423 s (109 s of CPU) (docs/doctor.md, "Cold-cache time").
FIRST_ANSWER_ROUNDS = 1


def default_cache_dir(environ: Mapping[str, str]) -> Path:
    """The user's cache dir for strata: $XDG_CACHE_HOME/strata, ~/Library/Caches/strata on
    macOS, ~/.cache/strata elsewhere. `environ` is passed in (the CLI gives os.environ)."""
    if environ.get("XDG_CACHE_HOME"):
        return Path(environ["XDG_CACHE_HOME"]) / "strata"
    home = Path(environ.get("HOME") or Path.home())
    if platform.system() == "Darwin":
        return home / "Library" / "Caches" / "strata"
    return home / ".cache" / "strata"


def _machine_id() -> str:
    return f"{platform.node()} {platform.machine()} {os.cpu_count()} cpus"


def machine_profile(backend: str, cache_dir: Path, *, remeasure: bool = False, progress=None,
                    quick: bool = False, timeout: float = 600, rounds: int | None = None,
                    cpu_kernels: bool = True, threads: int = 0) -> MachineProfile:
    """The cached profile of this machine for `backend`, measured now if absent or stale
    (`quick`: the quick probe's, cached as `machine-<backend>-quick.json`; `rounds`: its measured
    rounds, default POOL_ROUNDS; `cpu_kernels`: Config.cpu_kernels of the run it answers for:
    a numpy profile on float32 products is cached apart, `machine-numpy-float32.json`; `threads`:
    the compiled kernels' count the run will use, 0 for kernel_threads(0) now: a profile per
    count, `machine-numpy-t2.json`)."""
    threads = run_kernel_threads(backend, cpu_kernels, threads)
    prof = None if remeasure else cached_profile(backend, cache_dir, quick=quick, cpu_kernels=cpu_kernels,
                                                 threads=threads)
    if prof is not None:
        return prof
    kwargs = {"rounds": rounds} if rounds is not None else {}
    prof = measure_machine(backend, Path(cache_dir), progress=progress, quick=quick, timeout=timeout,
                           cpu_kernels=cpu_kernels, threads=threads, **kwargs)
    save_profile(prof, cache_dir, quick=quick)
    return prof


def first_answer_profile(backend: str, cache_dir: Path, *, remeasure: bool = False, progress=None,
                         cpu_kernels: bool = True, threads: int = 0) -> MachineProfile:
    """The profile `strata doctor` answers from without --calibrate: the full probe's where it is
    cached (it was calibrated), else the quick probe's, measured now if absent (about half a
    minute on a quiet 2-core machine, against several minutes for the full probe's fresh
    processes: docs/doctor.md, "The machine probe")."""
    threads = run_kernel_threads(backend, cpu_kernels, threads)
    if not remeasure:
        full = cached_profile(backend, cache_dir, cpu_kernels=cpu_kernels, threads=threads)
        if full is not None:
            return full
    return machine_profile(backend, cache_dir, remeasure=remeasure, progress=progress, quick=True,
                           rounds=FIRST_ANSWER_ROUNDS, cpu_kernels=cpu_kernels, threads=threads)


def run_kernel_threads(backend: str, cpu_kernels: bool, threads: int = 0) -> int:
    """The compiled kernels' thread count a numpy run under Config.threads = `threads` computes
    with (strata.threads.kernel_threads: under 0 the cores idle now); 0 where it computes on none
    of them (MLX, float32 products)."""
    from strata.threads import kernel_threads

    if backend == "mlx" or not numpy_ops(cpu_kernels, 1).compiled:
        return 0
    return kernel_threads(threads)


def _profile_path(backend: str, cache_dir: Path, quick: bool, products: str = "", threads: int = 0) -> Path:
    kind = f"-{FLOAT32}" if products == FLOAT32 else f"-t{threads}" if products == COMPILED and threads else ""
    return Path(cache_dir) / f"machine-{backend}{kind}{'-quick' if quick else ''}.json"


def cached_profile(backend: str, cache_dir: Path, *, quick: bool = False,
                   cpu_kernels: bool = True, threads: int = 0) -> MachineProfile | None:
    """The cached profile of this machine, or None (absent, stale, of another machine, or
    measured on other products or another kernel thread count than a run under `cpu_kernels`
    and Config.threads = `threads` computes with)."""
    products = products_of(backend, cpu_kernels)
    threads = run_kernel_threads(backend, cpu_kernels, threads)
    path = _profile_path(backend, cache_dir, quick, products, threads)
    if not path.exists():
        return None
    try:
        prof = MachineProfile.from_dict(json.loads(path.read_text()))
    except (ValueError, TypeError, KeyError):
        return None  # an old or broken cache: measure again
    fresh = (prof.version == PROFILE_VERSION and prof.machine == _machine_id() and prof.products == products
             and prof.kernel_threads == threads)
    return prof if fresh else None


# ---------------------------------------------------------------- disk


def _disk(cache_dir: Path) -> tuple[float, float, bool]:
    cache_dir.mkdir(parents=True, exist_ok=True)
    path = cache_dir / "disk-probe.tmp"
    rng = np.random.default_rng(0)
    try:
        with open(path, "wb") as f:
            f.write(rng.integers(0, 255, SCRATCH_BYTES, dtype=np.uint8).tobytes())
            f.flush()
            os.fsync(f.fileno())
        direct = True
        try:
            fd = os.open(path, os.O_RDONLY | getattr(os, "O_DIRECT", 0))
            if not getattr(os, "O_DIRECT", 0):
                raise OSError("no O_DIRECT")
        except OSError:
            direct = False
            fd = os.open(path, os.O_RDONLY)
        try:
            import mmap

            buf = mmap.mmap(-1, LARGE_READ)  # page-aligned, as O_DIRECT wants
            try:
                os.preadv(fd, [memoryview(buf)[:SMALL_READ]], 0)
            except OSError:
                direct = False
                os.close(fd)
                fd = os.open(path, os.O_RDONLY)
            if not direct and hasattr(os, "posix_fadvise"):
                os.posix_fadvise(fd, 0, 0, os.POSIX_FADV_DONTNEED)  # clean pages: dropped, reads go to disk
            offsets = rng.integers(0, SCRATCH_BYTES // SMALL_READ, 200) * SMALL_READ
            lat = []
            for off in offsets:
                t = time.perf_counter()
                os.preadv(fd, [memoryview(buf)[:SMALL_READ]], int(off))
                lat.append(time.perf_counter() - t)
            big = rng.integers(0, SCRATCH_BYTES // LARGE_READ, 64) * LARGE_READ
            if not direct and hasattr(os, "posix_fadvise"):
                os.posix_fadvise(fd, 0, 0, os.POSIX_FADV_DONTNEED)

            def reader(part):
                b = mmap.mmap(-1, LARGE_READ)
                for off in part:
                    os.preadv(fd, [memoryview(b)], int(off))

            threads = [threading.Thread(target=reader, args=(big[i::READ_THREADS],)) for i in range(READ_THREADS)]
            t = time.perf_counter()
            for th in threads:
                th.start()
            for th in threads:
                th.join()
            bw = len(big) * LARGE_READ / (time.perf_counter() - t)
        finally:
            os.close(fd)
    finally:
        path.unlink(missing_ok=True)
    return float(np.median(lat)), float(bw), direct


# ---------------------------------------------------------------- memory and compute


def _best(fn, repeats: int) -> float:
    best = float("inf")
    for _ in range(repeats):
        t = time.perf_counter()
        fn()
        best = min(best, time.perf_counter() - t)
    return best


def _median(fn, repeats: int) -> float:
    out = []
    for _ in range(repeats):
        t = time.perf_counter()
        fn()
        out.append(time.perf_counter() - t)
    return float(np.median(out))


def _mem_bw() -> float:
    a = np.ones(SCRATCH_BYTES // 4, np.float32)
    b = np.empty_like(a)
    return 2 * a.nbytes / _best(lambda: np.copyto(b, a), 5)


GEMV_SIZES = (64, 256, 1024, 2048, 4096)  # square float32 matrices: 16 kB .. 64 MB
EXPERT_SIZES = ((64, 32), (128, 64), (256, 128), (512, 256), (1024, 512), (2048, 768))  # (D, F)
COMPUTE_ROUNDS = 3  # interleaved rounds over the sizes; each point is its median
# the dense types whose GEMV the probe times on its compiled kernel: strata's Q8_0 and the type of
# llama.cpp files' dense matrices (a GGUF's Q6_K head and attention); the others are priced as
# float32 products
DENSE_KERNEL_TYPES = ("Q8_0", "Q6_K")
EXPERT_STACK = 4  # distinct experts per timed call: a decode token's experts go to the kernel together


def _table(cases, repeats: int = 5, rounds: int = COMPUTE_ROUNDS) -> OpCost:
    """OpCost from [(bytes, fn)]: the median over COMPUTE_ROUNDS rounds of each size's median.
    A round during which other processes kept more than QUIET_OTHERS of the CPUs busy is
    redone (at most COMPUTE_ROUNDS more times): a burst of other work must not set a rate."""
    from strata.doctor.measure import QUIET_OTHERS, _cpu_jiffies, others_busy

    times: list[list[float]] = [[] for _ in cases]
    kept = tried = 0
    while kept < rounds and tried < 2 * rounds:
        tried += 1
        before, own = _cpu_jiffies(), sum(os.times()[:2])
        row = [_median(fn, repeats) for _, fn in cases]
        if others_busy(before, _cpu_jiffies(), sum(os.times()[:2]) - own) > QUIET_OTHERS and tried < 2 * rounds:
            continue
        kept += 1
        for i, t in enumerate(row):
            times[i].append(t)
    pts = sorted((float(b), float(np.median(t))) for (b, _), t in zip(cases, times))
    for i in range(1, len(pts)):  # more bytes never take less time (noise can say otherwise)
        pts[i] = (pts[i][0], max(pts[i][1], pts[i - 1][1]))
    return OpCost(tuple(pts))


def _random_matrix(rng, qtype, n_rows: int, n_cols: int):
    """A matrix of `qtype` with random codes and small scales: what a product costs does not
    depend on the values, and quantizing the probe's largest experts took seconds."""
    from strata.formats import ggml_blocks
    from strata.formats.quant_matrix import QuantMatrix
    from strata.formats.quant_types import ggml_block_name, layout, row_bytes

    lay = layout(qtype)
    if lay.whole_blocks:  # llama.cpp's blocks, scales inside: small finite ones (no subnormal's slow path)
        codes = rng.integers(0, 256, (n_rows, row_bytes(qtype, n_cols)), dtype=np.uint8)
        blocks = ggml_blocks.view_blocks(ggml_block_name(qtype), codes)
        for name in ("d", "dmin", "m"):
            if name in blocks.dtype.names:
                blocks[name] = 0.01
        if "e" in blocks.dtype.names:
            blocks["e"] = 120
        return QuantMatrix(qtype, n_rows, n_cols, codes, np.zeros((n_rows, 0), np.float16))
    codes = rng.integers(0, 256, (n_rows, n_cols // lay.block_size * (lay.block_bytes - 2)), dtype=np.uint8)
    scales = (0.01 * rng.random((n_rows, n_cols // lay.block_size))).astype(np.float16)
    return QuantMatrix(qtype, n_rows, n_cols, codes, scales)


def _expert_table(ops, qtype, rounds: int) -> OpCost:
    """Seconds per routed expert of `qtype` on the engine's products `ops` (CpuOps), by record
    bytes: EXPERT_STACK distinct experts per call through the engine's one-token call (`ops.stack`,
    else expert by expert), divided by their count."""
    from strata.formats.expert_record import ExpertWeights, RecordLayout
    from strata.formats.quant_types import layout

    rng = np.random.default_rng(0)
    cases = []
    block = layout(qtype).block_size
    for d, f in EXPERT_SIZES:
        if d % block or f % block:  # a K-quant's experts are whole super-blocks of 256
            continue
        ws = [ExpertWeights(_random_matrix(rng, qtype, f, d), _random_matrix(rng, qtype, f, d),
                            _random_matrix(rng, qtype, d, f)) for _ in range(EXPERT_STACK)]
        x = 0.01 * rng.standard_normal(d, dtype=np.float32)  # small: silu stays finite
        run = (lambda ws=ws, x=x: ops.stack(ws, x)) if ops.stack else \
            (lambda ws=ws, x=x: [ops.expert(w, x) for w in ws])
        cases.append((RecordLayout(qtype, d, f).record_bytes, run))
    table = _table(cases, repeats=3, rounds=rounds)
    return OpCost(tuple((b, t / EXPERT_STACK) for b, t in table.points))


def _compute_numpy(rounds: int = COMPUTE_ROUNDS, ops=None) -> dict:
    """The numpy engines' products as `ops` (strata.numpy_backend.quant_kernels.CpuOps; default
    the float32 reference's) compute them: "gemv" (float32 BLAS, the dense matrices held as
    float32 and the widened ones), "expert" (a Q2_0 expert, the calibration model's type), and
    on compiled products "kernel_gemv" (a dense matrix of each DENSE_KERNEL_TYPES on its kernel,
    by stored bytes) and
    "expert_kernels" (experts of every compiled type but the calibration's Q2_0 on theirs, at the
    EXPERT_SIZES that are whole blocks of the type)."""
    from strata.formats.quant_types import QuantType, layout
    from strata.numpy_backend.quant_kernels import COMPILED_TYPES, REFERENCE_OPS, gemv as kernel_gemv

    ops = ops or REFERENCE_OPS
    rng = np.random.default_rng(0)
    cases = []
    for n in GEMV_SIZES:
        w = rng.standard_normal((n, n), dtype=np.float32)
        x = rng.standard_normal(n, dtype=np.float32)
        cases.append((w.nbytes, lambda w=w, x=x: x @ w.T))
    out = {"gemv": _table(cases, rounds=rounds), "expert": _expert_table(ops, QuantType.Q2_0, rounds),
           "kernel_gemv": {}, "expert_kernels": {}}
    if not ops.compiled:
        return out
    block = lambda q: layout(q).block_size  # noqa: E731
    for qtype in map(QuantType.__getitem__, DENSE_KERNEL_TYPES):
        cases = []
        for n in (n for n in GEMV_SIZES if n % block(qtype) == 0):  # whole blocks (Q6_K: 256)
            m = _random_matrix(rng, qtype, n, n)
            x = rng.standard_normal(n, dtype=np.float32)
            cases.append((m.nbytes, lambda m=m, x=x: kernel_gemv(m, x, threads=ops.threads)))
        if cases:
            out["kernel_gemv"][qtype.name] = _table(cases, rounds=rounds)
    out["expert_kernels"] = {q.name: _expert_table(ops, q, rounds) for q in sorted(COMPILED_TYPES, key=int)
                             if q is not QuantType.Q2_0 and any(d % block(q) == 0 and f % block(q) == 0
                                                                for d, f in EXPERT_SIZES)}
    return out


WIDEN_SIZES = (64, 256, 1024, 2048)  # square matrices, widened from their stored type to float32


def _widen_numpy(rounds: int = COMPUTE_ROUNDS) -> dict[str, OpCost]:
    """Seconds per widening of a stored F16 / Q8_0 matrix, by its stored bytes (numpy)."""
    import gguf

    from strata.formats.dense_weights import StoredTensor, StoredType

    rng = np.random.default_rng(1)
    out = {}
    for stored in (StoredType.F16, StoredType.Q8_0):
        cases = []
        for n in WIDEN_SIZES:
            x = rng.standard_normal((n, n), dtype=np.float32)
            raw = gguf.quants.quantize(x, gguf.GGMLQuantizationType(stored.value))
            t = StoredTensor.from_gguf(stored, raw.view(np.uint8), (n, n))
            cases.append((t.nbytes, t.widen))
        out[stored.name] = _table(cases, rounds=rounds)
    return out


GRAPH_CALLS = 16  # GEMVs evaluated together: the in-graph cost of a call, not a round trip each
SYNC_REPEATS = 50


def _compute_mlx(rounds: int = COMPUTE_ROUNDS) -> tuple[OpCost, OpCost, float]:
    """MLX: (gemv, expert, sync_s). A float32 GEMV's cost inside a graph, (t(16 GEMVs in one
    evaluation) - t(1)) / 15, as the engines evaluate a token's (or a layer's) launches
    together: evaluating each alone timed the host round trip (25-45 us a call on the H200,
    where a compiled step's launch costs ~5-18 us); an expert costs three such calls reading its
    record bytes (the Q2_0 kernels are bandwidth-bound); sync_s is one round trip (a trivial
    evaluation), which a decoded token pays once for its logits."""
    import mlx.core as mx

    one, many = [], []
    for n in GEMV_SIZES:
        w = mx.random.normal((n, n))
        xs = [mx.random.normal((n,)) for _ in range(GRAPH_CALLS)]
        mx.eval(w, *xs)
        one.append((n * n * 4, lambda w=w, x=xs[0]: mx.eval(w @ x)))
        many.append((n * n * 4, lambda w=w, xs=xs: mx.eval([w @ x for x in xs])))
    t1, tn = _table(one, rounds=rounds), _table(many, rounds=rounds)
    pts, last = [], 1e-7  # a call never costs nothing, and more bytes never less (noise can say otherwise)
    for (b, t), (_, t0) in zip(tn.points, t1.points):
        last = max(last, (t - t0) / (GRAPH_CALLS - 1))
        pts.append((b, last))
    gemv = OpCost(tuple(pts))
    a = mx.array(1.0)
    mx.eval(a)
    sync = _median(lambda: mx.eval(a + 1), SYNC_REPEATS)
    return gemv, OpCost(tuple((b, 3 * gemv.each(b / 3)) for b, _ in gemv.points)), sync


# ---------------------------------------------------------------- the engine


def _engine(backend: str, progress, quick: bool = False, timeout: float = 600, rounds: int = POOL_ROUNDS,
            float32: bool = False, threads: int = 0) -> dict:
    """The probe's engine runs (probe_engine.py): fresh processes, or (quick) a pool of warmed ones
    measured in up to `rounds` rounds (`float32`: with the compiled CPU kernels off; `threads`:
    the compiled kernels' count, 0 for each engine's own choice at its open)."""
    from strata.doctor.probe_engine import engine_cases, run_fresh, run_pooled

    with tempfile.TemporaryDirectory() as d:
        eng = engine_cases(Path(d), quick=quick)
        if float32:
            eng = dataclasses.replace(eng, cases=tuple((key, path, {**o, "cpu_kernels": False}, group)
                                                       for key, path, o, group in eng.cases))
        elif threads:
            eng = dataclasses.replace(eng, cases=tuple((key, path, {**o, "threads": threads}, group)
                                                       for key, path, o, group in eng.cases))
        if quick:  # a fresh MLX process costs seconds on a GPU, and every case's kernels compile (pool.py)
            runs, missing = run_pooled(eng, backend, timeout, progress, rounds=rounds)
            return {"runs": runs, "eng": eng, "missing": missing}
        return {"runs": run_fresh(eng, backend, progress), "eng": eng, "missing": []}



def numpy_ops(cpu_kernels: bool = True, threads: int = 0):
    """The products a numpy engine opened now would compute with (Config.cpu_kernels; the
    compiled kernels where they build here, on `threads` threads, under 0 those strata.threads
    chooses now)."""
    from strata.numpy_backend.quant_kernels import REFERENCE_OPS, compiled_ops
    from strata.threads import kernel_threads

    return compiled_ops(kernel_threads(threads)) if cpu_kernels else REFERENCE_OPS


def products_of(backend: str, cpu_kernels: bool = True) -> str:
    """A profile's `products` for `backend` under Config.cpu_kernels = `cpu_kernels`."""
    if backend == "mlx":
        return ""
    return COMPILED if numpy_ops(cpu_kernels).compiled else FLOAT32


def measure_parts(backend: str, cache_dir: Path, *, progress=None, quick: bool = False,
                  cpu_kernels: bool = True, threads: int = 0) -> dict:
    """What the probe measures outside strata's engine: disk, compute, memory (module docstring),
    on the products a run under Config.cpu_kernels = `cpu_kernels` computes with (the compiled
    kernels on `threads` threads, under 0 strata.threads's choice now)."""
    say = progress or (lambda _msg: None)
    say("disk")
    lat, bw, direct = _disk(cache_dir)
    say("compute")
    rounds = QUICK_COMPUTE_ROUNDS if quick else COMPUTE_ROUNDS
    ops = None if backend == "mlx" else numpy_ops(cpu_kernels, threads)
    if backend == "mlx":
        gemv, expert, sync = _compute_mlx(rounds)
        kernels = {"kernel_gemv": {}, "expert_kernels": {}}
    else:
        kernels = _compute_numpy(rounds, ops)
        gemv, expert, sync = kernels.pop("gemv"), kernels.pop("expert"), 0.0
    say("memory")
    mem = device_bandwidth(gemv) if backend == "mlx" else _mem_bw()
    gpu = False
    if backend == "mlx":
        from strata.engines import mlx_gpu_available

        gpu = mlx_gpu_available()
    return {"disk_latency_s": lat, "disk_bytes_per_s": bw, "disk_direct": direct, "gemv": gemv, "expert": expert,
            "sync_s": sync, "mem_bytes_per_s": mem, "widen": {} if backend == "mlx" else _widen_numpy(rounds),
            "gpu": gpu, "products": "" if ops is None else (COMPILED if ops.compiled else FLOAT32),
            "kernel_threads": ops.threads if ops is not None and ops.compiled else 0, **kernels}


def profile_from_runs(backend: str, parts: dict, eng, runs: dict, *, quick: bool = False,
                      missing: tuple = ()) -> MachineProfile:
    """The profile from `measure_parts` and the engine runs of `eng` (probe_engine.EngineCases)."""
    costs = fit_engine(runs, cfg=eng.cfg, slot_bytes=eng.slot, record_bytes=eng.record, gemv=parts["gemv"],
                       expert=parts["expert"], widen=parts["widen"], kernel_gemv=parts["kernel_gemv"],
                       expert_kernels=parts["expert_kernels"], sync_s=parts["sync_s"], backend=backend,
                       gpu=parts["gpu"], fallback_miss_s=parts["disk_latency_s"] + eng.slot / parts["disk_bytes_per_s"])
    notes: list[str] = []
    if not parts["disk_direct"]:
        notes.append("disk probe read buffered (no O_DIRECT on the cache dir's filesystem)")
    if quick:
        notes.insert(0, f"{QUICK_NOTE}: engine cases measured over warmed processes, interleaved rounds")
    if missing:
        notes.append(f"not finished within the probe's time, left out of the fit: {', '.join(missing)}")
    return MachineProfile(
        backend=backend, machine=_machine_id(), calibration_record_bytes=eng.record, calibration_slot_bytes=eng.slot,
        load_avg=os.getloadavg()[0], measured_at=time.time(), notes=tuple(notes),
        calibration={run_name(k): r.to_dict() for k, r in runs.items()}, **parts, **dataclasses.asdict(costs))


def measure_machine(backend: str, cache_dir: Path, *, progress=None, quick: bool = False,
                    timeout: float = 600, rounds: int = POOL_ROUNDS, cpu_kernels: bool = True,
                    threads: int = 0) -> MachineProfile:
    """Measure this machine now (module docstring; `quick`: the quick probe, its engine runs over
    a pool of warmed processes in up to `rounds` rounds within `timeout` seconds; `cpu_kernels`:
    Config.cpu_kernels of the runs it answers for; `threads`: the compiled kernels' count they
    compute with, under 0 strata.threads's choice now, every product and engine run on it)."""
    parts = measure_parts(backend, Path(cache_dir), progress=progress, quick=quick, cpu_kernels=cpu_kernels,
                          threads=threads)
    eng = _engine(backend, progress or (lambda _msg: None), quick, timeout, rounds,
                  float32=parts["products"] == FLOAT32, threads=parts["kernel_threads"])
    return profile_from_runs(backend, parts, eng["eng"], eng["runs"], quick=quick, missing=tuple(eng["missing"]))


def save_profile(prof: MachineProfile, cache_dir: Path, *, quick: bool = False) -> Path:
    """Cache `prof` where `machine_profile` reads it."""
    path = _profile_path(prof.backend, cache_dir, quick, prof.products, prof.kernel_threads)
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_text(json.dumps(prof.to_dict(), indent=1) + "\n")
    return path
