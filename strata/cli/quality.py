"""`strata quality MODEL TEXT`: what a MoCE policy costs, scored in decode order vs λ = 0."""

from __future__ import annotations

import argparse

HELP = """\
Feed TEXT (a string, or @file) to MODEL one token at a time, twice: with the model's own routing
(λ = 0) and with MoCE (--J, --lambda) against a simulated arena (--cap) whose residency evolves
as in generation. Reports the KLD of the next-token distributions vs λ = 0 (mean, p90, p99,
max), the routed-output relMSE and rel-L2 vs λ = 0 with exact expert weights, perplexity,
and the policy run's urgent misses. At --lambda 0 the KLD is exactly 0. Both runs compute on
the products `strata generate` uses on the CPU (the compiled kernels; STRATA_CPU_KERNELS=0:
numpy's float32), so the policy run's logits and misses are the runtime's bit for bit.

example:
  strata quality model.gguf @text.txt --J 2 --lambda 0.85 --cap 25% --max-tokens 256"""


def add_parser(sub, name: str) -> None:
    from strata.tools.options import add_cache_options, add_policy_options

    p = sub.add_parser(name, help="KLD and routed-output error of a MoCE policy vs λ = 0", description=HELP,
                       formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("model", help="model path (name.gguf; its experts in name.experts)")
    p.add_argument("text", help="the text, or @path to read it from a file")
    p.add_argument("--cap", default="25%", help="arena capacity: slots, a percentage of all experts, or 'min'")
    add_cache_options(p, lists=False)
    add_policy_options(p, lists=False)
    p.add_argument("--max-tokens", type=int, default=256, help="score the first N tokens (default 256; 0: all)")
    p.add_argument("-o", "--output", help="write the result as JSON")
    p.set_defaults(run=run)


def run(args: argparse.Namespace) -> int:
    import json
    import time

    from strata.errors import ConfigError
    from strata.loader import load
    from strata.tools.options import loop_configs, scoring_tokens, tool_ops
    from strata.tools.quality import fast_params, quality

    model = load(args.model)
    cfg = model.cfg
    tokens = scoring_tokens(model, args.text, args.max_tokens)
    if args.touch == "both":
        raise ConfigError("quality scores one configuration: --touch on or off")
    configs = loop_configs(args, [args.cap], n_layers=cfg.n_moe_layers, n_experts=cfg.n_experts,
                           top_k=cfg.n_experts_per_token)
    if len(configs) != 1:
        raise ConfigError("quality scores one configuration: give one --J, --lambda and --K")
    config = configs[0]
    least = config.cache_config(cfg.n_moe_layers, cfg.n_experts, cfg.n_experts_per_token).min_capacity
    if config.capacity < least:
        raise ConfigError(f"--cap {config.capacity} slots is below the smallest legal arena ({least})")
    if not 0 <= args.warmup < len(tokens):
        raise ConfigError(f"--warmup {args.warmup} must be below the text's {len(tokens)} tokens")
    start = time.perf_counter()
    q = quality(fast_params(model.resident_params()), tokens, config, warmup=args.warmup, ops=tool_ops(model))
    d = q.to_json()
    print(f"{config.label} at {config.capacity} slots, {q.positions} positions scored in decode order "
          f"({time.perf_counter() - start:.1f} s)")
    print(f"  KLD vs λ=0   mean {q.kld_mean:.4g}  p90 {q.kld_p90:.4g}  p99 {q.kld_p99:.4g}  max {q.kld_max:.4g}")
    print(f"  routed out   relMSE {q.relmse:.4g}  rel-L2 {q.rel_l2:.4g}  "
          f"({100 * q.changed_fraction:.1f}% of turns routed differently)")
    print(f"  perplexity   {q.ppl:.3f} (λ=0: {q.ppl_ref:.3f})")
    print(f"  cache        {q.urgent_per_token:.2f} urgent misses/token, "
          f"{d['readahead_hits_per_token']:.2f} read-ahead hits/token, {d['reads_per_token']:.2f} reads/token")
    if args.output:
        with open(args.output, "w") as f:
            json.dump(dict(d, model=str(model.model_path)), f, indent=1)
        print(f"wrote {args.output}")
    return 0
