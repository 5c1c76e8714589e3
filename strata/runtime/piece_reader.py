"""The reader pool over an expert set read in place (strata.formats.expert_pieces.PieceStore).

strata.runtime.io's ReaderPool does the scheduling (urgent before read-ahead, cancel, wait with a
timeout, completions fed back to the cache machine, the check at the moment of use); this pool
changes what one read is: the store's aligned reads of the record (`PieceStore.reads`: whole
pages around each slice of the stacked tensors, touching windows merged), each into the worker's
own page-aligned bounce buffer, the pieces then placed at their planes in the slot (Q8_0 / Q4_0
blocks split into codes and scales), the gaps between planes zeroed. O_DIRECT where every file
takes it (the bounce buffer is aligned, the windows whole pages), buffered otherwise; the first
EINVAL switches to buffered reads, once. Verification is the store's `check_record` (CRC-32 kept
from each record's first read, blocks checked finite then); the bytes counted are the bytes read.

`reader_pool_for` is the one place that picks the pool for an expert store.
"""

from __future__ import annotations

import errno
import mmap
import os
import threading

import numpy as np

from strata.errors import ExpertReadError, FormatError
from strata.formats.expert_pieces import PieceStore, Read
from strata.runtime.io import ReaderPool, ReadRequest

__all__ = ["PieceReaderPool", "reader_pool_for"]


def reader_pool_for(experts, arena, **kw) -> ReaderPool:
    """The reader pool for an expert store: a PieceReaderPool for one read in place, else the
    `.experts` file's ReaderPool (one read per record)."""
    if isinstance(experts, PieceStore):
        return PieceReaderPool(experts, arena, **kw)
    return ReaderPool(experts, arena, **kw)


class PieceReaderPool(ReaderPool):
    """A ReaderPool whose records are put together from a PieceStore's aligned reads."""

    def __init__(self, store: PieceStore, arena, **kw) -> None:
        self.store = store
        self._local = threading.local()  # each worker's bounce buffer
        self._fds: list[int] = []
        self._retired: list[int] = []
        super().__init__(store, arena, **kw)

    def _open(self, direct: bool) -> tuple[int, bool, str]:
        files = self.store.files
        what = f"{self.store.reads_per_record:.1f} aligned reads per record in place ({len(files)} file" \
               f"{'s' if len(files) > 1 else ''})"
        refused = getattr(self.arena, "direct_reads_refused", None)  # SlotArena's; None on other arenas
        if direct and hasattr(os, "O_DIRECT") and refused is None:
            fds = []
            try:
                for f in files:
                    fds.append(os.open(f, os.O_RDONLY | os.O_DIRECT))
                first = self.store.reads(0, 0)[0]
                os.preadv(fds[first.file], [self._bounce()[:first.length]], first.start)  # the filesystem may refuse the read
                self._fds = fds
                return -1, True, f"O_DIRECT, {what}"
            except OSError as e:
                for fd in fds:
                    os.close(fd)
                why = f"O_DIRECT refused: {e.strerror}"
        else:
            why = "off by config" if direct is False else refused or "no O_DIRECT on this system"
        self._fds = [os.open(f, os.O_RDONLY) for f in files]
        return -1, False, f"buffered, {what} ({why})"

    def _bounce(self) -> np.ndarray:
        buf = getattr(self._local, "buf", None)
        if buf is None:  # page-aligned (O_DIRECT wants aligned memory), one per worker, never freed while open
            buf = self._local.buf = np.frombuffer(mmap.mmap(-1, self.store.bounce_bytes), np.uint8)
        return buf

    def _pread(self, r: Read, window: np.ndarray) -> int:
        try:
            return os.preadv(self._fds[r.file], [window], r.start)
        except OSError as e:
            if e.errno != errno.EINVAL or not self.direct:
                raise
        with self._cv:  # O_DIRECT refused this read: buffered from now on, said once
            if self.direct:
                self.direct = False
                self.note = self.note.replace("O_DIRECT", "buffered (O_DIRECT refused a read: EINVAL)", 1)
                self._retired.extend(self._fds)  # another worker may still be reading with them
                self._fds = [os.open(f, os.O_RDONLY) for f in self.store.files]
        return os.preadv(self._fds[r.file], [window], r.start)

    def _read(self, r: ReadRequest) -> int:
        buf = self._views[r.slot]
        if buf is None:  # each slot's view is made once: the arena's memory never moves
            buf = self._views[r.slot] = self.arena.slot_buffer(r.slot)[: self.nbytes]
        store, hook, bounce = self.store, self.hook, self._bounce()
        total = 0
        try:
            if hook is not None:
                hook.before(r)
            for read in store.reads(r.layer, r.expert):
                window = bounce[:read.length]
                got = self._pread(read, window)
                if hook is not None:
                    got = hook.after(r, window, got)
                if got < read.need:
                    raise ExpertReadError(f"{self._where(r)}: short read: {got} of {read.need} bytes "
                                          f"({os.path.basename(store.files[read.file])} at {read.start})")
                store.fill(read, window, buf)
                total += read.length
        except OSError as e:
            if isinstance(e, ExpertReadError):
                raise
            raise ExpertReadError(f"{self._where(r)}: read error: {e.strerror or e}") from None
        store.zero_gaps(r.layer, buf)
        if self.verify:
            try:
                store.check_record(r.layer, r.expert, buf)
            except FormatError as e:
                raise ExpertReadError(str(e)) from None
        self.arena.publish(r.slot)
        return total

    def _where(self, r: ReadRequest) -> str:
        return (f"{self.store.path}: MoE layer {r.layer} expert {r.expert} (in place, first slice at "
                f"{self.store.record_offset(r.layer, r.expert)})")

    def close(self) -> None:
        super().close()
        fds, self._fds = self._fds + self._retired, []
        self._retired = []
        for fd in fds:
            os.close(fd)
