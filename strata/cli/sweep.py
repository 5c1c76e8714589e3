"""`strata sweep MODEL TEXT`: the reference engine's MoCE policy table, J × λ -> misses, relMSE, KLD."""

from __future__ import annotations

import argparse

HELP = """\
For each MoCE policy in --J × --lambda, at one arena (--cap): urgent misses per token from the
closed-loop replay of the text's λ = 0 trace and from the decode-order run, the routed-output
relMSE / rel-L2 and the KLD vs λ = 0 (as `strata quality`). Writes PREFIX.csv, PREFIX.png
(misses against relMSE and KLD) and PREFIX.json. Computed on `strata generate`'s CPU products
(the compiled kernels; STRATA_CPU_KERNELS=0: numpy's float32), as `strata quality` is.

example:
  strata sweep model.gguf @text.txt --J 1,2,3 --lambda 0,0.5,0.85,1.5 --cap 25% -o /tmp/sweep"""


def add_parser(sub, name: str) -> None:
    from strata.tools.options import add_cache_options, add_policy_options

    p = sub.add_parser(name, help="MoCE policy table: J x λ -> misses, relMSE, KLD", description=HELP,
                       formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("model", help="model path (name.gguf; its experts in name.experts)")
    p.add_argument("text", help="the text, or @path to read it from a file")
    p.add_argument("--cap", default="25%", help="arena capacity: slots, a percentage of all experts, or 'min'")
    add_cache_options(p, lists=False)
    add_policy_options(p, lists=True)
    p.set_defaults(J="1,2,3", lam="0,0.5,0.85,1.5")
    p.add_argument("--max-tokens", type=int, default=256, help="use the first N tokens (default 256; 0: all)")
    p.add_argument("-o", "--output", metavar="PREFIX", default="sweep", help="output prefix (default ./sweep)")
    p.set_defaults(run=run)


def run(args: argparse.Namespace) -> int:
    import json
    import sys
    import time

    from strata.errors import ConfigError
    from strata.loader import load
    from strata.tools.options import loop_configs, scoring_tokens, tool_ops
    from strata.tools.plots import plot_policy_table
    from strata.tools.quality import fast_params
    from strata.tools.sweep import policy_sweep, write_csv
    from strata.tools.tables import sweep_rows, table

    model = load(args.model)
    cfg = model.cfg
    tokens = scoring_tokens(model, args.text, args.max_tokens)
    if args.touch == "both":
        raise ConfigError("sweep varies the policy only: --touch on or off")
    L, E, k = cfg.n_moe_layers, cfg.n_experts, cfg.n_experts_per_token
    base = loop_configs(replace_args(args, J="3", lam="0.85"), [args.cap], n_layers=L, n_experts=E, top_k=k)[0]
    js = [int(j) for j in args.J.split(",") if j.strip()]
    lams = [float(v) for v in args.lam.split(",") if v.strip()]
    least = base.cache_config(L, E, k).min_capacity
    if base.capacity < least:
        raise ConfigError(f"--cap {base.capacity} slots is below the smallest legal arena ({least})")
    if not 0 <= args.warmup < len(tokens):
        raise ConfigError(f"--warmup {args.warmup} must be below the text's {len(tokens)} tokens")
    start = time.perf_counter()
    rows = policy_sweep(fast_params(model.resident_params()), tokens, js, lams, base=base, warmup=args.warmup,
                        progress=lambda label: print(f"  {label} ...", file=sys.stderr), ops=tool_ops(model))
    print(f"{len(tokens) - args.warmup} tokens at {base.capacity} slots, read-ahead K={base.prefetch_depth}; "
          f"{len(rows)} policies in {time.perf_counter() - start:.1f} s")
    print(table(*sweep_rows(rows)))
    csv_path = write_csv(rows, f"{args.output}.csv")
    png = plot_policy_table(rows, f"{args.output}.png")
    with open(f"{args.output}.json", "w") as f:
        json.dump({"model": str(model.model_path), "tokens": len(tokens), "warmup": args.warmup,
                   "capacity": base.capacity, "rows": rows}, f, indent=1)
    print(f"wrote {csv_path}, {png} and {args.output}.json")
    return 0


def replace_args(args: argparse.Namespace, **changes) -> argparse.Namespace:
    out = argparse.Namespace(**vars(args))
    for key, value in changes.items():
        setattr(out, key, value)
    return out
