"""The lifetime of a file a reader keeps open: one descriptor, `fileno()`, `close()` (idempotent,
also from `__del__` on a half-built object) and the context-manager protocol. The `.experts` and
`.ngrams` readers share it; each sets `self._fd` when it opens."""

from __future__ import annotations

import os


class OpenFile:
    _fd: int = -1

    def fileno(self) -> int:
        if self._fd < 0:
            raise ValueError(f"{self.path}: file is closed")
        return self._fd

    def close(self) -> None:
        fd, self._fd = self._fd, -1
        if fd >= 0:
            os.close(fd)

    def __enter__(self):
        return self

    def __exit__(self, *exc) -> None:
        self.close()

    def __del__(self) -> None:
        self.close()
