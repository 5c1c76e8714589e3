"""The reader pool: bytes land in the right slot, urgent first, cancellation, waits that end,
and every failure (EIO, short read, checksum mismatch, a stuck read) is a clear error."""

import threading
import time

import pytest

from strata.errors import ExpertReadError
from strata.formats.experts_file import ExpertsFile, checksum
from strata.numpy_backend.arena import NumpyArena
from strata.runtime.io import ReaderPool
from strata.testing.faults import Faults, RandomDelays
from strata.testing.models import make_model


@pytest.fixture(scope="module")
def xf(tmp_path_factory):
    made = make_model(tmp_path_factory.mktemp("io") / "tiny", "tiny", seed=1)
    f = ExpertsFile.open(made.experts_path)
    yield f
    f.close()


def _pool(xf, capacity=8, **kw):
    arena = NumpyArena(capacity, xf.header.padded_bytes)
    return arena, ReaderPool(xf, arena, **kw)


def _holds(xf, arena, slot, layer, expert):
    rec = arena.slot_buffer(slot)[: xf.header.record_bytes]
    return checksum(rec) == xf.checksum(layer, expert)


def test_reads_land_in_their_slots_and_complete(xf):
    arena, pool = _pool(xf, threads=3, hook=RandomDelays(seed=5, max_ms=3))
    try:
        keys = [(l, e) for l in range(2) for e in (1, 5, 9, 12)]
        for t, (l, e) in enumerate(keys, start=1):
            pool.submit(t, t - 1, l, e, urgent=t % 2 == 0)
        pool.wait(range(1, len(keys) + 1))
        for t, (l, e) in enumerate(keys, start=1):
            pool.check(t - 1, t, l, e)
            assert _holds(xf, arena, t - 1, l, e)
        assert sorted(pool.completed()) == [(t - 1, t) for t in range(1, len(keys) + 1)]
        assert pool.completed() == []
    finally:
        pool.close()


class _Gate:
    """Holds the first read until released; records the order reads start in."""

    def __init__(self):
        self.release, self.started = threading.Event(), []

    def before(self, req):
        self.started.append(req.ticket)
        if req.ticket == 1:
            self.release.wait(5)

    def after(self, req, buf, got):
        return got


def test_urgent_reads_go_before_queued_read_aheads(xf):
    gate = _Gate()
    arena, pool = _pool(xf, threads=1, hook=gate)
    try:
        pool.submit(1, 0, 0, 0, urgent=True)  # occupies the only worker
        time.sleep(0.05)
        pool.submit(2, 1, 0, 1, urgent=False)
        pool.submit(3, 2, 0, 2, urgent=False)
        pool.submit(4, 3, 0, 3, urgent=True)
        gate.release.set()
        pool.wait([1, 2, 3, 4])
        assert gate.started == [1, 4, 2, 3]
    finally:
        pool.close()


def test_cancel_drops_a_queued_read_and_reports_it_done(xf):
    gate = _Gate()
    arena, pool = _pool(xf, threads=1, hook=gate)
    try:
        pool.submit(1, 0, 0, 0, urgent=True)
        time.sleep(0.05)
        pool.submit(2, 1, 1, 3, urgent=False)
        assert pool.cancel(2)
        assert not pool.cancel(1)  # running: it completes
        gate.release.set()
        pool.wait([1, 2])
        assert 2 not in gate.started
        assert sorted(pool.completed()) == [(0, 1), (1, 2)]
        with pytest.raises(ExpertReadError, match="was cancelled"):
            pool.check(1, 2, 1, 3)
    finally:
        pool.close()


@pytest.mark.parametrize("fault, verify, message", [
    (dict(eio={(1, 7)}), False, "read error"),
    (dict(short={(1, 7)}), False, "short read"),
    (dict(corrupt={(1, 7)}), True, "checksum mismatch"),
])
def test_a_failed_read_raises_at_use_naming_layer_expert_offset(xf, fault, verify, message):
    arena, pool = _pool(xf, threads=2, verify=verify, hook=Faults(**fault))
    try:
        pool.submit(1, 4, 1, 7, urgent=True)
        pool.wait([1])
        offset = xf.record_offset(1, 7)
        with pytest.raises(ExpertReadError, match=f"layer 1 expert 7 at offset {offset}: {message}"):
            pool.check(4, 1, 1, 7)
    finally:
        pool.close()


def test_corruption_without_verification_is_not_detected_by_the_pool(xf):
    arena, pool = _pool(xf, threads=1, verify=False, hook=Faults(corrupt={(0, 2)}))
    try:
        pool.submit(1, 0, 0, 2, urgent=True)
        pool.wait([1])
        pool.check(0, 1, 0, 2)  # verify_reads is the switch that catches this
        assert not _holds(xf, arena, 0, 0, 2)
    finally:
        pool.close()


class _Stuck:
    def before(self, req):
        time.sleep(1.0)

    def after(self, req, buf, got):
        return got


def test_a_stuck_read_is_an_error_not_a_hang(xf):
    arena, pool = _pool(xf, threads=1, timeout=0.2, hook=_Stuck())
    try:
        pool.submit(1, 0, 1, 1, urgent=True)
        start = time.perf_counter()
        with pytest.raises(ExpertReadError, match="layer 1 expert 1 .* did not complete within 0.2 s"):
            pool.wait([1])
        assert time.perf_counter() - start < 1.0
    finally:
        pool.close()


def test_check_refuses_a_slot_holding_another_expert(xf):
    arena, pool = _pool(xf, threads=1)
    try:
        pool.submit(1, 0, 0, 4, urgent=True)
        pool.wait([1])
        with pytest.raises(ExpertReadError, match="should hold layer 0 expert 5"):
            pool.check(0, 1, 0, 5)
    finally:
        pool.close()


def test_buffered_reads_when_direct_io_is_off(xf):
    arena, pool = _pool(xf, threads=1, direct=False)
    try:
        assert not pool.direct and "buffered" in pool.note
        pool.submit(1, 2, 1, 15, urgent=False)
        pool.wait([1])
        assert _holds(xf, arena, 2, 1, 15)
    finally:
        pool.close()


def test_buffered_reads_where_the_arena_refuses_direct_ones(xf):
    """An arena whose memory must not take O_DIRECT reads (MLX's on CUDA) gets buffered ones,
    with its reason in the pool's note, whatever `direct` asks."""
    arena = NumpyArena(8, xf.header.padded_bytes)
    arena.direct_reads_refused = "this memory takes no DMA"
    pool = ReaderPool(xf, arena, threads=1, direct=True)
    try:
        assert not pool.direct and pool.note == "buffered reads (this memory takes no DMA)"
        pool.submit(1, 3, 0, 7, urgent=True)
        pool.wait([1])
        assert _holds(xf, arena, 3, 0, 7)
    finally:
        pool.close()


def test_arena_slots_are_page_aligned_and_sized_by_record():
    arena = NumpyArena(5, 3 * 4096)
    for s in range(5):
        buf = arena.slot_buffer(s)
        assert buf.__array_interface__["data"][0] % 4096 == 0
        assert buf.size == 3 * 4096 and buf.flags.writeable
    with pytest.raises(IndexError):
        arena.slot_buffer(5)
    with pytest.raises(ValueError):
        NumpyArena(2, 1000)
