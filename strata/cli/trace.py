"""`strata trace MODEL TEXT -o TRACE`: record router inputs, logits and λ = 0 selections."""

from __future__ import annotations

import argparse

HELP = """\
Run MODEL over TEXT (a string, or @file) at λ = 0, one token at a time as decoding does, and
save what every layer's router saw and chose: router inputs [T, L, D], logits [T, L, E], the
routers [L, E, D] and the selections [T, L, k], in one .npz (docs/analysis.md). The trace is
all `strata replay` and `strata recall` need. It computes on the products `strata generate`
uses on the CPU (the compiled kernels; STRATA_CPU_KERNELS=0: numpy's float32), so its numbers
are the runtime's bit for bit.

A checkpoint directory run on tier 2 (mlx-lm's model file, docs/tier2.md) records the family's
own routing instead: the selections its gates made, their selection scores, and the read-ahead
scores each next gate gave, as the tier-2 runtime ranks them (no router matrices; --f16 has no
effect). `strata replay` replays it at λ = 0; `strata recall` scores its guesses.

example:
  strata trace model.gguf @prompt.txt -o /tmp/trace.npz --max-tokens 1024"""


def add_parser(sub, name: str) -> None:
    p = sub.add_parser(name, help="record a routing trace (router inputs and selections)", description=HELP,
                       formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("model", help="model path (name.gguf; its experts in name.experts, or a tier-2 checkpoint "
                                 "directory), default or a hub id")
    p.add_argument("text", help="the text, or @path to read it from a file")
    p.add_argument("-o", "--output", required=True, help="trace file to write (.npz)")
    p.add_argument("--max-tokens", type=int, default=0, help="keep only the first N tokens (default: all)")
    p.add_argument("--f16", action="store_true", help="store router inputs as float16 (half the size)")
    p.add_argument("--quiet", action="store_true", help="no progress bar")
    p.add_argument("--batch", action="store_true",
                   help="one forward over the whole text instead of decode order (faster; rounds differently)")
    p.set_defaults(run=run)


def run(args: argparse.Namespace) -> int:
    import sys
    import time

    from tqdm import tqdm

    from strata.errors import ConfigError
    from strata.loader import load
    from strata.tools.options import read_text, tool_ops
    from strata.tools.quality import fast_params
    from strata.tools.trace import record_trace, save_trace

    model = load(args.model)
    tokens = model.tokenizer.encode(read_text(args.text))
    if args.max_tokens > 0:
        tokens = tokens[: args.max_tokens]
    if not tokens:
        raise ConfigError("the text has no tokens")
    if len(tokens) > model.cfg.max_context:
        raise ConfigError(f"{len(tokens)} tokens exceed the model's context of {model.cfg.max_context} "
                          f"(use --max-tokens)")
    start = time.perf_counter()
    with tqdm(total=len(tokens), desc="tracing", unit="tok", disable=args.quiet, file=sys.stderr,
              dynamic_ncols=True) as bar:
        if getattr(model, "tier", 1) == 2:
            from strata.tools.tier2_trace import record_tier2_trace

            trace = record_tier2_trace(model, tokens, decode_order=not args.batch,
                                       meta={"model": str(model.model_path), "tokens": len(tokens)},
                                       progress=lambda n: bar.update(n - bar.n))
        else:
            trace = record_trace(fast_params(model.resident_params()), tokens,
                                 input_dtype="f16" if args.f16 else "f32", decode_order=not args.batch,
                                 meta={"model": str(model.model_path), "tokens": len(tokens)},
                                 progress=lambda n: bar.update(n - bar.n), ops=tool_ops(model))
    path = save_trace(args.output, trace)
    print(f"wrote {path}: {trace.n_tokens} tokens x {trace.n_layers} layers x {trace.n_experts} experts "
          f"(top-{trace.top_k}) in {time.perf_counter() - start:.1f} s")
    return 0
