"""`strata replay TRACE`: the closed-loop cache simulator over a routing trace."""

from __future__ import annotations

import argparse

HELP = """\
Replay a trace (`strata trace`) through the expert-cache state machine, closed loop: at every
token and layer MoCE routing re-runs on the trace's logits against the simulated residency.
Prints the reference engine's table per configuration: urgent misses, read-ahead hits and reads per token,
misses by selected rank. List-valued flags (--caps, --K, --J, --lambda) make a grid.
Capacities: slots ('3000'), a percentage of all experts ('25%') or 'min'.

examples:
  strata replay t.npz --caps 20%,30%,40%,60% -o /tmp/caps        # table, caps.json, caps.png
  strata replay t.npz --caps 30% --K 10,16 --touch both          # read-ahead variants
  strata replay t.npz --caps 30% --K 0 --lambda 0,0.85 --opt     # vs Belady MIN
  strata replay t.npz --caps 20%,30%,40% --preset seed --opt     # the reference engine's experiments
  strata replay t.npz --caps min,30% --windows 2,4 --suffix-draft 1,2,3 --lambda 0   # speculative windows

A tier-2 model's trace (its family's own routing, recorded) replays at λ = 0, the default for
it: MoCE re-routing needs a native module's selection score, and is refused.

With --windows or --suffix-draft each configuration also runs windows of several positions
(strata.tools.windows): T positions all accepted, or the suffix drafter's windows over the
trace's tokens; the table gives reads, bytes and urgent misses per decided token against T=1."""


def add_parser(sub, name: str) -> None:
    from strata.tools.options import SEED_PRESET, add_cache_options, add_policy_options

    p = sub.add_parser(name, help="closed-loop expert-cache replay over a trace", description=HELP,
                       formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("trace", help="trace file from `strata trace`")
    p.add_argument("--caps", default="25%", help="arena capacities, comma-separated (default 25%%)")
    add_cache_options(p, lists=True)
    add_policy_options(p, lists=True)
    p.set_defaults(lam=None)  # the stock λ, or 0 for a tier-2 trace (run)
    p.add_argument("--preset", choices=[SEED_PRESET], help="run the reference engine's list of variants at each capacity")
    p.add_argument("--opt", action="store_true",
                   help="Belady MIN on the λ = 0 selection stream and on each run's routed stream")
    p.add_argument("--dump", metavar="DIR", help="write each run's routed selections and misses per turn")
    p.add_argument("--tokens", type=int, default=0, help="replay only the first N tokens (default: all)")
    p.add_argument("-o", "--output", metavar="PREFIX", help="write PREFIX.json and PREFIX.png (misses vs capacity)")
    p.add_argument("--windows", default="", metavar="T,...", help="also replay windows of T positions, all accepted")
    p.add_argument("--suffix-draft", default="", metavar="D,...",
                   help="also replay the suffix drafter's windows of depth D over the trace's tokens")
    p.set_defaults(run=run)


def run(args: argparse.Namespace) -> int:
    import json
    import sys
    import time

    from strata.errors import ConfigError
    from strata.tools.belady import belady
    from strata.tools.options import loop_configs, parse_list
    from strata.tools.plots import plot_capacity_sweep
    from strata.tools.replay import replay_grid, save_dump
    from strata.tools.tables import replay_rows, table
    from strata.tools.trace import load_trace

    from strata.tools.options import STOCK_BONUS

    trace = load_trace(args.trace)
    if args.lam is None:
        args.lam = "0" if trace.family_routing else str(STOCK_BONUS)
    if args.tokens > 0:
        trace = trace.truncated(args.tokens)
    L, E, k = trace.n_layers, trace.n_experts, trace.top_k
    if args.windows or args.suffix_draft:
        from strata.cli.replay_windows import run_windows

        return run_windows(args, trace)
    configs = loop_configs(args, parse_list(args.caps, str, "--caps"), n_layers=L, n_experts=E, top_k=k)
    if trace.family_routing:
        from strata.tools.closed_loop import check_family_routing

        for c in configs:
            check_family_routing(c)
    runnable = []
    for c in configs:
        least = c.cache_config(L, E, k).min_capacity
        if c.capacity < least:
            print(f"skipping {c.label} at {c.capacity} slots: below the smallest legal arena ({least})", file=sys.stderr)
        else:
            runnable.append(c)
    if not runnable:
        raise ConfigError("no configuration has a legal arena; raise --caps")
    if not 0 <= args.warmup < trace.n_tokens:
        raise ConfigError(f"--warmup {args.warmup} must be below the trace's {trace.n_tokens} tokens")
    start = time.perf_counter()
    results = replay_grid(trace, runnable, warmup=args.warmup, keep_selections=bool(args.opt or args.dump))
    elapsed = time.perf_counter() - start
    opt, ref_opt = {}, []
    if args.opt:
        opt = {i: belady(r.selections, E, r.config.capacity, warmup=args.warmup) for i, r in enumerate(results)}
        for cap in sorted({r.config.capacity for r in results}):
            ref_opt.append(("λ0 stream", belady(trace.selected, E, cap, warmup=args.warmup)))
    header, rows = replay_rows(results, opt=opt, total_experts=L * E)
    print(f"{trace.n_tokens - args.warmup} tokens counted (warm-up {args.warmup}) x {L} layers x {E} experts, "
          f"top-{k}; {len(results)} runs in {elapsed:.1f} s")
    print(table(header, rows))
    for label, b in ref_opt:
        print(f"Belady MIN on the λ = 0 stream at {b.capacity} slots: {b.misses_per_token:.2f} misses/token")
    if args.dump:
        paths = save_dump(args.dump, results)
        print(f"dumped {len(paths)} runs to {args.dump}")
    if args.output:
        doc = {"trace": str(args.trace), "tokens": trace.n_tokens, "warmup": args.warmup, "layers": L,
               "experts": E, "top_k": k, "seconds": elapsed,
               "runs": [dict(r.to_json(), **({"belady": opt[i].to_json()} if i in opt else {}))
                        for i, r in enumerate(results)],
               "belady_ref": [b.to_json() for _, b in ref_opt]}
        with open(f"{args.output}.json", "w") as f:
            json.dump(doc, f, indent=1)
        png = plot_capacity_sweep(results, f"{args.output}.png", belady=ref_opt, total_experts=L * E)
        print(f"wrote {args.output}.json and {png}")
    return 0
