"""`strata` command line: one module per subcommand; this file only dispatches and reports errors.

Every failure is one line on stderr and exit status 2: strata's own errors as they are, OS errors
(a full disk, a missing directory) with the file they concern, and anything unexpected as
"internal error" with the switch that shows its traceback (--debug or STRATA_DEBUG=1), so real
bugs stay visible to whoever looks for them."""

from __future__ import annotations

import argparse
import errno
import os
import sys

SUBCOMMANDS = {
    "generate": "strata.cli.generate",
    "chat": "strata.cli.chat",
    "serve": "strata.cli.serve",
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
  strata generate llama.gguf "Once upon"          a llama.cpp GGUF as it is (experts read in place)
  strata chat                                     chat in the terminal (history, --system, /reset)
  strata serve model.gguf --port 8000             OpenAI/Anthropic-compatible HTTP on 127.0.0.1
  strata generate model.gguf @prompt.txt          the prompt from a file (- reads standard input)
  strata make-model /tmp/tiny --shape tiny        write a small random test model
  strata convert ~/hf/Qwen3-30B-A3B /data/qwen3   convert a Hugging Face MoE checkpoint
  strata doctor ~/hf/Qwen3-30B-A3B                will it run here, and how fast (reads no weights)

sizes (--arena, --keep, replay's --caps): a number with a unit is bytes (2GB, 512MB, 1.5GiB);
a bare number or NNNslots counts arena slots (one expert each); 25% is a share of all experts.
errors are one line; --debug (or STRATA_DEBUG=1) shows the traceback of an unexpected one.
"""

DEBUG_ENV = "STRATA_DEBUG"
_OS_HINTS = {errno.ENOSPC: "the disk is full: free space or write elsewhere",
             errno.EDQUOT: "the disk quota is exceeded: free space or write elsewhere",
             errno.EACCES: "permission denied", errno.EROFS: "the file system is read-only"}


def build_parser() -> argparse.ArgumentParser:
    import importlib

    from strata import __distribution__, __version__

    parser = argparse.ArgumentParser(
        prog="strata", description=DESCRIPTION, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    parser.add_argument("--version", action="version", version=f"strata {__version__} (distribution {__distribution__})")
    parser.add_argument("--debug", action="store_true", help="show the traceback of an unexpected error")
    sub = parser.add_subparsers(dest="command", metavar="COMMAND")
    for name, module in SUBCOMMANDS.items():
        importlib.import_module(module).add_parser(sub, name)
    return parser


def _one_line(text: str) -> str:
    return " ".join(str(text).split())


def os_error_line(e: OSError) -> str:
    """One line for an OSError: the file(s) it concerns, what went wrong and, where known, the fix."""
    where = ": ".join(str(f) for f in (e.filename, e.filename2) if f is not None)
    what = _OS_HINTS.get(e.errno) or e.strerror or _one_line(e) or type(e).__name__
    return f"{where}: {what}" if where else what


def _debug_requested(argv: list[str]) -> tuple[bool, list[str]]:
    """--debug anywhere before `--` (also after the subcommand), or STRATA_DEBUG=1."""
    cut = argv.index("--") if "--" in argv else len(argv)
    debug = "--debug" in argv[:cut] or os.environ.get(DEBUG_ENV, "").strip().lower() in ("1", "true", "on", "yes")
    return debug, [a for i, a in enumerate(argv) if not (a == "--debug" and i < cut)]


def main(argv: list[str] | None = None) -> int:
    argv = list(sys.argv[1:] if argv is None else argv)
    import strata

    if getattr(strata, "__distribution__", None) != "strata-moe":  # another project's `strata` took the import
        print(f"error: the `strata` package at {os.path.dirname(strata.__file__ or '?')} is not strata-moe's "
              "(another distribution installs the same import name); fix: pip uninstall -y strata amperor-strata "
              "strata-moe && pip install strata-moe", file=sys.stderr)
        return 2
    from strata.threads import preset_environment

    preset_environment(argv)  # before numpy's first import, which the parsers below bring
    debug, argv = _debug_requested(argv)
    from strata.option_names import command_line

    try:
        with command_line():  # errors name flags, not the Python API's parameters
            return _dispatch(argv)
    except KeyboardInterrupt:
        print("interrupted", file=sys.stderr)
        return 130
    except Exception as e:
        from strata.errors import StrataError

        if debug:
            raise
        if isinstance(e, StrataError):
            line = _one_line(e)
        elif isinstance(e, OSError):
            line = os_error_line(e)
        elif isinstance(e, MemoryError):
            line = "out of memory: use a smaller --arena, or a machine with more memory"
        else:
            line = f"internal error: {type(e).__name__}: {_one_line(e)} (run with --debug or {DEBUG_ENV}=1 for the traceback)"
        print(f"error: {line}", file=sys.stderr)
        return 2


def _dispatch(argv: list[str]) -> int:
    parser = build_parser()
    args = parser.parse_args(argv)
    args.argv = list(argv)  # as given, less --debug (a launcher passes it on)
    if not getattr(args, "run", None):
        parser.print_help()
        return 2
    return int(args.run(args) or 0)


if __name__ == "__main__":
    sys.exit(main())
