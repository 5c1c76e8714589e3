"""`strata generate [MODEL] PROMPT`: print the generated text, then a one-line summary."""

from __future__ import annotations

import argparse
import os
import sys

from strata.cli.pipeline import add_pipeline_flags, pipelined, run_pipelined
from strata.cli.runtime_flags import add_runtime_flags, config_from_args, print_report
from strata.cli.sampling_flags import add_sampling_flags, check_sampling, flag_error, sampling_options, stop_strings

HELP = """\
Generate text. With one positional argument it is the prompt and the embedded default model
is used; with two, the first is a model (`name.gguf`, its experts in `name.experts`; `default`
names the embedded one; a hub id such as Qwen/Qwen3-30B-A3B is looked up in the local Hugging
Face cache; a llama.cpp GGUF, or the first part of a split one, runs as it is: its experts read in
place, nothing converted or written; a checkpoint directory as mlx-lm's convert writes it runs as
tier 2: mlx-lm's model file, experts streamed from the shards, with the `mlx-lm` extra). PROMPT is the text, @FILE reads
it from a file, - from standard input (@@text is the literal @text). Greedy by default (--temp 0);
--top-k, --min-p, --top-p filter a sampled step, --repeat-penalty lowers tokens seen in the last
64, --frequency-penalty and --presence-penalty are OpenAI's (all off by default); --seed makes
sampled runs reproducible. The embedded model is the demo: with no sampling flag it samples
(--temp 0.7 --top-p 0.9 --repeat-penalty 1.2 --seed 0, which keep it out of greedy loops:
docs/model-card.md) and its output starts with the prompt; any sampling flag (or --suffix-draft)
starts from greedy instead. --stop ends the text where a string starts; --ctx holds the model to
fewer positions than its context (a longer prompt is refused). --chat wraps the prompt as one
user turn in the model's chat template (converted models keep their checkpoint's). The summary
line gives the speeds and the process's peak memory.

sizes: --arena 2GB (bytes: a number with a unit), --arena 300 or 300slots (slots), --arena 25%
(a share of all experts); every size flag of every subcommand reads them alike."""

MODEL_SUFFIXES = (".gguf", ".experts")


def add_parser(sub, name: str) -> None:
    p = sub.add_parser(name, help="generate text from a prompt", description=HELP,
                       formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("args", nargs="+", metavar="[MODEL] PROMPT", help="optional model path, then the prompt")
    p.add_argument("-n", "--max-tokens", type=int, default=100, help="tokens to generate (default 100)")
    p.add_argument("--chat", action="store_true", help="apply the model's chat template to the prompt")
    p.add_argument("--quiet", action="store_true", help="print only the generated text (the demo's prompt too)")
    add_sampling_flags(p)
    add_runtime_flags(p)
    add_pipeline_flags(p)
    p.set_defaults(run=run)


def looks_like_model(arg: str) -> bool:
    """A lone positional argument that names a model rather than a prompt: a model or weights
    file name, an existing directory, or a hub id the local Hugging Face cache holds."""
    from strata.errors import FormatError
    from strata.hub_cache import looks_like_hub_id, snapshot_dir
    from strata.model_source import WEIGHT_SUFFIXES

    text = arg.strip()
    if not text or "\n" in text or " " in text:
        return False
    if text.lower().endswith(MODEL_SUFFIXES + WEIGHT_SUFFIXES) or os.path.isdir(text):
        return True
    if looks_like_hub_id(text):  # "and/or" is a prompt, unless the cache holds a model of that name
        try:
            return snapshot_dir(text).is_dir()
        except FormatError:
            return False
    return False


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
    from strata.api_args import check_count
    from strata.cli.paths import check_output_path, read_prompt
    from strata.default_model import default_model_path
    from strata.errors import ConfigError, StrataError
    from strata.loader import load

    if len(args.args) > 2:
        raise StrataError(f"expected [MODEL] PROMPT, got {len(args.args)} arguments (quote the prompt)")
    if len(args.args) == 1 and looks_like_model(args.args[0]):
        raise ConfigError(f"{args.args[0]!r} looks like a model, not a prompt: give both, "
                          f"strata generate {args.args[0]} PROMPT (a prompt of this text: strata generate default TEXT)")
    model_arg, prompt_arg = (args.args if len(args.args) == 2 else (None, args.args[0]))
    embedded = is_embedded(model_arg)
    config = config_from_args(args)
    # the demo samples with a repetition penalty, which speculation does not take yet: with
    # --suffix-draft the embedded model is greedy like any other
    options = sampling_options(args, demo=embedded and not config.suffix_draft)
    try:  # every option is checked before the model loads or a token is generated
        check_count("max_tokens", args.max_tokens)
        if args.ctx is not None:
            check_count("max_context", args.ctx, minimum=2)
    except ConfigError as e:
        raise flag_error(e) from None
    check_sampling(options)
    options["stop"] = stop_strings(args.stop)
    if args.report_json:
        check_output_path(args.report_json, "--report-json")
    if config.logpos:
        check_output_path(config.logpos, "--logpos")
    if pipelined(args):  # several hosts: each rank loads its own layers (strata.pipeline)
        if prompt_arg == "-":  # mlx.launch gives the ranks no standard input
            raise ConfigError("--hosts: a prompt from standard input (-) does not reach the ranks; give the text "
                              "or @FILE (read on rank 0's host)")
        if args.ctx is not None:
            raise ConfigError("--ctx: not supported with --hosts yet (each stage holds the model's context)")
        if embedded:
            model_arg = default_model_path(announce=False)
        # rank 0 reads the prompt (an @FILE on its own host); the launcher passes the argument on
        return run_pipelined(args, model_arg, config, lambda engine: _generate(
            args, engine, engine.model, read_prompt(prompt_arg), config, options, echo=False))
    prompt = read_prompt(prompt_arg)
    if embedded:
        model_arg = default_model_path(announce=not args.quiet)
    try:
        model = load(model_arg, max_context=args.ctx)
    except ConfigError as e:
        raise flag_error(e) from None
    return _generate(args, model, model, prompt, config, options, echo=embedded and not args.quiet and not args.chat)


def is_embedded(model_arg: str | None) -> bool:
    """No model named, or `default` where no such file is (nor default.gguf): the embedded model,
    as strata.load reads the name."""
    from strata.model_source import EMBEDDED_NAME

    return not model_arg or (model_arg == EMBEDDED_NAME and not os.path.exists(model_arg)
                             and not os.path.exists(model_arg + ".gguf"))


def _generate(args: argparse.Namespace, source, model, prompt, config, options: dict, *, echo: bool) -> int:
    """Generate on `source` (`model`, or an engine over it: the pipeline's) and print (`echo`:
    the prompt first, so the continuation reads as one text)."""
    from strata.errors import ParameterError
    from strata.generate import stream_generate
    from strata.sizes import fmt_bytes

    if args.chat:
        from strata.chat_template import chat_prompt

        prompt = model.tokenizer.encode(chat_prompt(model, prompt))  # the template holds any BOS
    if echo:
        sys.stdout.write(prompt)
    last = None
    try:
        for last in stream_generate(source, prompt, max_tokens=args.max_tokens, config=config, **options):
            sys.stdout.write(last.text)
            sys.stdout.flush()
    except ParameterError as e:  # a combination refused once the engine is known (penalties and speculation)
        raise flag_error(e) from None
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
