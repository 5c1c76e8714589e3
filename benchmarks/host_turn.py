"""The streaming decode's per-layer host turn on this CPU, broken into phases (issue target:
"host turn (non-wait part) under 50 µs per layer"; benchmarks/decode.py `streaming` measures the
same quantity on the GPU).

    python benchmarks/host_turn.py [--backend numpy,mlx] [--layers 12] [--tokens 48] [--repeat 3]
                                   [--prefetch 16] [--arena-fraction 0.25] [--cprofile]
                                   [--root PATH]   # time another checkout's strata (A/B)

Shape: the reference engine's routing shape (256 experts, top-10, K = 16 read-ahead without touch, an arena
of a quarter of the experts), fewer layers and a small hidden size: the host turn's work
depends on E, k, K and the arena, not on D. Experts come from a `.experts` file in /dev/shm
(one pool of E experts reused by every layer), dense weights from `strata.testing.models.make_dense`
(structured routing: Zipf popularity, context locality), so hit rates are not those of random
routing.

"host turn" is what the stream report counts: `(host_ms_per_window - waiting_ms_per_window) /
n_layers`, i.e. the streamer's `at_layer` (completions fed back, the cache step, reads
submitted, the checks at use; the shared expert placed inside the turn and the Use callback
excluded) plus the window edge (BeginWindow), less the time blocked on reads. Routing
(`route`) and the split turn's after-layer work (`after`) are outside it; both are printed.

Each repeat runs a fresh engine; the table gives the median over repeats, per layer, and a
second, probed run splits the turn into phases (the probe's own cost, ~0.3 µs per probed call,
is inside those numbers, not in the unprobed "host turn" row). Prints a table, then one JSON line.
"""

from __future__ import annotations

import argparse
import cProfile
import json
import os
import pstats
import statistics
import sys
import tempfile
import time
from collections import defaultdict
from dataclasses import replace
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]


