"""The PLE row cache (strata.runtime.ngram_rows): streamed rows bit-identical to resident ones,
the exact read-ahead's waits under injected read delays, its counters, read errors, the budget
term and the report's fields. Peak memory: tests/runtime/test_runtime_ngram_rows_memory.py."""

from __future__ import annotations

import time

import numpy as np
import pytest

from strata.config import Config
from strata.errors import ConfigError, RowReadError
from strata.formats.ngram_row_types import ROW_TYPES, decode_rows, encode_rows
from strata.formats.ngram_rows_writer import write_ngram_rows
from strata.formats.quant_types import QuantType
from strata.reference.ngram_rows import ResidentNgramRows
from strata.runtime.budget import plan_arena
from strata.runtime.ngram_budget import DEFAULT_CACHE_POSITIONS, open_row_cache, plan_row_cache
from strata.runtime.advised_reader import AdvisedReader, advice_available
from strata.runtime.page_reader import PageReader
from strata.runtime.ngram_rows import StreamedNgramRows
from strata.runtime.report import build_report
from strata.testing.faults import Faults, FixedDelay, RandomDelays
from tests.budgets import PLE_WAIT_LOADED_S, PLE_WAIT_SLACK_S

SHAPES = {1: (5000, 64), 3: (4001, 64), 4: (3000, 32)}  # PLE layer -> (rows, width)
READERS = ["threads", "advise"] if advice_available() else ["threads"]
HEADS = 6


def _tables(seed: int = 0) -> dict[int, np.ndarray]:
    rng = np.random.default_rng(seed)
    return {l: rng.standard_normal(s).astype(np.float32) for l, s in SHAPES.items()}


def _store(tmp_path, qtype=QuantType.F16, tables=None):
    tables = _tables() if tables is None else tables
    return write_ngram_rows(tmp_path / f"m.{qtype.name}", qtype=qtype, shapes=SHAPES,
                            pieces=((l, t[a:a + 700]) for l, t in tables.items() for a in range(0, len(t), 700)))


def _resident(qtype, tables) -> ResidentNgramRows:
    """The resident source over the same stored rows (a lossy type's dequantized values)."""
    return ResidentNgramRows({l: decode_rows(qtype, encode_rows(qtype, t), t.shape[1]) for l, t in tables.items()})


def _stand_in_ids(tokens: np.ndarray, layer: int) -> np.ndarray:
    """A stand-in n-gram hash (the model's is strata.reference.ngram_hash): HEADS ids per token
    from it and the token before. Shapes: [T] -> [T, HEADS]"""
    prev = np.concatenate([[0], tokens[:-1]])
    mixed = tokens[:, None] * 1_000_003 + prev[:, None] * 7919 + np.arange(HEADS) * 104_729 + layer * 31
    return mixed % SHAPES[layer][0]


@pytest.mark.parametrize("reader", READERS)
@pytest.mark.parametrize("qtype", ROW_TYPES)
@pytest.mark.parametrize("capacity", [2, 40, 100_000])
def test_streamed_rows_are_bit_identical_to_resident(tmp_path, qtype, capacity, reader):
    """Decode windows (prefetch, then each PLE layer in order), windows without a prefetch, a
    prompt-sized request, repeated tokens (hits), a capacity below one token's pages (prefetch
    stops, layers read at use) and random read delays (completion orders)."""
    tables = _tables()
    resident = _resident(qtype, tables)
    rng = np.random.default_rng(capacity)
    text = rng.integers(0, 50, 400)  # a small vocabulary: n-grams repeat
    with _store(tmp_path, qtype, tables) as store, \
            StreamedNgramRows(store, capacity=capacity, threads=3, hook=RandomDelays(seed=capacity, max_ms=0.5),
                              reader=reader) as rows:
        for t in range(1, 60):
            ids = {l: _stand_in_ids(text[: t + 1], l)[-1:] for l in SHAPES}
            if t % 7:
                rows.prefetch(ids)
            for l in SHAPES:
                got = rows.rows(l, ids[l])
                assert got.dtype == np.float32 and got.shape == (1, HEADS, SHAPES[l][1])
                assert np.array_equal(got, resident.rows(l, ids[l]))
        prompt = {l: _stand_in_ids(text, l) for l in SHAPES}  # [400, HEADS]: more pages than a small cache
        rows.prefetch(prompt, positions=len(text))
        for l in SHAPES:
            assert np.array_equal(rows.rows(l, prompt[l]), resident.rows(l, prompt[l]))


