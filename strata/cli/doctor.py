"""`strata doctor SOURCE`: will this model run here, and how fast — without reading a weight."""

from __future__ import annotations

import argparse
import os

EPILOG = """\
SOURCE is a Hugging Face config.json (or a checkpoint directory holding one; an MLX checkpoint's
too), a strata model NAME.gguf (with NAME.experts beside it), a llama.cpp GGUF, `default` (the
embedded model) or a hub id (Qwen/Qwen3-30B-A3B) in the local Hugging Face cache.

The first run measures this machine with the quick probe (disk random reads, memory bandwidth,
compute, and strata's own engine on small made models in a few warmed processes: about half a
minute on a quiet 2-core machine), answers, and caches the profile under the user's cache dir.
--calibrate measures fully (every engine case in fresh processes, 3 rounds: several minutes)
and from then on every answer uses that profile, the one whose error docs/doctor.md documents.
--remeasure measures again. Runtime flags (--arena, --keep, --prefetch, --backend, ...) change
the plan exactly as they would change a run.

examples:
  strata doctor ~/hf/Qwen3-30B-A3B                     a checkpoint directory: will it run, how fast
  strata doctor default --calibrate                    the embedded model, after measuring this machine fully
  strata doctor Qwen/Qwen3-30B-A3B                     a checkpoint in the local Hugging Face cache
  strata doctor model.gguf --arena 2GB                 a strata model at a given arena
  strata doctor model.gguf --trace trace.npz           hit rate from the model's own routing trace
  strata doctor llama.gguf                             a llama.cpp GGUF: its reads in place against converted
  strata doctor config.json --experts q4_0 --json      as JSON, for Q4_0 experts
  strata doctor ~/hf/DeepSeek-V3                       an unsupported family still gets a byte budget
  strata doctor ~/models/GLM-5-mlx-4bit                an mlx-lm checkpoint: tier 2's own plan and verdict
"""


def add_parser(sub, name: str) -> None:
    from strata.cli.runtime_flags import add_runtime_flags

    p = sub.add_parser(name, help="will a model run here, and how fast (reads no weights)",
                       description=__doc__, epilog=EPILOG, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("source", metavar="SOURCE", help="config.json, a checkpoint directory, or a .gguf")
    p.add_argument("--json", action="store_true", help="print one JSON object instead of text")
    p.add_argument("--trace", metavar="PATH", help="a routing trace of this model (strata trace) for the hit rate")
    p.add_argument("--experts", default="q2_0", help="expert type of a conversion (default q2_0; strata models: theirs)")
    p.add_argument("--dense", default="f32", help="dense type of a conversion (default f32)")
    p.add_argument("--context", type=int, default=0, help="positions for the KV cache (default: min(4096, the model's))")
    p.add_argument("-n", "--tokens", type=int, default=0,
                   help="predict the mean over a run of N tokens from a cold arena (default: the steady state)")
    p.add_argument("--calibrate", action="store_true",
                   help="measure this machine fully (several minutes) and answer from that profile from now on")
    p.add_argument("--remeasure", action="store_true", help="measure this machine again (else the cached profile)")
    p.add_argument("--cache-dir", metavar="DIR", help="where the machine profile is cached (default: the user's cache dir)")
    add_runtime_flags(p)
    p.set_defaults(run=run, quiet=False)


def run(args: argparse.Namespace) -> int:
    import sys
    import time
    from pathlib import Path

    from strata.cli.runtime_flags import config_from_args
    from strata.formats.quant_types import parse_quant_type
    from strata.doctor import diagnose
    from strata.doctor.probe import default_cache_dir

    config = config_from_args(args)
    cache = Path(args.cache_dir) if args.cache_dir else default_cache_dir(os.environ)
    probe = "full probe, several minutes" if args.calibrate else "quick probe, about half a minute"
    started = time.monotonic()
    def say(msg: str) -> None:
        print(f"measuring this machine ({probe}; {time.monotonic() - started:.0f} s): {msg}", file=sys.stderr, flush=True)

    d = diagnose(_source_path(args.source), cache_dir=cache, config=config, trace=args.trace,
                 expert_qtype=parse_quant_type(args.experts), dense_qtype=parse_quant_type(args.dense),
                 context=args.context or None, remeasure=args.remeasure or args.calibrate, progress=None if args.json else say,
                 horizon=args.tokens, quick=not args.calibrate)
    print(d.to_json() if args.json else d.text())
    return 0


def _source_path(source: str):
    """SOURCE as a path: `default` and hub ids resolved (strata.model_source.resolve_model_name);
    a hub snapshot without a config.json is looked at as the strata model it holds."""
    from strata.hub_cache import looks_like_hub_id
    from strata.model_source import resolve_model_name, strata_model_in

    path = resolve_model_name(source)
    if looks_like_hub_id(source) and not (path / "config.json").exists():
        return strata_model_in(path, source)
    return path
