"""Write a file under a temporary name and rename it into place only when complete, so an
interrupted write (an exception, Ctrl-C) leaves nothing under the final name."""

from __future__ import annotations

import contextlib
import os
from typing import Iterator


@contextlib.contextmanager
def atomic_output(path: str) -> Iterator[str]:
    """Yields `path + ".tmp"` to write; renames it over `path` on success, removes it otherwise."""
    tmp = path + ".tmp"
    try:
        yield tmp
        os.replace(tmp, path)
    except BaseException:
        with contextlib.suppress(FileNotFoundError):
            os.unlink(tmp)
        raise
