"""FastCache.step per event type, in isolation: the cache's share of the host turn.

    python benchmarks/cache_step.py [--tokens 64] [--layers 16] [--experts 256] [--top-k 10]
                                    [--prefetch 16] [--arena-fraction 0.25] [--repeat 15]
                                    [--source synthetic|engine] [--pollute MB]
                                    [--baseline REV]   # also time fast_cache.py as of git REV (A/B)

Records one event stream, then replays it through a fresh FastCache per repeat, timing every
call. Each candidate's repeats are interleaved with the others' (same machine load), and per
event type the minimum over repeats of the summed time is kept (a shared, busy machine only ever
adds time). Per-call times come from `time.perf_counter_ns` minus the timer's own cost; the
whole replay is also timed in thread CPU time (`time.thread_time`, the pollution sweeps
included), which preemption doesn't inflate. The candidates must return identical actions
(checked on the first repeat). Prints a table, then one JSON line.

Sources: `synthetic` (default) is a synthetic routing trace (strata/testing/traces.py) in the
streamer's order (completions fed back, AtLayer, AfterLayer; read-aheads complete before the
next turn). `engine` records what a StreamingEngine's streamer feeds its cache in
benchmarks/host_turn.py's setup (numpy compute, reads completing as queued: `--io null`), the
prompt included; its prompt-mode AtLayer/AfterLayer calls get rows of their own.

`--pollute MB`: between events (outside the timed calls) sweep a numpy buffer of MB megabytes,
as a layer's compute does in the engine, so each step starts with cold CPU caches.
"""

from __future__ import annotations

import argparse
import importlib.util
import json
import subprocess
import sys
import tempfile
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))

import numpy as np  # noqa: E402

from strata.cache.types import AfterLayer, AtLayer, BeginWindow, CacheConfig, Read  # noqa: E402
from strata.cache.fast import FastCache  # noqa: E402
from strata.testing.traces import synthetic_routing_trace  # noqa: E402

KINDS = ("BeginWindow", "HoldRegion", "read_done_many", "AtLayer", "AfterLayer", "AtLayer prompt",
         "AfterLayer prompt")


def load_baseline(rev: str):
    """FastCache as of git `rev` (a module loaded from `git show`), for an A/B in one process."""
    src = subprocess.run(["git", "show", f"{rev}:strata/cache/fast.py"], cwd=ROOT, check=True,
                         capture_output=True, text=True).stdout
    path = Path(tempfile.mkdtemp()) / "fast_cache_baseline.py"
    path.write_text(src)
    spec = importlib.util.spec_from_file_location("fast_cache_baseline", path)
    mod = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(mod)
    return mod.FastCache


def record(config: CacheConfig, selected, guesses) -> list:
    """The event stream [(kind, payload)], built by stepping a FastCache as the streamer does."""
    cache = FastCache(config)
    events, pending = [], []
    for t in range(len(selected)):
        events.append(("BeginWindow", BeginWindow()))
        cache.step(BeginWindow())
        for layer in range(len(selected[t])):
            events.append(("read_done_many", pending))
            cache.read_done_many(pending)
            ev = AtLayer(layer, tuple(selected[t][layer]))
            events.append(("AtLayer", ev))
            cache.step(ev)
            ev = AfterLayer(layer, tuple(guesses[t][layer]), ())
            events.append(("AfterLayer", ev))
            pending = [(a.slot, a.ticket) for a in cache.step(ev) if isinstance(a, Read)]
    return events


def record_engine(a) -> tuple[CacheConfig, list]:
    """The event stream of a StreamingEngine run (host_turn.py's engine, `--io null`)."""
    sys.path.insert(0, str(ROOT / "benchmarks"))
    import numpy as np

    import host_turn

    args = host_turn.parse_args(["--layers", str(a.layers), "--experts", str(a.experts), "--top-k", str(a.top_k),
                                 "--prefetch", str(a.prefetch), "--arena-fraction", str(a.arena_fraction),
                                 "--io", "null"])
    path = host_turn.make_experts_file(args)
    try:
        eng, xf = host_turn.make_engine(args, "numpy", path)
        cache, events = eng.streamer.cache, []
        step, rdm = cache.step, cache.read_done_many

        def rec_step(ev):
            name = type(ev).__name__
            if cache._prompt and name in ("AtLayer", "AfterLayer"):
                name += " prompt"
            events.append((name, ev))
            return step(ev)

        def rec_rdm(notices):
            notices = list(notices)
            events.append(("read_done_many", notices))
            return rdm(notices)

        cache.step, cache.read_done_many = rec_step, rec_rdm
        try:
            rng = np.random.default_rng(0)
            eng.prefill([int(t) for t in rng.integers(0, 256, 8)])
            for _ in range(a.tokens):
                eng.decode(int(rng.integers(0, 256)))
        finally:
            eng.close()
            xf.close()
        return cache.config, events
    finally:
        path.unlink(missing_ok=True)


def replay_timed(cls, config: CacheConfig, events: list, keep: bool, pollute=None):
    """One replay: ({kind: summed ns}, thread CPU s, the actions if `keep`)."""
    cache = cls(config)
    sweep = (lambda: pollute.__iadd__(1)) if pollute is not None else (lambda: None)
    step, rdm = cache.step, cache.read_done_many
    clock = time.perf_counter_ns
    sums = dict.fromkeys(KINDS, 0)
    out = [] if keep else None
    c0 = time.thread_time()
    for kind, ev in events:
        sweep()
        if kind == "read_done_many":
            t = clock()
            rdm(ev)
            sums[kind] += clock() - t
            continue
        t = clock()
        actions = step(ev)
        sums[kind] += clock() - t
        if keep:
            out.append(actions)
    return sums, time.thread_time() - c0, out


