"""The reader pool over a checkpoint's shards: one expert = one read per piece, in place.

strata.runtime.io's ReaderPool does the scheduling (urgent before read-ahead, cancel, wait with a
timeout, completions fed back to the cache machine, the check at the moment of use); this pool
only changes what one read is: each piece of the expert (strata.tier2.expert_tensors) preadd from
its shard into the slot's piece buffer, buffered (safetensors pieces are not 4096-aligned); from
a records file (strata.tier2.records), one preadv of the whole record into every piece buffer.

Verification: a safetensors shard carries no checksums, so the first read of each expert records
the CRC-32 of its bytes and every later read of it must match (a file changed or torn under a
run is caught where it is read); short reads and I/O errors are refused as for `.experts` files.
"""

from __future__ import annotations

import os
import threading

from strata.errors import ExpertReadError
from strata.formats.checksum import checksum_update
from strata.runtime.io import ReaderPool, ReadRequest
from strata.tier2.arena import PieceArena
from strata.tier2.expert_tensors import ExpertTensors

__all__ = ["ShardReaderPool"]


class ShardReaderPool(ReaderPool):
    """A ReaderPool whose records are experts of stacked safetensors tensors."""

    def __init__(self, tensors: ExpertTensors, arena: PieceArena, **kw) -> None:
        self.tensors = tensors
        self._crc: dict[tuple[int, int], int] = {}  # (layer, expert) -> CRC-32 of its first read
        self._crc_lock = threading.Lock()
        self._shard_fds: list[int] = []
        kw["direct"] = False
        super().__init__(tensors, arena, **kw)

    def _open(self, direct: bool) -> tuple[int, bool, str]:
        self._shard_fds = [os.open(p, os.O_RDONLY) for p in self.tensors.read_files]
        if self.tensors.records is not None:
            return -1, False, f"buffered reads of aligned records, one per expert ({self.tensors.records.name})"
        return -1, False, "buffered reads in place from the checkpoint's safetensors shards"

    def _read(self, r: ReadRequest) -> None:
        hook, fds = self.hook, self._shard_fds
        bufs = self.arena.piece_buffers(r.slot, r.layer)
        crc = got_all = 0
        try:
            if hook is not None:
                hook.before(r)
            ranges = self.tensors.piece_ranges(r.layer, r.expert)
            if self.tensors.records is not None:  # the pieces are back to back: one read fills every buffer
                reads = [(bufs, (0, ranges[0][1], sum(n for _, _, n in ranges)))]
            else:
                reads = [([b], rng) for b, rng in zip(bufs, ranges)]
            for group, (shard, offset, nbytes) in reads:
                got = os.preadv(fds[shard], group, offset)
                if hook is not None:
                    got = hook.after(r, group[0], got)
                if got != nbytes:
                    raise ExpertReadError(f"{self._where(r)}: short read: {got} of {nbytes} bytes "
                                          f"({self.tensors.read_files[shard].name} at {offset})")
                got_all += got
                if self.verify:
                    for b in group:
                        crc = checksum_update(b, crc)
        except OSError as e:
            if isinstance(e, ExpertReadError):
                raise
            raise ExpertReadError(f"{self._where(r)}: read error: {e.strerror or e}") from None
        if self.verify:
            with self._crc_lock:
                first = self._crc.setdefault((r.layer, r.expert), crc)
            if crc != first:
                raise ExpertReadError(f"{self._where(r)}: checksum mismatch: crc32 {crc:#010x}, its first read "
                                      f"gave {first:#010x} (the file changed under the run?)")
        self.arena.publish(r.slot)

    def close(self) -> None:
        super().close()
        fds, self._shard_fds = self._shard_fds, []
        for fd in fds:
            os.close(fd)
