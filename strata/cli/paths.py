"""Checks of the paths a subcommand will write or read, made before any work starts (a report
path in a missing directory must not fail after the whole generation ran), and the prompt
arguments `TEXT`, `@FILE` and `-` (standard input)."""

from __future__ import annotations

import os
import sys
from pathlib import Path

from strata.errors import ConfigError

__all__ = ["check_output_path", "read_prompt"]


def check_output_path(path: str | os.PathLike, what: str, *, make_dirs: bool = False) -> Path:
    """`path` can be created or replaced: it is not a directory, and its directory exists and is
    writable (make_dirs: its nearest existing ancestor is a writable directory, for a writer
    that creates the rest). `what` names the flag or argument in the error."""
    p = Path(path)
    if p.is_dir():
        raise ConfigError(f"{what} {p}: is a directory; name a file")
    parent = p.absolute().parent
    if make_dirs:
        while not parent.exists() and parent != parent.parent:
            parent = parent.parent
    if parent.exists() and not parent.is_dir():
        raise ConfigError(f"{what} {p}: {parent} is a file, not a directory")
    if not parent.is_dir():
        raise ConfigError(f"{what} {p}: no such directory {parent} (create it first)")
    if not os.access(parent, os.W_OK | os.X_OK):
        raise ConfigError(f"{what} {p}: directory {parent} is not writable")
    return p


def _decode(data: bytes, where: str) -> str:
    try:
        return data.decode("utf-8")
    except UnicodeDecodeError as e:
        raise ConfigError(f"{where}: not valid UTF-8 (byte {e.start}: {data[e.start:e.start + 1]!r}); "
                          f"re-encode it as UTF-8") from None


def read_prompt(arg: str) -> str:
    """The prompt an argument names: `-` reads standard input, `@path` a file, `@@text` is the
    literal `@text`; anything else is the prompt itself. Text must be valid UTF-8."""
    if arg == "-":
        return _decode(sys.stdin.buffer.read(), "standard input")
    if arg.startswith("@@"):
        arg = arg[1:]
    elif arg.startswith("@"):
        p = Path(arg[1:])
        if not p.is_file():
            raise ConfigError(f"{p}: no such prompt file (a prompt that starts with @: write @@)")
        try:
            return _decode(p.read_bytes(), str(p))
        except OSError as e:
            raise ConfigError(f"{p}: cannot read: {e.strerror}") from None
    try:
        arg.encode("utf-8")
    except UnicodeEncodeError as e:  # undecodable argv bytes arrive as lone surrogates
        raise ConfigError(f"the prompt is not valid UTF-8 (character {e.start}); pass UTF-8 text, "
                          f"or a file with @FILE") from None
    return arg