def test_counters(tmp_path):
    with _store(tmp_path) as store, StreamedNgramRows(store, capacity=1000) as rows:
        ids = {l: np.array([[0, 1, 2, 600, 601, 1200]]) for l in SHAPES}  # F16 64 wide: 32 rows a page
        rows.prefetch(ids)
        for l in SHAPES:
            rows.rows(l, ids[l])
        first = rows.last_window()
        for l in SHAPES:
            c = first[l]  # three pages, all read now (64 wide: 32 rows a page, pages 0, 18, 37; 32 wide: 0, 9, 18)
            assert (c.rows_read, c.rows_hit, c.pages_read, c.bytes_read) == (6, 0, 3, 3 * store.page_bytes)
        rows.prefetch(ids)  # the same token again: every page cached
        for l in SHAPES:
            rows.rows(l, ids[l])
        assert all((c.rows_read, c.rows_hit, c.pages_read, c.wait_s) == (0, 6, 0, 0.0) for c in rows.last_window().values())
        rows.prefetch({1: np.array([[3, 4000]])})  # page 0 cached, page 125 not
        got = rows.rows(1, np.array([[3, 4000]]))
        assert got.shape == (1, 2, 64)
        c = rows.last_window()[1]
        assert (c.rows_read, c.rows_hit, c.pages_read) == (1, 1, 1)
        total = rows.stats()
        assert total.positions == 3 and total.total.rows_read == 19 and total.total.rows_hit == 19
        assert total.total.bytes_read == 10 * store.page_bytes
        assert total.minus(total).total.rows_read == 0


def test_no_ids_no_rows(tmp_path):
    with _store(tmp_path) as store, StreamedNgramRows(store, capacity=8) as rows:
        assert rows.rows(3, np.zeros((0, HEADS), np.int64)).shape == (0, HEADS, 64)
        assert store.rows(4, np.zeros(0, np.int64)).shape == (0, 32)


def test_without_prefetch_rows_read_at_use(tmp_path):
    with _store(tmp_path) as store, StreamedNgramRows(store, capacity=8) as rows:
        ids = np.arange(0, 5000, 100)  # 50 pages through an 8-page cache: chunks of free slots
        assert np.array_equal(rows.rows(1, ids), store.rows(1, ids))
        c = rows.last_window()[1]
        assert (c.rows_read, c.pages_read) == (50, 50)


# ---------------------------------------------------------------- the exact read-ahead

LAYERS = 6  # a stand-in model: layers 1, 3 and 4 are PLE layers (SHAPES)
# each layer's compute: long beside the scheduler's jitter on a loaded machine (budgets.PLE_WAIT_LOADED_S)
LAYER_S = 0.2


def _token_loop(rows: StreamedNgramRows, tokens: np.ndarray, *, read_ahead: bool) -> list[dict[int, float]]:
    """The engine's order for each token: every PLE layer's reads before layer 0, then the
    layers, each PLE layer taking its rows. Returns each token's wait per PLE layer."""
    waits = []
    for t in range(1, len(tokens)):
        ids = {l: _stand_in_ids(tokens[: t + 1], l)[-1:] for l in SHAPES}
        rows.prefetch(ids if read_ahead else {})  # without the read-ahead only a new window: no reads
        for layer in range(LAYERS):
            if layer in SHAPES:
                rows.rows(layer, ids[layer])
            time.sleep(LAYER_S)
        waits.append({l: c.wait_s for l, c in rows.last_window().items()})
    return waits


