"""The analysis kit's benchmark and experiment driver.

    python benchmarks/replay.py speed [--tokens 1000] [--layers 48] [--experts 256] [--top-k 10]
    python benchmarks/replay.py experiments [--model M.gguf --text FILE] [--out DIR]

`speed` (the issue's target: >= 1,000 tokens x 48 layers x 256 experts replayed per minute on
one core): a synthetic trace of the seed's shape, replayed closed loop under the stock policy
(J3 λ0.85 K10) at the seed's 7.5 GB point (5385 of 12288 slots); also the cache machine alone
(open loop over the same selections) to give the per-step cost. Prints a table and one JSON line.

`experiments`: the seed's §1 experiments redone (docs/replay.md): trace, router spread, capacity
sweep with read-ahead variants (the seed's K and K scaled to the model's top-k) and Belady,
recall one and two layers ahead, the J × λ policy table with drop-tail. With --model it runs on
that model with its own routers, unchanged (the trained default model: strata/data/default.gguf);
without, it builds a made model (testing's "demo" shape with 16 layers, 128 experts, top-8)
whose router logits are rescaled to the seed's spread (SEED_MEDIAN_GAP): only the made model is
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

SEED_SHAPE = dict(tokens=1000, layers=48, experts=256, top_k=10)
SEED_CAPACITY = 5385  # the seed's 7.5 GB arena, of 48 x 256 = 12288 experts
TARGET_PER_MINUTE = 1000 * 48 * 256  # token x layer x expert replayed per minute
MADE_SHAPE = dict(n_layers=16, n_experts=128, n_experts_per_token=8)  # as benchmarks/stream.py
SEED_MEDIAN_GAP = 0.35  # seed §1.1: median z1 - z3 of the real router
SEED_CAPS = (2441, 4308, 5385, 6500, 7500, 8500, 9500, 10500)  # seed §1.1 capacity points (slots of 12288)
SEED_MID = 5385  # its 7.5 GB point
SEED_LRU_HIT = 1.0 - 55.97 / 480  # λ = 0, no read-ahead, LRU at 5385 slots: 55.97 misses of 48 x 10 lookups
SEED_WARMUP_FRACTION = 128 / 1022  # the seed counted tokens 128..1021
SEED_TOKENS = 1022
SEED_TOTAL = 12288  # 48 x 256 experts
SEED_K = (10, 16)  # the seed's read-ahead depths, for its top-10


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


def calibrated_made_model(path: Path, text_tokens, seed: int = 0) -> Path:
    """A made model whose routers are scaled by one factor so the median gap z1 - z3 on the text
    is the seed's (a made router is ~50x sharper than a trained one: median gap ~20 logits, the
    top-1 weight ~0.96). The routing's structure (popularity, locality) is the made model's; the
    scale sets how flat the combine weights are and what a bonus in absolute logits means, which
    is what the MoCE experiments need to be comparable with the seed's λ."""
    from strata.formats.model_file import read_model, write_model
    from strata.model_config import TensorNames
    from strata.testing.models import make_model
    from strata.tokenizer import byte_level_tokenizer_json
    from strata.tools.quality import fast_params
    from strata.tools.trace import record_trace
    from strata.loader import load

    made = make_model(path, "demo", seed, **MADE_SHAPE)
    params = fast_params(load(made.model_path).resident_params())
    z = np.sort(record_trace(params, text_tokens[:128], decode_order=False).logits, axis=-1)[..., ::-1]
    scale = SEED_MEDIAN_GAP / float(np.median(z[..., 0] - z[..., 2]))
    mf = read_model(made.model_path)
    dense = {name: np.array(a, np.float32) for name, a in mf.dense.items()}
    for layer in range(mf.cfg.n_layers):
        dense[TensorNames.block(layer, TensorNames.router)] *= np.float32(scale)
    write_model(made.model_path, mf.cfg, dense, tokenizer_json=byte_level_tokenizer_json())
    (path.parent / "router_scale.json").write_text(json.dumps({"scale": scale, "target_median_gap": SEED_MEDIAN_GAP}))
    return made.model_path


def record_windows(params, tokens, window: int, meta: dict):
    """The λ = 0 trace of `tokens` in consecutive windows of `window` tokens, each from an empty
    KV cache (one sequence cannot exceed the model's context), concatenated along tokens."""
    from strata.tools.trace import Trace, record_trace

    parts = [record_trace(params, tokens[i:i + window], meta=meta) for i in range(0, len(tokens), window)]
    if len(parts) == 1:
        return parts[0]
    cat = lambda name: np.concatenate([getattr(p, name) for p in parts])
    return Trace(cat("tokens"), cat("router_inputs"), parts[0].routers, cat("logits"), cat("selected"),
                 cat("weights"), parts[0].rule, dict(meta))


