"""`strata` command line: one module per subcommand; this file only dispatches and reports errors."""

from __future__ import annotations

import argparse
import sys

from strata.errors import StrataError

SUBCOMMANDS = {
    "generate": "strata.cli.generate",
    "make-model": "strata.cli.make_model",
    "convert": "strata.cli.convert",
    "trace": "strata.cli.trace",
    "replay": "strata.cli.replay",
    "recall": "strata.cli.recall",
    "quality": "strata.cli.quality",
    "sweep": "strata.cli.sweep",
    "doctor": "strata.cli.doctor",
}

DESCRIPTION = """\
strata runs Mixture-of-Experts language models larger than memory: dense weights stay
resident, routed experts are paged from disk into a fixed arena of slots.

examples:
  strata generate "def fibonacci(n):"            the embedded default model
  strata generate model.gguf "Once upon" -n 64    a converted model (model.gguf + model.experts)
  strata make-model /tmp/tiny --shape tiny        write a small random test model
  strata convert ~/hf/Qwen3-30B-A3B /data/qwen3   convert a Hugging Face MoE checkpoint
  strata doctor ~/hf/Qwen3-30B-A3B                will it run here, and how fast (reads no weights)
"""


def build_parser() -> argparse.ArgumentParser:
    import importlib

    parser = argparse.ArgumentParser(
        prog="strata", description=DESCRIPTION, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    sub = parser.add_subparsers(dest="command", metavar="COMMAND")
    for name, module in SUBCOMMANDS.items():
        importlib.import_module(module).add_parser(sub, name)
    return parser


def main(argv: list[str] | None = None) -> int:
    parser = build_parser()
    args = parser.parse_args(argv)
    if not getattr(args, "run", None):
        parser.print_help()
        return 2
    try:
        return int(args.run(args) or 0)
    except StrataError as e:
        print(f"error: {e}", file=sys.stderr)
        return 2
    except KeyboardInterrupt:
        print("interrupted", file=sys.stderr)
        return 130


if __name__ == "__main__":
    sys.exit(main())
