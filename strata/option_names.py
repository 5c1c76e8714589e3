"""How an error names a setting: as the interface the user called spells it.

The same refusal reaches a user of the command line (`give --arena 48slots or more`) and a user
of the Python API (`give arena='48slots' or more`: a Config field, or a function's parameter).
Code that raises calls `option(...)` for each setting it names; the command line marks its run
with `command_line()` (strata.cli.main), everything else reads as Python. A context variable,
not a global: a server's or a test's in-process CLI call marks only its own context.
"""

from __future__ import annotations

import contextlib
import contextvars
from typing import Iterator

__all__ = ["command_line", "option"]

_ON_THE_COMMAND_LINE = contextvars.ContextVar("strata_on_the_command_line", default=False)


@contextlib.contextmanager
def command_line() -> Iterator[None]:
    """Within this block, errors name settings as command-line flags."""
    token = _ON_THE_COMMAND_LINE.set(True)
    try:
        yield
    finally:
        _ON_THE_COMMAND_LINE.reset(token)


def option(name: str, value: object = None, *, python: str | None = None) -> str:
    """The setting `name` (a Config field, or a flag's name with '_' for '-'), with `value` if
    given: `--name value` on the command line (a True switch: `--name`), `name='value'` in Python. `python`: the Python
    spelling where it is not the field's (a function parameter of another name)."""
    if _ON_THE_COMMAND_LINE.get():
        flag = "--" + name.replace("_", "-")
        if value is True:  # a switch: the bare flag
            return flag
        return flag if value is None else f"{flag} {value}"
    spelled = python or name
    return spelled if value is None else f"{spelled}={value!r}"