def timer_cost_ns() -> float:
    clock = time.perf_counter_ns
    best = float("inf")
    for _ in range(20):
        t0 = clock()
        for _ in range(10_000):
            t = clock()
            _ = clock() - t
        best = min(best, (clock() - t0) / 10_000)
    return best


def main(argv=None) -> int:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--tokens", type=int, default=64)
    p.add_argument("--layers", type=int, default=16)
    p.add_argument("--experts", type=int, default=256)
    p.add_argument("--top-k", type=int, default=10)
    p.add_argument("--prefetch", type=int, default=16)
    p.add_argument("--arena-fraction", type=float, default=0.25)
    p.add_argument("--repeat", type=int, default=15)
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--pollute", type=float, default=0.0, help="MB of memory swept between events")
    p.add_argument("--source", choices=("synthetic", "engine"), default="synthetic")
    p.add_argument("--baseline", default=None, help="git revision of fast_cache.py to time beside the tree's")
    a = p.parse_args(argv)

    if a.source == "engine":
        cfg, events = record_engine(a)
    else:
        trace = synthetic_routing_trace(a.tokens, a.layers, a.experts, a.top_k, a.prefetch, seed=a.seed)
        cap = int(a.arena_fraction * a.layers * a.experts)
        cfg = CacheConfig(capacity=cap, n_layers=a.layers, n_experts=a.experts, top_k=a.top_k,
                          prefetch_depth=a.prefetch)
        cfg = CacheConfig(capacity=max(cap, cfg.min_capacity), n_layers=a.layers, n_experts=a.experts,
                          top_k=a.top_k, prefetch_depth=a.prefetch)
        events = record(cfg, trace.selected.tolist(), trace.guesses.tolist())
    kinds = [k for k in KINDS if any(kind == k for kind, _ in events)]
    counts = {k: sum(1 for kind, _ in events if kind == k) for k in kinds}
    probe = FastCache(cfg)
    for kind, ev in events:
        probe.read_done_many(ev) if kind == "read_done_many" else probe.step(ev)
    tot = probe.totals
    hit_rate = (tot.hits + tot.readahead_hits) / max(tot.lookups, 1)
    print(f"{a.source}: {a.tokens} tokens x {a.layers} layers, {a.experts} experts, top-{a.top_k}, K={a.prefetch}, "
          f"arena {cfg.capacity} slots; hit rate {hit_rate:.3f} (ra hits {tot.readahead_hits / max(tot.lookups, 1):.3f}), "
          f"urgent/turn {tot.urgent_misses / tot.decode_turns:.2f}, reads ahead/turn {tot.reads_ahead / tot.decode_turns:.2f}")

    cands = {"tree": FastCache}
    if a.baseline:
        cands = {f"base {a.baseline}": load_baseline(a.baseline), "tree": FastCache}
    overhead = timer_cost_ns()
    pollute = np.zeros(int(a.pollute * 2**20) // 8) if a.pollute > 0 else None
    best = {name: dict.fromkeys(kinds, float("inf")) for name in cands}
    best_cpu = dict.fromkeys(cands, float("inf"))
    first = {}
    for r in range(a.repeat):
        for name, cls in cands.items():
            sums, cpu, out = replay_timed(cls, cfg, events, keep=(r == 0), pollute=pollute)
            if r == 0:
                first[name] = out
            for k in kinds:
                best[name][k] = min(best[name][k], sums[k] - overhead * counts[k])
            best_cpu[name] = min(best_cpu[name], cpu)
    names = list(cands)
    for name in names[1:]:
        if first[name] != first[names[0]]:
            sys.exit(f"{name}: actions differ from {names[0]}'s")

    per = {name: {k: best[name][k] / counts[k] / 1e3 for k in kinds} for name in names}
    print(f"timer cost {overhead:.0f} ns (subtracted); us per call, min over {a.repeat} repeats; "
          f"{a.pollute:g} MB swept between events")
    print(f"{'event':>17} | {'calls':>6} | " + " | ".join(f"{n:>14}" for n in names)
          + (" | ratio" if len(names) > 1 else ""))
    for k in kinds:
        row = f"{k:>17} | {counts[k]:>6} | " + " | ".join(f"{per[n][k]:>14.2f}" for n in names)
        if len(names) > 1:
            row += f" | {per[names[0]][k] / max(per[names[-1]][k], 1e-9):.2f}x"
        print(row)
    turns = counts["AtLayer"] + counts.get("AtLayer prompt", 0)
    row = f"{'cpu us/turn':>17} | {turns:>6} | " + " | ".join(f"{1e6 * best_cpu[n] / turns:>14.2f}" for n in names)
    if len(names) > 1:
        row += f" | {best_cpu[names[0]] / best_cpu[names[-1]]:.2f}x"
    print(row)
    print(json.dumps(dict(benchmark="cache_step", source=a.source, pollute_mb=a.pollute, tokens=a.tokens, layers=a.layers, experts=a.experts,
                          top_k=a.top_k, prefetch=a.prefetch, capacity=cfg.capacity, hit_rate=round(hit_rate, 4),
                          us_per_call={n: {k: round(v, 2) for k, v in per[n].items()} for n in names},
                          cpu_us_per_turn={n: round(1e6 * best_cpu[n] / turns, 2) for n in names})))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
