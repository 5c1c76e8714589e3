"""`strata generate [MODEL] PROMPT`: print the generated text, then a one-line summary."""

from __future__ import annotations

import argparse
import os
import sys

from strata.cli.pipeline import add_pipeline_flags, pipelined, run_pipelined
from strata.cli.runtime_flags import add_runtime_flags, config_from_args, print_report

HELP = """\
Generate text. With one positional argument it is the prompt and the embedded default model
is used; with two, the first is a model (`name.gguf`, its experts in `name.experts`; `default`
names the embedded one; a checkpoint directory as mlx-lm's convert writes it runs as tier 2:
mlx-lm's model file, experts streamed from the shards, with the `mlx-lm` extra). PROMPT is the text, @FILE reads it from a file, - from standard input
(@@text is the literal @text). Greedy by default (--temp 0); --top-k, --min-p, --top-p filter a
sampled step, --repeat-penalty lowers tokens seen in the last 64 (all off by default); --seed
makes sampled runs reproducible. --chat wraps the prompt as one user turn in the model's chat
template (converted models keep their checkpoint's). The summary line gives the speeds and the
process's peak memory.

sizes: --arena 2GB (bytes: a number with a unit), --arena 300 or 300slots (slots), --arena 25%
(a share of all experts); every size flag of every subcommand reads them alike."""

MODEL_SUFFIXES = (".gguf", ".experts")
# a CLI message names the flag the user typed, not the API parameter
FLAGS = {"max_tokens": "--max-tokens", "temperature": "--temp", "top_p": "--top-p", "seed": "--seed",
         "top_k": "--top-k", "min_p": "--min-p", "repeat_penalty": "--repeat-penalty"}


def add_parser(sub, name: str) -> None:
    p = sub.add_parser(name, help="generate text from a prompt", description=HELP,
                       formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("args", nargs="+", metavar="[MODEL] PROMPT", help="optional model path, then the prompt")
    p.add_argument("-n", "--max-tokens", type=int, default=100, help="tokens to generate (default 100)")
    p.add_argument("--temp", type=float, default=0.0, help="sampling temperature; 0 is greedy (default)")
    p.add_argument("--top-p", type=float, default=1.0, help="nucleus sampling mass (default 1.0: off)")
    p.add_argument("--top-k", type=int, default=0, help="sample among the k most probable tokens (default 0: off)")
    p.add_argument("--min-p", type=float, default=0.0,
                   help="drop tokens below min-p x the most probable one's probability (default 0: off)")
    p.add_argument("--repeat-penalty", type=float, default=1.0,
                   help="divide the logits of tokens seen in the last 64 by this (default 1: off; try 1.1)")
    p.add_argument("--seed", type=int, default=0, help="sampling seed (default 0)")
    p.add_argument("--chat", action="store_true", help="apply the model's chat template to the prompt")
    p.add_argument("--quiet", action="store_true", help="print only the generated text")
    add_runtime_flags(p)
    add_pipeline_flags(p)
    p.set_defaults(run=run)


def looks_like_model(arg: str) -> bool:
    """A lone positional argument that names a model rather than a prompt: a model or weights
    file name, or an existing directory."""
    from strata.model_source import WEIGHT_SUFFIXES

    text = arg.strip()
    if not text or "\n" in text or " " in text:
        return False
    return text.lower().endswith(MODEL_SUFFIXES + WEIGHT_SUFFIXES) or os.path.isdir(text)


def _flag_error(e: Exception):
    from strata.errors import ConfigError

    text = str(e)
    for param, flag in FLAGS.items():
        if text.startswith(param):
            return ConfigError(flag + text[len(param):])
    return e


def peak_memory_bytes() -> int | None:
    """The process's peak resident memory (getrusage; psutil's current RSS where that is missing)."""
    try:
        import resource

        peak = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss
        return peak if sys.platform == "darwin" else peak * 1024  # macOS reports bytes, Linux kB
    except (ImportError, OSError):
        try:
            import psutil

            return psutil.Process().memory_info().rss
        except ImportError:
            return None


def run(args: argparse.Namespace) -> int:
    from strata.api_args import check_count, sampler_from
    from strata.cli.paths import check_output_path, read_prompt
    from strata.default_model import default_model_path
    from strata.errors import ConfigError, StrataError
    from strata.loader import EMBEDDED_NAME, load

    if len(args.args) > 2:
        raise StrataError(f"expected [MODEL] PROMPT, got {len(args.args)} arguments (quote the prompt)")
    if len(args.args) == 1 and looks_like_model(args.args[0]):
        raise ConfigError(f"{args.args[0]!r} looks like a model, not a prompt: give both, "
                          f"strata generate {args.args[0]} PROMPT (a prompt of this text: strata generate default TEXT)")
    model_arg, prompt_arg = (args.args if len(args.args) == 2 else (None, args.args[0]))
    try:  # every option is checked before the model loads or a token is generated
        check_count("max_tokens", args.max_tokens)
        sampler_from(temperature=args.temp, top_p=args.top_p, seed=args.seed, top_k=args.top_k, min_p=args.min_p,
                     repeat_penalty=args.repeat_penalty)
    except ConfigError as e:
        raise _flag_error(e) from None
    config = config_from_args(args)
    if args.report_json:
        check_output_path(args.report_json, "--report-json")
    if config.logpos:
        check_output_path(config.logpos, "--logpos")
    if pipelined(args):  # several hosts: each rank loads its own layers (strata.pipeline)
        if prompt_arg == "-":  # mlx.launch gives the ranks no standard input
            raise ConfigError("--hosts: a prompt from standard input (-) does not reach the ranks; give the text "
                              "or @FILE (read on rank 0's host)")
        if not model_arg or (model_arg == EMBEDDED_NAME and not os.path.exists(model_arg)):
            model_arg = default_model_path(announce=False)
        # rank 0 reads the prompt (an @FILE on its own host); the launcher passes the argument on
        return run_pipelined(args, model_arg, config,
                             lambda engine: _generate(args, engine, engine.model, read_prompt(prompt_arg), config))
    prompt = read_prompt(prompt_arg)
    if not model_arg or (model_arg == EMBEDDED_NAME and not os.path.exists(model_arg)):
        model_arg = default_model_path(announce=not args.quiet)
    model = load(model_arg)
    return _generate(args, model, model, prompt, config)


def _generate(args: argparse.Namespace, source, model, prompt, config) -> int:
    """Generate on `source` (`model`, or an engine over it: the pipeline's) and print."""
    from strata.generate import stream_generate
    from strata.sizes import fmt_bytes

    if args.chat:
        from strata.chat_template import chat_prompt

        prompt = model.tokenizer.encode(chat_prompt(model, prompt))  # the template holds any BOS
    last = None
    for last in stream_generate(source, prompt, max_tokens=args.max_tokens, temperature=args.temp,
                                top_p=args.top_p, seed=args.seed, config=config, top_k=args.top_k,
                                min_p=args.min_p, repeat_penalty=args.repeat_penalty):
        sys.stdout.write(last.text)
        sys.stdout.flush()
    sys.stdout.write("\n")
    if last is not None and not args.quiet:
        peak = peak_memory_bytes()
        print(
            f"[{last.prompt_tokens} prompt tokens at {last.prompt_tps:.1f} tok/s, "
            f"{last.generation_tokens} generated at {last.generation_tps:.1f} tok/s, "
            f"finish: {last.finish_reason}" + (f", peak memory {fmt_bytes(peak)}" if peak else "") + "]",
            file=sys.stderr,
        )
    print_report(args, last, sys.stderr)
    return 0
