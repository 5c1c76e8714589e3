"""`strata replay TRACE --windows ... --suffix-draft ...`: the window part of `strata replay`
(strata.tools.windows), one table row per configuration and plan, against T=1."""

from __future__ import annotations

import argparse
import json
import sys
from pathlib import Path

__all__ = ["run_windows"]


def run_windows(args: argparse.Namespace, trace) -> int:
    from strata.errors import ConfigError
    from strata.sizes import fmt_bytes
    from strata.tools.options import loop_configs, parse_list
    from strata.tools.replay import ReplayInputs
    from strata.tools.tables import table
    from strata.tools.windows import fixed_windows, replay_windows, suffix_windows

    n = trace.n_tokens
    plans = [fixed_windows(n, 1)]
    plans += [fixed_windows(n, t) for t in parse_list(args.windows, int, "--windows") if t > 1]
    plans += [suffix_windows(trace.tokens, d) for d in parse_list(args.suffix_draft, int, "--suffix-draft")]
    longest = max(p.max_positions for p in plans)
    L, E, k = trace.n_layers, trace.n_experts, trace.top_k
    configs = loop_configs(args, parse_list(args.caps, str, "--caps"), n_layers=L, n_experts=E, top_k=k,
                           window=longest)
    legal = [c for c in configs if c.capacity >= c.cache_config(L, E, k).min_capacity]
    for c in configs:
        if c not in legal:
            print(f"skipping {c.label} at {c.capacity} slots: below the smallest legal arena for windows of "
                  f"{longest} ({c.cache_config(L, E, k).min_capacity})", file=sys.stderr)
    configs = legal
    if not configs:
        raise ConfigError(f"no capacity holds a window of {longest} positions; raise --caps (or use 'min')")
    slot = _slot_bytes(trace)
    inputs, runs = ReplayInputs(trace), []
    for c in configs:
        base = None
        for plan in plans:
            r = replay_windows(inputs, c, plan, warmup=args.warmup)
            if base is None:  # the T=1 plan comes first
                base = r
            runs.append((r, r.reads_per_token / base.reads_per_token if base.reads_per_token else float("nan")))
    header = ["policy", "cap", "plan", "windows", "tokens/window", "accepted", "union/layer", "reads/tok",
              "vs T=1", "urgent/tok"] + (["bytes/tok"] if slot else [])
    rows = [[r.config.label, r.config.capacity, r.plan, r.windows, r.tokens / max(r.windows, 1),
             f"{100 * r.acceptance:.1f}%" if r.drafted else "-", r.union_per_layer, r.reads_per_token,
             f"{ratio:.3f}x", r.urgent_per_token] + ([fmt_bytes(r.reads_per_token * slot)] if slot else [])
            for r, ratio in runs]
    print(f"{n - args.warmup} tokens counted (warm-up {args.warmup}) x {L} layers x {E} experts, top-{k}; "
          f"windows up to {longest} positions" + ("" if slot else "; bytes unknown (the trace names no model)"))
    print(table(header, rows))
    if args.output:
        doc = {"trace": str(args.trace), "tokens": n, "warmup": args.warmup, "slot_bytes": slot,
               "runs": [dict(r.to_json(slot), reads_vs_t1=ratio) for r, ratio in runs]}
        Path(f"{args.output}.json").write_text(json.dumps(doc, indent=1))
        print(f"wrote {args.output}.json")
    return 0


def _slot_bytes(trace) -> int:
    """The slot size of the model the trace was recorded on (its `.experts` file), else 0."""
    from strata.formats.experts_file import ExpertsFile

    model = trace.meta.get("model")
    if not model:
        return 0
    path = Path(model).with_suffix(".experts")
    try:
        xf = ExpertsFile.open(path)
    except Exception as e:  # an absent or moved model: the table shows reads, not bytes
        print(f"note: {path}: {e}; bytes left out", file=sys.stderr)
        return 0
    try:
        return xf.header.padded_bytes
    finally:
        xf.close()
