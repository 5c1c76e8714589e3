"""The sampling, stop-string and context flags `strata generate` and `strata chat` share, and the
demo defaults: the embedded model with no sampling flag samples with the settings that keep it out
of greedy loops (strata.default_model.DEMO_SAMPLING); any sampling flag, or any other model, starts
from greedy (every filter off)."""

from __future__ import annotations

import argparse

from strata.errors import ConfigError

# flag, stream_generate's parameter, type, its greedy default, help
SAMPLING_FLAGS = (
    ("--temp", "temperature", float, 0.0, "sampling temperature; 0 is greedy"),
    ("--top-p", "top_p", float, 1.0, "nucleus sampling mass (1.0: off)"),
    ("--top-k", "top_k", int, 0, "sample among the k most probable tokens (0: off)"),
    ("--min-p", "min_p", float, 0.0, "drop tokens below min-p x the most probable one's probability (0: off)"),
    ("--repeat-penalty", "repeat_penalty", float, 1.0,
     "divide the logits of tokens seen in the last 64 (prompt included) by this (1: off; try 1.1)"),
    ("--frequency-penalty", "frequency_penalty", float, 0.0,
     "OpenAI's: lower a token's logit by this x how often it was generated ([-2, 2]; 0: off)"),
    ("--presence-penalty", "presence_penalty", float, 0.0,
     "OpenAI's: lower the logit of every token generated so far by this ([-2, 2]; 0: off)"),
)
FLAG_OF = {param: flag for flag, param, *_ in SAMPLING_FLAGS} | {"seed": "--seed", "max_tokens": "--max-tokens",
                                                                "stop": "--stop", "max_context": "--ctx"}
_ESCAPES = {"n": "\n", "t": "\t", "\\": "\\"}


def add_sampling_flags(p: argparse.ArgumentParser) -> None:
    from strata.default_model import DEMO_SAMPLING

    g = p.add_argument_group("sampling (greedy unless given; the embedded model alone samples by default: "
                             + ", ".join(f"{FLAG_OF[k]} {v:g}" for k, v in DEMO_SAMPLING.items()) + ", --seed 0)")
    for flag, param, kind, off, text in SAMPLING_FLAGS:
        g.add_argument(flag, dest=param, type=kind, default=None, help=f"{text} (default {off:g})")
    g.add_argument("--seed", type=int, default=0, help="sampling seed (default 0)")
    g.add_argument("--stop", action="append", default=[], metavar="TEXT",
                   help="end the generation where TEXT starts (not shown); repeatable; \\n and \\t are a newline "
                        "and a tab")
    g.add_argument("--ctx", type=int, default=None, metavar="N",
                   help="hold the model to N positions, prompt and generated (default: the model's context)")


def sampling_options(args: argparse.Namespace, *, demo: bool) -> dict:
    """stream_generate's sampling keywords from the flags: the demo defaults when `demo` (the
    embedded model) and no sampling flag was given, else greedy where a flag was left out."""
    from strata.default_model import DEMO_SAMPLING

    given = {param: getattr(args, param) for _, param, *_ in SAMPLING_FLAGS if getattr(args, param) is not None}
    base = dict(DEMO_SAMPLING) if demo and not given else {param: off for _, param, _, off, _ in SAMPLING_FLAGS}
    return {**base, **given, "seed": args.seed}


def check_sampling(options: dict) -> None:
    """The options' values, refused in the words of the command line (the flag, not the parameter)."""
    from strata.api_args import sampler_from

    try:
        sampler_from(**options)
    except ConfigError as e:
        raise flag_error(e) from None


def flag_error(e: Exception) -> Exception:
    """An API error whose message starts with a parameter's name, reworded with the flag's."""
    text = str(e)
    for param, flag in FLAG_OF.items():
        if text.startswith(param + ":") or text.startswith(param + " "):
            return ConfigError(flag + text[len(param):])
    return e


def stop_strings(values: list[str]) -> tuple[str, ...]:
    """--stop values with \\n, \\t and \\\\ read as a newline, a tab and a backslash."""
    out = []
    for value in values:
        text, i = [], 0
        while i < len(value):
            if value[i] == "\\" and i + 1 < len(value) and value[i + 1] in _ESCAPES:
                text.append(_ESCAPES[value[i + 1]])
                i += 2
            else:
                text.append(value[i])
                i += 1
        if not text:
            raise ConfigError("--stop: an empty stop string would end every generation at once; give some text")
        out.append("".join(text))
    return tuple(out)