def router_spread(trace, warmup: int, bonus: float = 0.85) -> dict:
    """The router statistics the seed quoted (§1.1: median z1 - z3 = 0.35, z2 - z3 = 0.12, 31% / 6%
    of rank-1/2 picks lead rank 3 by > 0.5), ranks counted from 0 (z0 = the top logit). The
    seed's subscripts are read as 0-based ranks (its tables count ranks 0..9, and it asks how
    far the protected ranks 1 and 2 lead the first unprotected one, rank 3); the 1-based reading
    (z0 - z2, z1 - z2) is reported too."""
    z = np.sort(trace.logits[warmup:].astype(np.float64), axis=-1)[..., ::-1]  # [T, L, E], descending
    w = trace.weights[warmup:].astype(np.float64)  # [T, L, k]
    k = trace.top_k
    med = lambda a: float(np.median(a))
    out = {
        "z1-z3": med(z[..., 1] - z[..., 3]), "z2-z3": med(z[..., 2] - z[..., 3]),
        "lead>0.5 rank1": float(np.mean(z[..., 1] - z[..., 3] > 0.5)),
        "lead>0.5 rank2": float(np.mean(z[..., 2] - z[..., 3] > 0.5)),
        "z0-z2": med(z[..., 0] - z[..., 2]), "z1-z2": med(z[..., 1] - z[..., 2]),
        "z0-z1": med(z[..., 0] - z[..., 1]),
        f"z{k - 1}-z{k}": med(z[..., k - 1] - z[..., k]),
        "range": med(z[..., 0] - z[..., -1]),
        f"unselected within {bonus:g} of z{k - 1}": med(np.sum(z[..., k:] >= z[..., k - 1:k] - bonus, axis=-1)),
        "weight by rank": [med(w[..., i]) for i in range(k)],
        "weight sum": med(w.sum(-1)),
        f"w{k - 1}<0.05": float(np.mean(w[..., k - 1] < 0.05)),
    }
    return out


def matched_capacity(inputs, warmup: int) -> int:
    """The smallest arena whose λ = 0, no-read-ahead LRU hit rate on this trace reaches the
    seed's at its 7.5 GB point: the same place on the working-set curve, whatever the model's
    routing concentration (a made model's working set is far smaller than a trained one's)."""
    from strata.tools.closed_loop import LoopConfig
    from strata.tools.replay import replay

    tr = inputs.trace
    lo, hi = tr.n_layers * tr.top_k, tr.n_layers * tr.n_experts
    while lo < hi:
        mid = (lo + hi) // 2
        r = replay(inputs, LoopConfig(capacity=mid, prefetch_depth=0, policy=None), warmup=warmup)
        lo, hi = (lo, mid) if r.hit_rate >= SEED_LRU_HIT else (mid + 1, hi)
    return lo


