"""Cold reads for the I/O benchmarks: a file's pages dropped from the OS page cache."""

from __future__ import annotations

import os
from pathlib import Path


def drop_cache(path: Path) -> None:
    """Drop `path`'s pages from the page cache (fsync first: only clean pages are dropped), so
    the next reads go to the disk."""
    fd = os.open(path, os.O_RDONLY)
    try:
        os.fsync(fd)
        os.posix_fadvise(fd, 0, 0, os.POSIX_FADV_DONTNEED)
    finally:
        os.close(fd)
