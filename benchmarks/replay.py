"""The analysis kit's benchmark and experiment driver.

    python benchmarks/replay.py speed [--tokens 1000] [--layers 48] [--experts 256] [--top-k 10]
    python benchmarks/replay.py experiments [--model M.gguf --text FILE] [--out DIR]

`speed` (the issue's target: >= 1,000 tokens x 48 layers x 256 experts replayed per minute on
one core): a synthetic trace of the reference engine's shape, replayed closed loop under the stock policy
(J3 λ0.85 K10) at the reference engine's 7.5 GB point (5385 of 12288 slots); also the cache machine alone
(open loop over the same selections) to give the per-step cost. Prints a table and one JSON line.

`experiments`: the reference engine's §1 experiments redone (docs/replay.md): trace, router spread, capacity
sweep with read-ahead variants (the reference engine's K and K scaled to the model's top-k) and Belady,
recall one and two layers ahead, the J × λ policy table with drop-tail. With --model it runs on
that model with its own routers, unchanged (the trained default model: strata/data/default.gguf);
without, it builds a made model (testing's "demo" shape with 16 layers, 128 experts, top-8)
whose router logits are rescaled to the reference engine's spread (SEED_MEDIAN_GAP): only the made model is
ever rescaled. Text longer than the model's context is traced in consecutive windows (each
from an empty KV cache; the simulated arena carries over, as it does across requests).
Writes tables (Markdown), JSON and PNGs to DIR.
"""

from __future__ import annotations

import argparse
import json
import os
import sys
import time
from pathlib import Path

import numpy as np

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))

from strata.tools.experiments import SEED_TOKENS  # noqa: E402

SEED_SHAPE = dict(tokens=1000, layers=48, experts=256, top_k=10)
SEED_CAPACITY = 5385  # the reference engine's 7.5 GB arena, of 48 x 256 = 12288 experts
TARGET_PER_MINUTE = 1000 * 48 * 256  # token x layer x expert replayed per minute


# ---------------------------------------------------------------- speed


def synthetic_trace(tokens: int, layers: int, experts: int, top_k: int, dim: int = 256, seed: int = 0):
    """A trace with the structure that matters to a cache: skewed expert popularity (a shared
    direction every router row reads with its own weight), token-to-token locality (router
    inputs drift as an AR(1) process) and layer-to-layer similarity (so W(l+1)·h(l) is a
    useful guess). Logits and selections come from the reference routing."""
    from strata.model_config import RoutingOrder
    from strata.reference.routing import RouterRule, route
    from strata.tools.closed_loop import GuessRouters
    from strata.tools.trace import Trace

    rng = np.random.default_rng(seed)
    common = rng.standard_normal(dim).astype(np.float32)
    common /= np.linalg.norm(common)
    pop = rng.standard_normal((layers, experts, 1)) * 2.0
    routers = (rng.standard_normal((layers, experts, dim)) / np.sqrt(dim) + pop * common).astype(np.float32)
    h = np.empty((tokens, layers, dim), np.float32)
    ctx = rng.standard_normal(dim).astype(np.float32)
    for t in range(tokens):
        ctx = 0.9 * ctx + np.sqrt(1 - 0.81) * rng.standard_normal(dim).astype(np.float32)
        x = ctx.copy()
        for layer in range(layers):
            x = 0.8 * x + 0.6 * rng.standard_normal(dim).astype(np.float32)
            h[t, layer] = x + common
    f32 = GuessRouters(routers, pred_q8=False)
    logits = np.array([[f32.logits(l, h[t, l]) for l in range(layers)] for t in range(tokens)], np.float32)
    rule = RouterRule(top_k, RoutingOrder.SOFTMAX_TOPK)
    sels = [[route(logits[t, l], rule) for l in range(layers)] for t in range(tokens)]
    return Trace(np.arange(tokens, dtype=np.int64), h, routers, logits,
                 np.array([[s.experts for s in row] for row in sels], np.int64),
                 np.array([[s.weights for s in row] for row in sels], np.float32), rule)