def experiments(args) -> dict:
    from strata.loader import load
    from strata.reference.routing import STOCK_BONUS, STOCK_J, MoCEPolicy
    from strata.tools.belady import belady
    from strata.tools.closed_loop import GuessRanking, LoopConfig
    from strata.tools.options import seed_preset
    from strata.tools.plots import plot_capacity_sweep, plot_policy_table
    from strata.tools.quality import fast_params
    from strata.tools.recall import readahead_recall
    from strata.tools.replay import ReplayInputs, replay
    from strata.tools.sweep import policy_sweep, write_csv
    from strata.tools.tables import recall_rows, replay_rows, sweep_rows, table
    from strata.tools.trace import load_trace, save_trace

    out = Path(args.out)
    out.mkdir(parents=True, exist_ok=True)
    text = Path(args.text).read_text(encoding="utf-8", errors="replace") if args.text else default_text()
    model_path = Path(args.model) if args.model else None
    if model_path is None:
        from strata.tokenizer import Tokenizer, byte_level_tokenizer_json

        tokens = Tokenizer.from_json(byte_level_tokenizer_json()).encode(text)
        model_path = out / "made" / "model.gguf"
        if not model_path.exists():
            print("building the calibrated made model ...", file=sys.stderr)
            calibrated_made_model(out / "made" / "model", tokens)
    model = load(model_path)
    cfg = model.cfg
    L, E, k = cfg.n_layers, cfg.n_experts, cfg.n_experts_per_token
    window = min(args.window or cfg.max_context, cfg.max_context)
    tokens = model.tokenizer.encode(text)
    if args.tokens > 0:
        tokens = tokens[: args.tokens]
    if not args.model:  # the made model's page was made on one sequence
        tokens = tokens[:window]
    params = fast_params(model.resident_params())
    log = lambda msg: print(msg, file=sys.stderr, flush=True)  # noqa: E731
    n_windows = -(-len(tokens) // window)
    md = [f"model: {model_path} ({L} layers x {E} experts, top-{k}); {len(tokens)} tokens"
          + (f" in {n_windows} windows of {window} (empty KV cache at each; the arena carries over)"
             if n_windows > 1 else "")]

    t0 = time.perf_counter()
    trace = None
    meta = {"model": str(model_path), "window": window}
    if (out / "trace.npz").exists():  # reuse a trace of the same model, tokens and windows
        trace = load_trace(out / "trace.npz")
        if ({key: trace.meta.get(key) for key in meta} != meta or trace.tokens.tolist() != list(tokens)):
            trace = None
    if trace is None:
        trace = record_windows(params, tokens, window, meta)
        save_trace(out / "trace.npz", trace)
    log(f"trace: {time.perf_counter() - t0:.0f} s")
    # the seed's warm-up (128 of 1,022 tokens) fills the arena; a longer text needs no more
    warmup = round(SEED_WARMUP_FRACTION * min(len(tokens), SEED_TOKENS))
    inputs = ReplayInputs(trace)
    spread = router_spread(trace, warmup)
    md += ["", f"## router spread (λ = 0, tokens {warmup}..{len(tokens) - 1}; medians over (token, layer))", "",
           table(["statistic", "value"], [[key, " ".join(f"{x:.3f}" for x in v) if isinstance(v, list) else v]
                                          for key, v in spread.items()], markdown=True)]
    frac = round(SEED_MID / SEED_TOTAL * L * E)  # the seed's 7.5 GB point as a fraction of all experts
    if args.caps:
        caps = [str(int(c)) for c in args.caps.split(",")]
        mid = int(caps[len(caps) // 2])
    else:
        mid = matched_capacity(inputs, warmup)
        caps = [str(round(c / SEED_MID * mid)) for c in SEED_CAPS]
        log(f"the seed's 7.5 GB point (λ0 no-prefetch LRU hit rate {SEED_LRU_HIT:.3f}) is {mid} slots here; "
            f"by fraction of experts ({100 * SEED_MID / SEED_TOTAL:.1f}%) it is {frac}")
    if args.model and str(frac) not in caps:
        caps = sorted(caps + [str(frac)], key=int)
    # the seed's read-ahead depths scaled to this model's top-k (K/k = 1 and 1.6), and 2k
    scaled_k = sorted({max(1, round(kk * k / 10)) for kk in SEED_K} | {2 * k})

    # 1. capacity sweep (stock), 2. read-ahead variants at the seed's 7.5 GB point, 3. Belady
    stock = MoCEPolicy()
    sweep_cfgs = [LoopConfig(capacity=int(c), prefetch_touch=True) for c in caps]  # the seed's stock
    def variant_list(cap: int) -> list:
        return seed_preset([str(cap)], n_layers=L, n_experts=E, top_k=k) + [
            LoopConfig(capacity=cap, prefetch_depth=scaled_k[0], prefetch_touch=True)] + [
            LoopConfig(capacity=cap, prefetch_depth=kk) for kk in scaled_k] + [
            LoopConfig(capacity=cap, prefetch_depth=scaled_k[0], prefetch2=True),
            LoopConfig(capacity=cap, prefetch_depth=scaled_k[0], policy=None)]
    variants = variant_list(mid) + [
        LoopConfig(capacity=mid, prefetch_depth=16, guess=GuessRanking.MOCE),
        LoopConfig(capacity=mid, prefetch_depth=16, moce_pre=True),
        LoopConfig(capacity=mid, prefetch_depth=16, split_turn=False),
        LoopConfig(capacity=mid, prefetch_depth=16, pred_q8=False),
    ]
    drop_ranks = sorted({6, min(6, k - 1)})  # the seed's drop-tail rank (>= 6 of 10) and this model's last rank
    variants += [LoopConfig(capacity=mid, prefetch_touch=True,
                            policy=MoCEPolicy(drop_tail_weight=0.05, drop_tail_min_rank=r)) for r in drop_ranks]
    frac_variants = variant_list(frac) if args.model and frac != mid else []
    line_kinds = [(0, None), (0, stock), (16, stock), (scaled_k[0], stock)]
    lines_cfgs = [LoopConfig(capacity=int(c), prefetch_depth=kk, policy=pol) for c in caps for kk, pol in line_kinds]
    results = {}
    t0 = time.perf_counter()
    for c in sweep_cfgs + variants + frac_variants + lines_cfgs:
        key = (c.label, c.capacity)
        if key not in results and c.capacity >= c.cache_config(L, E, k).min_capacity:
            results[key] = replay(inputs, c, warmup=warmup, keep_selections=True)
    log(f"replays: {len(results)} in {time.perf_counter() - t0:.0f} s")
    opt_ref = {int(c): belady(trace.selected, E, int(c), warmup=warmup) for c in caps}
    opt_run = {key: belady(r.selections, E, r.config.capacity, warmup=warmup) for key, r in results.items()}

    cap_rows = [results[(c.label, c.capacity)] for c in sweep_cfgs if (c.label, c.capacity) in results]
    h, rows = replay_rows(cap_rows, opt={i: opt_run[(r.label, r.config.capacity)] for i, r in enumerate(cap_rows)},
                          total_experts=L * E)
    md += ["", "## capacity sweep (stock: J3 λ0.85 K10 touch)", "", table(h, rows, markdown=True)]
    var_rows = [results[(c.label, c.capacity)] for c in variants if (c.label, c.capacity) in results]
    h, rows = replay_rows(var_rows, opt={i: opt_run[(r.label, r.config.capacity)] for i, r in enumerate(var_rows)},
                          total_experts=L * E)
    md += ["", f"## variants at {mid} slots ({100 * mid / (L * E):.1f}% of experts; the seed's 7.5 GB point)", "",
           table(h, rows, markdown=True),
           "", "drop-tail, experts dropped per token: " + ", ".join(
               f"{r.label} {r.to_json()['dropped_per_token']:.4f}" for r in var_rows if r.config.policy is not None
               and r.config.policy.drop_tail_weight > 0)]
    if frac_variants:
        fr = [results[(c.label, c.capacity)] for c in frac_variants if (c.label, c.capacity) in results]
        h, rows = replay_rows(fr, opt={i: opt_run[(r.label, r.config.capacity)] for i, r in enumerate(fr)},
                              total_experts=L * E)
        md += ["", (f"## variants at {frac} slots (the seed's 7.5 GB point as a fraction of experts, "
                    f"{100 * SEED_MID / SEED_TOTAL:.1f}%)"), "", table(h, rows, markdown=True)]
    md += ["", "Belady MIN on the λ = 0 stream: " + ", ".join(
        f"{c} slots {b.misses_per_token:.2f}/tok" for c, b in opt_ref.items())]
    line_labels = [sweep_cfgs[0].label] + [LoopConfig(capacity=mid, prefetch_depth=kk, policy=pol).label
                                           for kk, pol in reversed(line_kinds)]
    lines = [r for r in results.values() if r.label in line_labels]
    h, rows = _capacity_grid(results, caps, line_labels, opt_ref)
    md += ["", "## urgent misses/token by capacity (slots)", "", table(h, rows, markdown=True)]
    plot_capacity_sweep(lines, out / "capacity.png", belady=[("λ0 stream", b) for b in opt_ref.values()],
                        total_experts=L * E, title=f"urgent misses vs capacity ({L}x{E}, top-{k})")

    # 4. recall
    rec_ks = sorted(set(scaled_k) | {10, 16, 32})
    rec = [readahead_recall(trace, rec_ks, ahead=a, warmup=warmup) for a in (1, 2)]
    md += ["", "## read-ahead recall", "", table(*recall_rows(rec), markdown=True)]

    # 5. the J x λ table (decode order, 256 tokens)
    t0 = time.perf_counter()
    qtok = tokens[: min(args.quality_tokens, window)]  # one sequence: decode order needs the KV cache
    qwarm = round(0.125 * len(qtok))
    rows_sweep = policy_sweep(params, qtok, (1, 2, 3), (0.0, 0.5, 0.85, 1.5),
                              base=LoopConfig(capacity=mid, prefetch_touch=True), warmup=qwarm,
                              progress=lambda label: log(f"  sweep {label}"))
    # drop-tail at the seed's rank (>= 6 of 10) and, when k is smaller, at its last rank
    drop = []
    for rank in drop_ranks:
        rows_d = policy_sweep(params, qtok, (3,), (0.85,), base=LoopConfig(
            capacity=mid, prefetch_touch=True, policy=MoCEPolicy(drop_tail_weight=0.05, drop_tail_min_rank=rank)),
            warmup=qwarm)
        for r in rows_d:
            r["label"] += f" drop<0.05@{rank}"
        drop += rows_d
    stock_row = [r for r in rows_sweep if r["J"] == STOCK_J and r["lambda"] == STOCK_BONUS]
    for r in drop:  # Δ vs the main table's stock row (policy_sweep computed it against the drop row itself)
        base_misses = stock_row[0]["urgent_per_token"] if stock_row else 0.0
        r["delta_vs_stock"] = r["urgent_per_token"] / base_misses - 1.0 if base_misses > 0 else float("nan")
    log(f"sweep: {time.perf_counter() - t0:.0f} s")
    write_csv(rows_sweep + drop, out / "sweep.csv")
    plot_policy_table(rows_sweep, out / "sweep.png")
    md += ["", f"## J x λ at {mid} slots ({len(qtok)} tokens, decode order, warm-up {qwarm})", "",
           table(*sweep_rows(rows_sweep + drop), markdown=True)]

    (out / "tables.md").write_text("\n".join(md) + "\n")
    doc = {"model": str(model_path), "tokens": len(tokens), "warmup": warmup, "window": window,
           "capacities": [int(c) for c in caps], "matched_capacity": mid, "fraction_capacity": frac,
           "router_spread": spread,
           "replay": [dict(r.to_json(), belady=opt_run[key].to_json()) for key, r in results.items()],
           "belady_ref": [b.to_json() for b in opt_ref.values()], "recall": [r.to_json() for r in rec],
           "sweep": rows_sweep + drop}
    (out / "experiments.json").write_text(json.dumps(doc, indent=1))
    print("\n".join(md))
    print(f"wrote {out}/tables.md, experiments.json, capacity.png, sweep.png, sweep.csv")
    return doc


def _capacity_grid(results, caps, labels, opt_ref) -> tuple[list, list]:
    """One row per configuration, one column per capacity: urgent misses per token (and Belady
    MIN on the λ = 0 stream)."""
    header = ["policy"] + [str(c) for c in caps]
    rows = []
    for label in labels:
        row = [label]
        for c in caps:
            r = results.get((label, int(c)))
            row.append(r.urgent_per_token if r is not None else "—")
        rows.append(row)
    rows.append(["Belady MIN, λ0 stream"] + [opt_ref[int(c)].misses_per_token for c in caps])
    return header, rows


def main(argv=None) -> int:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    sub = p.add_subparsers(dest="mode")
    s = sub.add_parser("speed", help="replay speed on one core (default)")
    s.add_argument("--tokens", type=int, default=SEED_SHAPE["tokens"])
    s.add_argument("--layers", type=int, default=SEED_SHAPE["layers"])
    s.add_argument("--experts", type=int, default=SEED_SHAPE["experts"])
    s.add_argument("--top-k", type=int, default=SEED_SHAPE["top_k"])
    s.add_argument("--dim", type=int, default=256, help="router input size of the synthetic trace")
    s.add_argument("--capacity", type=int, default=0, help="slots (default: the seed's 7.5 GB fraction)")
    e = sub.add_parser("experiments", help="the seed's §1 experiments (docs/replay.md)")
    e.add_argument("--model", help="model .gguf (default: build the calibrated made model in OUT/made)")
    e.add_argument("--text", help="text file (default: the repository's README and docs)")
    e.add_argument("--out", default="replay_experiments", help="output directory")
    e.add_argument("--tokens", type=int, default=SEED_TOKENS,
                   help="tokens traced and replayed (default the seed's 1,022; 0: the whole text)")
    e.add_argument("--window", type=int, default=0,
                   help="trace longer texts in windows of this many tokens (default and most: the model's context)")
    e.add_argument("--quality-tokens", type=int, default=256,
                   help="tokens scored for the J x λ table (seed: 256; at most one window)")
    e.add_argument("--caps", help="capacities in slots, comma-separated (default: the seed's points, scaled so the "
                                  "middle one has the seed's λ = 0 LRU hit rate)")
    args = p.parse_args(argv)
    if args.mode == "experiments":
        experiments(args)
    else:
        if args.mode is None:
            args = p.parse_args(["speed"] + list(argv or []))
        speed(args)
    return 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
