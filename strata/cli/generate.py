"""`strata generate [MODEL] PROMPT`: print the generated text, then a one-line summary."""

from __future__ import annotations

import argparse
import sys

from strata.cli.runtime_flags import add_runtime_flags, config_from_args, print_report

HELP = """\
Generate text. With one positional argument it is the prompt and the embedded default model
is used; with two, the first is a model (`name.gguf`, its experts in `name.experts`).
Greedy by default (--temp 0); --seed makes sampled runs reproducible. --chat wraps the prompt
as one user turn in the model's chat template (converted models keep their checkpoint's)."""


def add_parser(sub, name: str) -> None:
    p = sub.add_parser(name, help="generate text from a prompt", description=HELP,
                       formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("args", nargs="+", metavar="[MODEL] PROMPT", help="optional model path, then the prompt")
    p.add_argument("-n", "--max-tokens", type=int, default=100, help="tokens to generate (default 100)")
    p.add_argument("--temp", type=float, default=0.0, help="sampling temperature; 0 is greedy (default)")
    p.add_argument("--top-p", type=float, default=1.0, help="nucleus sampling mass (default 1.0: off)")
    p.add_argument("--seed", type=int, default=0, help="sampling seed (default 0)")
    p.add_argument("--chat", action="store_true", help="apply the model's chat template to the prompt")
    p.add_argument("--quiet", action="store_true", help="print only the generated text")
    add_runtime_flags(p)
    p.set_defaults(run=run)


def run(args: argparse.Namespace) -> int:
    from strata.default_model import default_model_path
    from strata.errors import StrataError
    from strata.generate import stream_generate
    from strata.loader import load

    if len(args.args) > 2:
        raise StrataError(f"expected [MODEL] PROMPT, got {len(args.args)} arguments (quote the prompt)")
    model_arg, prompt = (args.args if len(args.args) == 2 else (None, args.args[0]))
    config = config_from_args(args)
    model = load(model_arg if model_arg else default_model_path(announce=not args.quiet))
    if args.chat:
        from strata.chat_template import chat_prompt

        prompt = model.tokenizer.encode(chat_prompt(model, prompt))  # the template holds any BOS
    last = None
    for last in stream_generate(model, prompt, max_tokens=args.max_tokens, temperature=args.temp,
                                top_p=args.top_p, seed=args.seed, config=config):
        sys.stdout.write(last.text)
        sys.stdout.flush()
    sys.stdout.write("\n")
    if last is not None and not args.quiet:
        print(
            f"[{last.prompt_tokens} prompt tokens at {last.prompt_tps:.1f} tok/s, "
            f"{last.generation_tokens} generated at {last.generation_tps:.1f} tok/s, "
            f"finish: {last.finish_reason}]",
            file=sys.stderr,
        )
    print_report(args, last, sys.stderr)
    return 0
