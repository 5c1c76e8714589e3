"""The reference engine's cache experiments redone on our own models (docs/replay.md): the analysis pipeline
behind `python benchmarks/replay.py experiments`.

On a model with its own routers, unchanged (the trained default model: strata/data/default.gguf),
or, without one, on a made model (testing's "demo" shape with 16 layers, 128 experts, top-8)
whose router logits are rescaled to the reference engine's spread (SEED_MEDIAN_GAP): only the made model is
ever rescaled. Text longer than the model's context is traced in consecutive windows (each from
an empty KV cache; the simulated arena carries over, as it does across requests).
"""

from __future__ import annotations

import json
import sys
import time
from dataclasses import dataclass
from pathlib import Path

import numpy as np

__all__ = ["run_experiments", "calibrated_made_model", "record_windows", "router_spread", "matched_capacity"]

MADE_SHAPE = dict(n_layers=16, n_experts=128, n_experts_per_token=8)  # as benchmarks/stream.py
SEED_MEDIAN_GAP = 0.35  # the reference engine: median z1 - z3 of the real router
SEED_CAPS = (2441, 4308, 5385, 6500, 7500, 8500, 9500, 10500)  # the reference engine capacity points (slots of 12288)
SEED_MID = 5385  # its 7.5 GB point
SEED_LRU_HIT = 1.0 - 55.97 / 480  # λ = 0, no read-ahead, LRU at 5385 slots: 55.97 misses of 48 x 10 lookups
SEED_WARMUP_FRACTION = 128 / 1022  # the reference engine counted tokens 128..1021
SEED_TOKENS = 1022
SEED_TOTAL = 12288  # 48 x 256 experts
SEED_K = (10, 16)  # the reference engine's read-ahead depths, for its top-10


@dataclass(frozen=True)
class _Args:
    out: str | Path
    text: str
    model: str | Path | None
    tokens: int
    window: int
    quality_tokens: int
    caps: str | None


def calibrated_made_model(path: Path, text_tokens, seed: int = 0) -> Path:
    """A made model whose routers are scaled by one factor so the median gap z1 - z3 on the text
    is the reference engine's (a made router is ~50x sharper than a trained one: median gap ~20 logits, the
    top-1 weight ~0.96). The routing's structure (popularity, locality) is the made model's; the
    scale sets how flat the combine weights are and what a bonus in absolute logits means, which
    is what the MoCE experiments need to be comparable with the reference engine's λ."""
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
                 cat("weights"), parts[0].rule, dict(meta), parts[0].biases)


def router_spread(trace, warmup: int, bonus: float = 0.85) -> dict:
    """The router statistics the reference engine quoted (§1.1: median z1 - z3 = 0.35, z2 - z3 = 0.12, 31% / 6%
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


def run_experiments(out: str | Path, text: str, *, model: str | Path | None = None, tokens: int = SEED_TOKENS,
                    window: int = 0, quality_tokens: int = 256, caps: str | None = None) -> dict:
    """The reference engine's experiments on `model` (default: a calibrated made model built in OUT/made) over
    `text`: trace, router spread, capacity sweep with read-ahead variants and Belady, recall one
    and two layers ahead, the J x λ policy table. Writes tables.md, experiments.json, PNGs and
    sweep.csv to `out`; returns the JSON document."""
    args = _Args(out=out, text=text, model=model, tokens=tokens, window=window, quality_tokens=quality_tokens,
                 caps=caps)
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
    text = args.text
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
    L, E, k = cfg.n_moe_layers, cfg.n_experts, cfg.n_experts_per_token
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
    # the reference engine's warm-up (128 of 1,022 tokens) fills the arena; a longer text needs no more
    warmup = round(SEED_WARMUP_FRACTION * min(len(tokens), SEED_TOKENS))
    inputs = ReplayInputs(trace)
    spread = router_spread(trace, warmup)
    md += ["", f"## router spread (λ = 0, tokens {warmup}..{len(tokens) - 1}; medians over (token, layer))", "",
           table(["statistic", "value"], [[key, " ".join(f"{x:.3f}" for x in v) if isinstance(v, list) else v]
                                          for key, v in spread.items()], markdown=True)]
    frac = round(SEED_MID / SEED_TOTAL * L * E)  # the reference engine's 7.5 GB point as a fraction of all experts
    if args.caps:
        caps = [str(int(c)) for c in args.caps.split(",")]
        mid = int(caps[len(caps) // 2])
    else:
        mid = matched_capacity(inputs, warmup)
        caps = [str(round(c / SEED_MID * mid)) for c in SEED_CAPS]
        log(f"the reference engine's 7.5 GB point (λ0 no-prefetch LRU hit rate {SEED_LRU_HIT:.3f}) is {mid} slots here; "
            f"by fraction of experts ({100 * SEED_MID / SEED_TOTAL:.1f}%) it is {frac}")
    if args.model and str(frac) not in caps:
        caps = sorted(caps + [str(frac)], key=int)
    # the reference engine's read-ahead depths scaled to this model's top-k (K/k = 1 and 1.6), and 2k
    scaled_k = sorted({max(1, round(kk * k / 10)) for kk in SEED_K} | {2 * k})

    # 1. capacity sweep (stock), 2. read-ahead variants at the reference engine's 7.5 GB point, 3. Belady
    stock = MoCEPolicy()
    sweep_cfgs = [LoopConfig(capacity=int(c), prefetch_touch=True) for c in caps]  # the reference engine's stock
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
    drop_ranks = sorted({6, min(6, k - 1)})  # the reference engine's drop-tail rank (>= 6 of 10) and this model's last rank
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
    md += ["", f"## variants at {mid} slots ({100 * mid / (L * E):.1f}% of experts; the reference engine's 7.5 GB point)", "",
           table(h, rows, markdown=True),
           "", "drop-tail, experts dropped per token: " + ", ".join(
               f"{r.label} {r.to_json()['dropped_per_token']:.4f}" for r in var_rows if r.config.policy is not None
               and r.config.policy.drop_tail_weight > 0)]
    if frac_variants:
        fr = [results[(c.label, c.capacity)] for c in frac_variants if (c.label, c.capacity) in results]
        h, rows = replay_rows(fr, opt={i: opt_run[(r.label, r.config.capacity)] for i, r in enumerate(fr)},
                              total_experts=L * E)
        md += ["", (f"## variants at {frac} slots (the reference engine's 7.5 GB point as a fraction of experts, "
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
    # drop-tail at the reference engine's rank (>= 6 of 10) and, when k is smaller, at its last rank
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