def parse_args(argv=None):
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--backend", default="numpy,mlx", help="comma list: numpy, mlx (MlxCompute on MLX's default device)")
    ap.add_argument("--layers", type=int, default=12)
    ap.add_argument("--experts", type=int, default=256)
    ap.add_argument("--top-k", type=int, default=10)
    ap.add_argument("--hidden", type=int, default=256)
    ap.add_argument("--ffn", type=int, default=64)
    ap.add_argument("--prefetch", type=int, default=16)
    ap.add_argument("--arena-fraction", type=float, default=0.25)
    ap.add_argument("--tokens", type=int, default=48, help="decoded tokens per repeat")
    ap.add_argument("--prompt", type=int, default=8)
    ap.add_argument("--repeat", type=int, default=3)
    ap.add_argument("--io", choices=("threads", "null"), default="threads",
                    help="null: reads complete when submitted, nothing is read, no reader threads (a diagnostic: "
                         "the turn's own CPU cost without threads competing for the GIL; outputs are garbage)")
    ap.add_argument("--clock", choices=("wall", "cpu"), default="wall",
                    help="the probe's clock: cpu (this thread's CPU time) is robust to a loaded machine, but "
                         "misses time lost to other threads holding the GIL")
    ap.add_argument("--set", action="append", default=[], metavar="KEY=VALUE",
                    help="a Config field for every run (repeatable), e.g. --set io_threads=2")
    ap.add_argument("--cprofile", action="store_true", help="also print cProfile's top functions of one run")
    ap.add_argument("--root", default=str(ROOT), help="the strata checkout to import (A/B against another tree)")
    return ap.parse_args(argv)


class Probe:
    """Wraps methods and functions to add up their wall time per (context, label); the context is
    the streamer turn the call happens in (at_layer, after_layer, or the loop)."""

    def __init__(self, clock=time.perf_counter) -> None:
        self.clock = clock
        self.seconds: dict[tuple[str, str], float] = defaultdict(float)
        self.calls: dict[tuple[str, str], int] = defaultdict(int)
        self.context = "loop"

    def wrap(self, fn, label: str, *, context: str | None = None):
        clock = self.clock

        def timed(*a, **kw):
            outer = self.context
            if context is not None:
                self.context = context
            t = clock()
            try:
                return fn(*a, **kw)
            finally:
                key = (outer if context is None else context, label)
                self.seconds[key] += clock() - t
                self.calls[key] += 1
                self.context = outer
        return timed

    def attach(self, eng, decode_module) -> None:
        s, pool, cache, sel = eng.streamer, eng.streamer.pool, eng.streamer.cache, eng.selector
        s.at_layer = self.wrap(s.at_layer, "total", context="at_layer")
        s.after_layer = self.wrap(s.after_layer, "total", context="after_layer")
        s.begin_window = self.wrap(s.begin_window, "total", context="begin_window")
        s.resident_mask = self.wrap(s.resident_mask, "resident_mask")
        pool.completed = self.wrap(pool.completed, "pool.completed")
        pool.submit_many = self.wrap(pool.submit_many, "pool.submit_many")
        pool.wait = self.wrap(pool.wait, "pool.wait")
        pool.check = self.wrap(pool.check, "pool.check")
        if hasattr(pool, "check_many"):
            pool.check_many = self.wrap(pool.check_many, "pool.check")
        pool.cancel = self.wrap(pool.cancel, "pool.cancel")
        if hasattr(pool, "cancel_many"):
            pool.cancel_many = self.wrap(pool.cancel_many, "pool.cancel")
        cache.read_done_many = self.wrap(cache.read_done_many, "cache.read_done_many")
        cache.step = self.wrap(cache.step, "cache.step")
        sel.select = self.wrap(sel.select, "selector.select")
        sel.guesses = self.wrap(sel.guesses, "selector.guesses")
        eng.compute.guess_logits = self.wrap(eng.compute.guess_logits, "compute.guess_logits")
        eng.compute.router_logits = self.wrap(eng.compute.router_logits, "compute.router_logits")
        eng.compute.shared = self.wrap(eng.compute.shared, "compute.shared")
        for name in ("slots_for", "union_in_rank_order"):
            setattr(decode_module, name, self.wrap(getattr(decode_module, name), name))


def make_engine(args, backend: str, path: Path):
    from strata.config import Config
    from strata.formats.experts_file import ExpertsFile
    from strata.loader import Model
    from strata.reference.model import ModelParams
    from strata.numpy_backend.arena import NumpyArena
    from strata.numpy_backend.compute import NumpyCompute
    from strata.numpy_backend.engine import _NoResidentExperts
    from strata.runtime.decode import StreamingEngine, cache_config_for
    from strata.runtime.io import ReaderPool
    from strata.testing.models import make_dense

    cfg = shape(args)
    xf = ExpertsFile.open(path)
    model = Model(cfg, make_dense(cfg, 0), None, xf, path.with_suffix(".gguf"))
    base = Config(prefetch=args.prefetch, prefetch_touch=False).replace(**dict(kv.split("=", 1) for kv in args.set))
    slots = max(int(cfg.n_layers * cfg.n_experts * args.arena_fraction), cache_config_for(model, base, 1).min_capacity)
    config = replace(base, arena=f"{slots}slots", profile=True)
    if backend == "mlx":
        from strata.mlx_backend.arena import MlxArena
        from strata.mlx_backend.compute import MlxCompute
        from strata.mlx_backend.model import to_mlx_params

        arena = MlxArena(slots, xf.header.padded_bytes)
        compute = MlxCompute(to_mlx_params(cfg, model.dense, pred_q8=config.pred_q8), arena, xf.layout,
                             pred_q8=config.pred_q8)
    else:
        arena = NumpyArena(slots, xf.header.padded_bytes)
        compute = NumpyCompute(ModelParams(cfg, model.dense, _NoResidentExperts()), arena, xf.layout,
                               pred_q8=config.pred_q8)
    if args.io == "null":
        pool = null_pool(xf, arena)
        return StreamingEngine(model, config, arena, compute, pool), xf
    pool = ReaderPool(xf, arena, threads=config.io_threads, direct=config.direct_io, verify=False,
                      timeout=config.io_timeout, switch_interval=config.io_switch_ms / 1e3)
    return StreamingEngine(model, config, arena, compute, pool), xf


def null_pool(xf, arena):
    """A ReaderPool without threads whose reads complete, unread, as they are queued."""
    from strata.runtime import io

    class NullPool(io.ReaderPool):
        def _queue(self, jobs) -> None:
            super()._queue(jobs)
            self._heap.clear()
            for job in jobs:
                job.status = io._DONE
                self._done.append((job.req.slot, job.req.ticket))

    return NullPool(xf, arena, threads=0, direct=False, verify=False, switch_interval=0)


def shape(args):
    from strata.testing.models import SHAPES

    return replace(SHAPES["demo"], n_layers=args.layers, n_experts=args.experts, n_experts_per_token=args.top_k,
                   hidden_size=args.hidden, expert_ffn_size=args.ffn, shared_ffn_size=args.ffn)


def make_experts_file(args) -> Path:
    from strata.formats.experts_file import write_experts
    from strata.formats.quant_types import QuantType
    from strata.testing.models import make_expert

    cfg = shape(args)
    shm = Path("/dev/shm")
    base = shm if shm.is_dir() and os.access(shm, os.W_OK) else Path(tempfile.gettempdir())
    path = base / f"strata_host_turn_{os.getpid()}.experts"
    pool = [make_expert(cfg, 0, 0, e, QuantType.Q2_0) for e in range(cfg.n_experts)]
    write_experts(path, qtype=QuantType.Q2_0, n_layers=cfg.n_layers, n_experts=cfg.n_experts,
                  hidden=cfg.hidden_size, expert_ffn=cfg.expert_ffn_size, get_expert=lambda l, e: pool[e])
    return path


def run_once(args, backend: str, path: Path, *, probe: Probe | None = None, profiler=None) -> dict:
    import numpy as np

    import strata.runtime.decode as decode_module

    saved = {n: getattr(decode_module, n) for n in ("slots_for", "union_in_rank_order")}
    eng, xf = make_engine(args, backend, path)
    try:
        if probe is not None:
            probe.attach(eng, decode_module)
        rng = np.random.default_rng(0)
        eng.prefill([int(t) for t in rng.integers(0, 256, args.prompt)])
        if probe is not None:  # the prompt's calls are not decode's
            probe.seconds.clear()
            probe.calls.clear()
        phase0 = dict(eng.phase_s)
        if profiler is not None:
            profiler.enable()
        for _ in range(args.tokens):
            eng.decode(int(rng.integers(0, 256)))
        if profiler is not None:
            profiler.disable()
        r = eng.report()
        n = eng.model.cfg.n_layers
        per_layer = 1e3 / args.tokens / n  # seconds -> µs per layer
        out = {"host_turn_us": (r.host_ms_per_window - r.waiting_ms_per_window) / n * 1e3,
               "waiting_us": r.waiting_ms_per_window / n * 1e3, "after_us": r.after_ms / n * 1e3,
               "ms_per_token": r.ms_per_token, "hit_rate": r.hit_rate, "reads_per_token": r.reads_per_token,
               "urgent_per_token": r.urgent_misses_per_token, "late": r.late, "arena_slots": r.arena_slots}
        for k, v in eng.phase_s.items():
            out[f"phase_{k}_us"] = (v - phase0[k]) * 1e3 * per_layer
        return out
    finally:
        eng.close()
        xf.close()
        for k, v in saved.items():
            setattr(decode_module, k, v)


def main(argv=None) -> int:
    args = parse_args(argv)
    sys.path.insert(0, args.root)
    import numpy as np

    import strata

    backends = [b for b in args.backend.split(",") if b]
    path = make_experts_file(args)
    res: dict = {"root": str(Path(strata.__file__).resolve().parents[1]), "layers": args.layers,
                 "experts": args.experts, "top_k": args.top_k, "prefetch": args.prefetch,
                 "arena_fraction": args.arena_fraction, "io": args.io, "clock": args.clock, "tokens": args.tokens, "repeat": args.repeat,
                 "cpus": os.cpu_count(), "backends": {}}
    try:
        for backend in backends:
            runs = [run_once(args, backend, path) for _ in range(args.repeat)]
            probe = Probe(time.thread_time if args.clock == "cpu" else time.perf_counter)
            run_once(args, backend, path, probe=probe)
            per = 1e6 / args.tokens / args.layers
            med = {k: statistics.median(r[k] for r in runs) for k in runs[0]}
            low = {k: min(r[k] for r in runs) for k in runs[0]}  # the least disturbed repeat (shared machines)
            br = {f"{c}/{label}": s * per for (c, label), s in sorted(probe.seconds.items())}
            calls = {f"{c}/{label}": n / args.tokens / args.layers for (c, label), n in sorted(probe.calls.items())}
            # the report's host turn, rebuilt from the probe (its clock): at_layer less the shared
            # expert placed inside it and the waits, plus the window edge
            br["host turn from the probe"] = sum(br.get(k, 0.0) * sign for k, sign in (
                ("at_layer/total", 1), ("at_layer/compute.shared", -1), ("at_layer/pool.wait", -1),
                ("begin_window/total", 1)))
            calls["host turn from the probe"] = 1.0
            res["backends"][backend] = {"median": med, "min": low, "runs": [r["host_turn_us"] for r in runs],
                                        "probed_us_per_layer": br, "probed_calls_per_layer": calls}
            print(f"\n## {backend}: {args.layers} layers, {args.experts} experts, top-{args.top_k}, K={args.prefetch}, "
                  f"arena {med['arena_slots']:.0f} slots, io {args.io}, probe clock {args.clock}; {args.tokens} tokens x {args.repeat} repeats "
                  f"(strata from {res['root']})")
            rows = [("host turn (non-wait), median", f"{med['host_turn_us']:.1f} us",
                     "runs " + " / ".join(f"{r['host_turn_us']:.1f}" for r in runs)),
                    ("host turn (non-wait), min", f"{low['host_turn_us']:.1f} us", "the least disturbed repeat"),
                    ("  waiting, in the turn", f"{med['waiting_us']:.1f} us", ""),
                    ("route (router logits + selector)", f"{med['phase_route_us']:.1f} us", "outside the host turn"),
                    ("after (guesses + AfterLayer)", f"{med['phase_after_us']:.1f} us", "outside the host turn"),
                    ("ms/token; hit rate; reads/token", f"{med['ms_per_token']:.2f}",
                     f"{med['hit_rate']:.3f}; {med['reads_per_token']:.1f}")]
            rows += [(f"  probed {k}", f"{v:.2f} us", f"{calls[k]:.2f} calls/layer") for k, v in br.items()]
            w = max(len(r[0]) for r in rows)
            for a, b, c in rows:
                print(f"{a:<{w}}  {b:>12}  {c}")
            if args.cprofile:
                prof = cProfile.Profile()
                run_once(args, backend, path, profiler=prof)
                pstats.Stats(prof).sort_stats("tottime").print_stats(25)
    finally:
        path.unlink(missing_ok=True)
    del np
    print("JSON " + json.dumps(res, sort_keys=True))
    return 0


if __name__ == "__main__":
    sys.exit(main())