def _delayed(store, delay_s: float, reader: str) -> StreamedNgramRows:
    """A cache whose every read takes `delay_s`, all of a token's reads at once: a thread and a job
    per page (threads), or the latency counted from the kernel's request (advise)."""
    delay = FixedDelay(1e3 * delay_s)
    if reader == "threads":
        return StreamedNgramRows(store, capacity=1000, threads=3 * HEADS, pages_per_job=1, hook=delay, reader=reader)
    return StreamedNgramRows(store, capacity=1000, reader=reader, latency=delay.latency_s)


@pytest.mark.parametrize("reader", READERS)
@pytest.mark.parametrize("delay_s", [0.6 * LAYER_S, 4 * LAYER_S])
def test_ple_wait_at_each_ple_layer_under_read_delays(tmp_path, delay_s, reader):
    """Every read takes `delay_s`, all of a token's reads at once (`_delayed`: the disk's queue is
    deep enough). The first PLE layer (1) has one layer's compute before it:
    with the delay shorter than that every PLE layer waits nothing; with a longer one layer 1
    waits the delay less that layer, and the later PLE layers nothing (their reads ran beside)."""
    tokens = np.arange(0, 40, 10)  # distinct tokens: every layer reads
    with _store(tmp_path) as store, _delayed(store, delay_s, reader) as rows:
        waits = _token_loop(rows, tokens, read_ahead=True)
        assert all(c.pages_read > 0 for c in rows.last_window().values())
    before_first = 1 * LAYER_S  # layer 0 computes while the reads run
    for w in waits:
        unhidden = max(0.0, delay_s - before_first)
        # from above a loaded host adds its threads' wake-ups (PLE_WAIT_LOADED_S), still short of
        # the whole delay that no read-ahead would wait
        assert unhidden - PLE_WAIT_SLACK_S <= w[1] <= unhidden + PLE_WAIT_LOADED_S, (w, unhidden)
        assert unhidden == 0.0 or w[1] < delay_s - PLE_WAIT_SLACK_S, (w, delay_s)
        assert w[3] <= PLE_WAIT_SLACK_S and w[4] <= PLE_WAIT_SLACK_S, w


@pytest.mark.parametrize("reader", READERS)
def test_without_the_read_ahead_every_ple_layer_waits_the_delay(tmp_path, reader):
    """The control: the same loop reading at use waits the whole delay at every PLE layer."""
    delay_s = 0.6 * LAYER_S
    with _store(tmp_path) as store, _delayed(store, delay_s, reader) as rows:
        waits = _token_loop(rows, np.arange(0, 30, 10), read_ahead=False)
    for w in waits:  # at least the delay at every PLE layer: nothing hid it (a loaded host only adds)
        assert all(w[l] >= delay_s - PLE_WAIT_SLACK_S for l in SHAPES), w


# ---------------------------------------------------------------- read errors


@pytest.mark.parametrize("reader", READERS)
def test_a_corrupt_page_is_one_line_where_its_rows_are_used(tmp_path, reader):
    with _store(tmp_path) as store:
        t = store.tables[3]
        hook = Faults(corrupt={(3, 2)})
        with StreamedNgramRows(store, capacity=100, hook=hook, reader=reader) as rows:
            bad = np.array([2 * t.rows_per_page + 5])
            rows.prefetch({3: bad})
            rows.rows(1, np.array([0]))  # another layer is unaffected
            with pytest.raises(RowReadError) as e:
                rows.rows(3, bad)
            msg = str(e.value)
            assert "\n" not in msg and "checksum mismatch in layer 3 page 2" in msg
            assert f"offset {store.page_offset(t.first_page + 2)}" in msg
            hook.corrupt.clear()  # the disk heals: the failed page was dropped, so it is read again
            assert np.array_equal(rows.rows(3, bad), store.rows(3, bad))


