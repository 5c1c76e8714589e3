"""The expert-cache state machine's speed and its read-ahead effect (docs/cache.md).

    python benchmarks/cache.py [--tokens 1000] [--layers 48] [--experts 256] [--top-k 10]
                               [--capacity 5385] [--seed 0]

Replays a synthetic routing trace (strata/testing/traces.py: Zipf popularity, token locality,
noisy next-layer guesses with the reference engine's recall) through `strata.cache.machine.step`, one
decode window per token, under three read-ahead settings: none, K = 10 with the old LRU touch
(the reference engine's stock), K = 16 without it (the reference engine's recommendation). Target: the K = 16 replay of
1,000 tokens x 48 layers in under 20 s on one core (CPU time of this single-threaded process,
so a busy shared machine doesn't distort it; wall time is printed too). Each setting is then
replayed again through the runtime's fast twin (`strata.cache.fast.FastCache`, the
"fast" rows), which must end with the same counts. Prints a table, then one JSON line.
"""

from __future__ import annotations

import argparse
import json
import sys
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from strata.cache.replay import replay  # noqa: E402
from strata.cache.types import AfterLayer, AtLayer, BeginWindow, CacheConfig, CacheStats, Read  # noqa: E402
from strata.cache.fast import FastCache  # noqa: E402
from strata.testing.traces import recall_at, synthetic_routing_trace  # noqa: E402

TARGET_SECONDS = 20.0  # for the K = 16 run at the default shape
SETTINGS = (("none", 0, False), ("K10 touch", 10, True), ("K16 no-touch", 16, False))
SEED_URGENT = {"none": 19.65, "K10 touch": 9.82, "K16 no-touch": 6.99}  # the reference engine, real trace, MoCE on


def replay_fast(config: CacheConfig, selected, guesses) -> CacheStats:
    """`strata.cache.replay.replay` (read-aheads land before the next turn) through
    FastCache; returns the totals."""
    cache = FastCache(config)
    sel, gs = selected.tolist(), guesses[..., :config.prefetch_depth].tolist()
    pending: list = []
    for t in range(len(sel)):
        cache.step(BeginWindow())
        for layer in range(len(sel[t])):
            cache.read_done_many(pending)
            cache.step(AtLayer(layer, sel[t][layer]))
            actions = cache.step(AfterLayer(layer, gs[t][layer], ()))
            pending = [(a.slot, a.ticket) for a in actions if isinstance(a, Read)]
    return cache.totals


def main(argv=None) -> int:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--tokens", type=int, default=1000)
    p.add_argument("--layers", type=int, default=48)
    p.add_argument("--experts", type=int, default=256)
    p.add_argument("--top-k", type=int, default=10)
    p.add_argument("--capacity", type=int, default=5385)  # the reference engine's 7.5 GB arena
    p.add_argument("--seed", type=int, default=0)
    a = p.parse_args(argv)

    t0 = time.perf_counter()
    trace = synthetic_routing_trace(a.tokens, a.layers, a.experts, a.top_k, 16, seed=a.seed)
    print(f"trace: {a.tokens} tokens x {a.layers} layers, {a.experts} experts, top-{a.top_k}, "
          f"{time.perf_counter() - t0:.1f} s to build; read-ahead recall {recall_at(trace, 10):.3f} @10, "
          f"{recall_at(trace, 16):.3f} @16 (seed: 0.678, 0.821)")
    print(f"arena {a.capacity} slots of {a.layers * a.experts} (layer, expert) keys\n")

    turns = a.tokens * a.layers
    header = ("setting", "cpu s", "wall s", "us/turn", "urgent/tok", "ra hits/tok", "reads/tok", "cancels/tok",
              "hit rate", "seed urgent/tok")
    print(" | ".join(f"{h:>12}" for h in header))
    rows = {}
    runs = [(name, k, touch, fast) for name, k, touch in SETTINGS for fast in (False, True)]
    for name, k, touch, fast in runs:
        cfg = CacheConfig(capacity=a.capacity, n_layers=a.layers, n_experts=a.experts, top_k=a.top_k,
                          prefetch_depth=k, prefetch_touch=touch)
        t0, c0 = time.perf_counter(), time.process_time()
        if fast:
            totals = replay_fast(cfg, trace.selected, trace.guesses)
            if totals != rows[name]["totals"]:
                sys.exit(f"{name}: the fast twin's counts differ from the reference's")
            name = f"{name} fast"
        else:
            totals = replay(cfg, trace.selected, trace.guesses).totals
        wall, seconds = time.perf_counter() - t0, time.process_time() - c0
        per = lambda n: n / a.tokens  # noqa: E731
        rows[name] = dict(totals=totals, K=k, touch=touch, seconds=round(seconds, 2), wall_seconds=round(wall, 2),
                          us_per_turn=round(1e6 * seconds / turns, 1),
                          urgent_per_token=round(per(totals.urgent_misses), 2),
                          readahead_hits_per_token=round(per(totals.readahead_hits), 2),
                          reads_per_token=round(per(totals.reads_issued), 2),
                          cancels_per_token=round(per(totals.reads_cancelled), 2),
                          hit_rate=round((totals.hits + totals.readahead_hits) / totals.lookups, 4),
                          urgent_by_rank_per_token=[round(per(n), 2) for n in totals.urgent_misses_by_rank])
        r = rows[name]
        cells = (name, r["seconds"], r["wall_seconds"], r["us_per_turn"], r["urgent_per_token"],
                 r["readahead_hits_per_token"], r["reads_per_token"], r["cancels_per_token"], r["hit_rate"], SEED_URGENT[name.removesuffix(" fast")])
        print(" | ".join(f"{c:>12}" for c in cells))
    for r in rows.values():
        del r["totals"]
    print("\nurgent misses by selected rank per token:")
    for name, _, _ in SETTINGS:
        print(f"  {name:>12}: " + " ".join(f"{x:.1f}" for x in rows[name]["urgent_by_rank_per_token"]))
    print("\nfast twin (same decisions, same counts): " + "; ".join(
        f"{name} {rows[name]['us_per_turn']} -> {rows[name + ' fast']['us_per_turn']} us/turn "
        f"({rows[name]['seconds'] / max(rows[name + ' fast']['seconds'], 1e-9):.1f}x)" for name, _, _ in SETTINGS))
    k16 = rows["K16 no-touch"]["seconds"]
    ok = k16 < TARGET_SECONDS
    print(f"\nK16 replay {k16:.1f} CPU s ({'under' if ok else 'OVER'} the {TARGET_SECONDS:.0f} s target; CPU "
          f"time because the machine may be shared, wall time beside it); a turn = AtLayer + AfterLayer "
          f"+ the read-aheads' ReadDone notices; us/turn from CPU time")
    print(json.dumps(dict(benchmark="cache", tokens=a.tokens, layers=a.layers, experts=a.experts, k=a.top_k,
                          capacity=a.capacity, seed=a.seed, target_seconds=TARGET_SECONDS, runs=rows)))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