def speed(args) -> dict:
    from strata.cache.replay import replay as open_loop
    from strata.tools.closed_loop import LoopConfig
    from strata.tools.replay import ReplayInputs, replay

    try:
        os.sched_setaffinity(0, {min(os.sched_getaffinity(0))})  # one core
    except (AttributeError, OSError):
        pass
    T, L, E, k = args.tokens, args.layers, args.experts, args.top_k
    cap = args.capacity or round(SEED_CAPACITY / 12288 * L * E)
    t0 = time.perf_counter()
    trace = synthetic_trace(T, L, E, k, dim=args.dim)
    build_s = time.perf_counter() - t0
    inputs = ReplayInputs(trace)
    t0 = time.perf_counter()
    g1 = inputs.guess_logits(1, True)
    guess_s = time.perf_counter() - t0
    rows = []
    for name, config in (("stock J3 λ0.85 K10", LoopConfig(capacity=cap)),
                         ("K16", LoopConfig(capacity=cap, prefetch_depth=16)),
                         ("λ0 no prefetch", LoopConfig(capacity=cap, prefetch_depth=0, policy=None))):
        t0 = time.perf_counter()
        r = replay(inputs, config)
        s = time.perf_counter() - t0
        rows.append(dict(name=name, seconds=s, turns=T * L, us_per_turn=s / (T * L) * 1e6,
                         per_minute=T * L * E * 60.0 / s, urgent_per_token=r.urgent_per_token))
    # the machine alone: the same decisions as 'stock' at λ = 0, open loop (2 steps per turn + ReadDones)
    guesses = np.zeros((T, L, 10), np.int64)
    guesses[:, :-1] = np.argsort(-g1, axis=-1, kind="stable")[..., :10]
    config = LoopConfig(capacity=cap, policy=None).cache_config(L, E, k)
    t0 = time.perf_counter()
    st = open_loop(config, trace.selected, guesses)
    machine_s = time.perf_counter() - t0
    n_steps = T + 2 * T * L + st.totals.reads_ahead  # BeginWindow, AtLayer + AfterLayer, ReadDone
    out = dict(
        bench="replay", tokens=T, layers=L, experts=E, top_k=k, capacity=cap, dim=args.dim,
        trace_build_s=build_s, guess_logits_s=guess_s, runs=rows, machine_s=machine_s,
        machine_steps=n_steps, machine_us_per_step=machine_s / n_steps * 1e6,
        machine_us_per_turn=machine_s / (T * L) * 1e6,
        target_per_minute=TARGET_PER_MINUTE,
        meets_target=all(r["per_minute"] >= TARGET_PER_MINUTE for r in rows),
    )
    print(f"closed-loop replay, {T} tokens x {L} layers x {E} experts, top-{k}, {cap} slots, one core")
    print(f"  trace built in {build_s:.1f} s; read-ahead guess logits (one [1,{args.dim}] GEMV per turn) "
          f"{guess_s:.1f} s, shared by every run")
    print(f"  {'run':<22}{'s':>8}{'µs/turn':>10}{'tok·layer·expert/min':>24}{'urgent/tok':>12}")
    for r in rows:
        print(f"  {r['name']:<22}{r['seconds']:8.1f}{r['us_per_turn']:10.0f}{r['per_minute']:24,.0f}"
              f"{r['urgent_per_token']:12.2f}")
    print(f"  cache machine alone: {out['machine_us_per_step']:.1f} µs/step, {out['machine_us_per_turn']:.0f} µs/turn")
    print(f"  target {TARGET_PER_MINUTE:,}/min: {'met' if out['meets_target'] else 'NOT met'}")
    print(json.dumps(out))
    return out


# ---------------------------------------------------------------- experiments


def default_text() -> str:
    """A fixed English text from the repository (README and docs), so reruns are comparable."""
    parts = [ROOT / "README.md"] + sorted((ROOT / "docs").glob("*.md"))
    return "\n\n".join(p.read_text(encoding="utf-8", errors="replace") for p in parts if p.exists())


def main(argv=None) -> int:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    sub = p.add_subparsers(dest="mode")
    s = sub.add_parser("speed", help="replay speed on one core (default)")
    s.add_argument("--tokens", type=int, default=SEED_SHAPE["tokens"])
    s.add_argument("--layers", type=int, default=SEED_SHAPE["layers"])
    s.add_argument("--experts", type=int, default=SEED_SHAPE["experts"])
    s.add_argument("--top-k", type=int, default=SEED_SHAPE["top_k"])
    s.add_argument("--dim", type=int, default=256, help="router input size of the synthetic trace")
    s.add_argument("--capacity", type=int, default=0, help="slots (default: the reference engine's 7.5 GB fraction)")
    e = sub.add_parser("experiments", help="the reference engine's §1 experiments (docs/replay.md)")
    e.add_argument("--model", help="model .gguf (default: build the calibrated made model in OUT/made)")
    e.add_argument("--text", help="text file (default: the repository's README and docs)")
    e.add_argument("--out", default="replay_experiments", help="output directory")
    e.add_argument("--tokens", type=int, default=SEED_TOKENS,
                   help="tokens traced and replayed (default the reference engine's 1,022; 0: the whole text)")
    e.add_argument("--window", type=int, default=0,
                   help="trace longer texts in windows of this many tokens (default and most: the model's context)")
    e.add_argument("--quality-tokens", type=int, default=256,
                   help="tokens scored for the J x λ table (seed: 256; at most one window)")
    e.add_argument("--caps", help="capacities in slots, comma-separated (default: the reference engine's points, scaled so the "
                                  "middle one has the reference engine's λ = 0 LRU hit rate)")
    args = p.parse_args(argv)
    if args.mode == "experiments":
        from strata.tools.experiments import run_experiments

        text = Path(args.text).read_text(encoding="utf-8", errors="replace") if args.text else default_text()
        run_experiments(args.out, text, model=args.model, tokens=args.tokens, window=args.window,
                        quality_tokens=args.quality_tokens, caps=args.caps)
    else:
        if args.mode is None:
            args = p.parse_args(["speed"] + list(argv or []))
        speed(args)
    return 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