@pytest.mark.parametrize("reader", READERS)
def test_a_failed_read_no_layer_uses_raises_nothing(tmp_path, reader):
    with _store(tmp_path) as store, StreamedNgramRows(store, capacity=100, hook=Faults(eio={(4, 0)}),
                                                      reader=reader) as rows:
        rows.prefetch({4: np.array([0])})  # a window superseded before layer 4 ran
        time.sleep(0.05)
        rows.prefetch({1: np.array([0])})
        rows.rows(1, np.array([0]))
        with pytest.raises(RowReadError, match="layer 4 page 0 at offset .*: read error"):
            rows.rows(4, np.array([1]))


# ---------------------------------------------------------------- budget and report


def test_the_row_cache_is_the_ple_reserve_of_the_budget(tmp_path):
    with _store(tmp_path) as store:
        per_position = HEADS * len(SHAPES)
        plan = plan_row_cache(Config(), store, rows_per_position=per_position)
        assert plan.pages == min(DEFAULT_CACHE_POSITIONS * per_position, store.n_pages) + 1
        plan = plan_row_cache(Config(ple_reserve="1MiB"), store, rows_per_position=per_position)
        assert plan.pages == 256 and plan.nbytes == 1 << 20
        with pytest.raises(ConfigError, match=r"^ple_reserve 40kB holds 9 pages .* needs 19 .*ple_reserve='1MiB' or more$"):
            plan_row_cache(Config(ple_reserve="40kB"), store, rows_per_position=per_position)
    common = dict(config=Config(keep="0", backend="numpy"), slot_bytes=1000, total_experts=10**6, min_slots=1,
                  dense_bytes=0, available=10_000_000, total=10**9)
    assert plan_arena(**common).slots == 10_000
    with_rows = plan_arena(**common, ple_bytes=plan.nbytes)
    assert with_rows.slots == (10_000_000 - plan.nbytes) // 1000 and "ple 1.05 MB" in with_rows.reason


def test_open_row_cache_follows_the_config(tmp_path):
    config = Config(ple_reserve="1MiB", io_threads=3, verify_reads=False, io_timeout=5.0)
    with _store(tmp_path) as store:
        rows, plan = open_row_cache(store, config, rows_per_position=HEADS * len(SHAPES), reader="threads")
        with rows:
            assert rows.capacity == plan.pages == 256 and len(rows.reader._workers) == 3
            assert not rows.reader.verify and rows.reader.timeout == 5.0
        rows, _ = open_row_cache(store, config, rows_per_position=HEADS * len(SHAPES))
        with rows:  # the default reader: the kernel's read-ahead where posix_fadvise exists
            assert isinstance(rows.reader, AdvisedReader if advice_available() else PageReader)
            assert not rows.reader.verify


def test_the_stream_report_carries_ple_rows_per_token(tmp_path):
    with _store(tmp_path) as store, StreamedNgramRows(store, capacity=100) as rows:
        for t in range(4):
            ids = {l: np.array([[t * 64, t * 64 + 1]]) for l in SHAPES}
            rows.prefetch(ids)
            for l in SHAPES:
                rows.rows(l, ids[l])
        stats = rows.stats()
    decode = dict(lookups=0, hits=0, readahead_hits=0, urgent_misses=0, reads_issued=0, late_readaheads=0,
                  urgent_misses_by_rank=(), reads_cancelled=0)
    common = dict(decode=decode, seconds=1.0, host_s=0, waiting_s=0, after_s=0, slot_bytes=4096, arena_slots=1, io="")
    rep = build_report(tokens=4, **common, **stats.report_args())
    assert rep.ple_rows_read_per_token == 6 and rep.ple_rows_hit_per_token == 0
    assert rep.ple_bytes_per_token == 3 * store.page_bytes and "ple rows read 6.0/token, hit 0.0/token" in rep.text()
    plain = build_report(tokens=4, **common)  # a model without PLE: zeros, and no clause
    assert plain.ple_rows_read_per_token == plain.ple_bytes_per_token == plain.ple_wait_ms_per_token == 0
    assert "ple" not in plain.text() and plain.to_dict()["ple_rows_hit_per_token"] == 0
