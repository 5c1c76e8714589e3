"""The one-arena replay model: its expert side is the cache machine, its PLE side the row cache's
rules, and one shared budget holds both within its bytes."""

import numpy as np
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from strata.cache.replay import replay
from strata.cache.types import CacheConfig
from strata.errors import ArenaTooSmallError
from strata.formats.ngram_rows_file import PAGE_BYTES, store_layout
from strata.formats.quant_types import QuantType
from strata.ple_store import table_shapes
from strata.testing.models import SHAPES
from strata.testing.traces import synthetic_routing_trace
from strata.tools.one_arena import ple_pages_per_token, simulate

RECORD = 100  # bytes of a record; pages of 10 below (any sizes: only ratios and whole items matter)
PAGE = 10


def no_pages(n_tokens):
    return [[] for _ in range(n_tokens)]


@given(seed=st.integers(0, 2**16), extra=st.integers(0, 40), k=st.sampled_from([0, 3, 6]),
       combined=st.booleans())
@settings(max_examples=25, deadline=None)
def test_the_expert_side_is_the_cache_machine(seed, extra, k, combined):
    tr = synthetic_routing_trace(40, 4, 16, 3, 6, seed=seed)
    config = CacheConfig(capacity=1, n_layers=4, n_experts=16, top_k=3, prefetch_depth=k)
    cap = config.min_capacity + extra
    want = replay(CacheConfig(capacity=cap, n_layers=4, n_experts=16, top_k=3, prefetch_depth=k),
                  tr.selected, tr.guesses if k else None).totals
    # shared, the 7 pages' bytes are less than a record: the same records fit either way
    got = simulate(tr.selected, tr.guesses if k else None, no_pages(40), record_bytes=RECORD, page_bytes=PAGE,
                   budget=cap * RECORD + 7 * PAGE, ple_bytes=None if combined else 7 * PAGE, ple_layers=(),
                   prefetch_depth=k)
    assert (got.urgent_misses, got.readahead_hits, got.reads_ahead) == \
        (want.urgent_misses, want.readahead_hits, want.reads_ahead)
    assert got.bytes_read == (want.urgent_misses + want.reads_ahead) * RECORD


def one_expert_trace(n_tokens, n_layers):
    """Every token selects expert 0 at every layer: after the first token, all hits."""
    return np.zeros((n_tokens, n_layers, 1), np.int64)


def test_a_read_ahead_that_does_not_fit_stops_at_a_layer_and_the_rest_wait():
    # two PLE layers of 3 fresh pages a token; a reserve of 5 pages: the first layer's 3 (+ the
    # spare page) fit, the second's do not: its 3 pages are read at use, every token
    pages = [[[10 * t, 10 * t + 1, 10 * t + 2], [1000 + 10 * t, 1000 + 10 * t + 1, 1000 + 10 * t + 2]]
             for t in range(6)]
    sel = one_expert_trace(6, 2)
    got = simulate(sel, None, pages, record_bytes=RECORD, page_bytes=PAGE, budget=2 * RECORD + 5 * PAGE,
                   ple_bytes=5 * PAGE, ple_layers=(0, 1), prefetch_depth=0)
    assert (got.ple_pages_read, got.ple_waits) == (36, 18)
    roomy = simulate(sel, None, pages, record_bytes=RECORD, page_bytes=PAGE, budget=2 * RECORD + 7 * PAGE,
                     ple_bytes=7 * PAGE, ple_layers=(0, 1), prefetch_depth=0)
    assert (roomy.ple_pages_read, roomy.ple_waits) == (36, 0)


def test_repeated_pages_hit_while_cached():
    pages = [[[1, 2]]] * 5  # the same two pages every token
    got = simulate(one_expert_trace(5, 1), None, pages, record_bytes=RECORD, page_bytes=PAGE,
                   budget=RECORD + 3 * PAGE, ple_bytes=3 * PAGE, ple_layers=(0,), prefetch_depth=0)
    assert (got.ple_pages_read, got.ple_waits, got.urgent_misses) == (2, 0, 1)


def adversarial_trace(n_tokens, n_layers, top_k, depth):
    """No hits and no good guesses: each token selects experts the token before did not, every
    guess is wrong, so a window pins n_layers x top_k records beside K read-ahead and K in limbo
    (the expert arena's smallest, tight)."""
    sel = np.array([[[(top_k * t + j) % (4 * top_k) for j in range(top_k)] for _ in range(n_layers)]
                    for t in range(n_tokens)], np.int64)
    guesses = np.broadcast_to(np.arange(4 * top_k, 4 * top_k + depth), (n_tokens, n_layers, depth)).copy()
    return sel, guesses


@pytest.mark.parametrize("last", [False, True])
def test_one_budget_holds_a_window_and_a_token_of_pages(last):
    """A shared budget of the expert arena's smallest plus one token's pages and the read-ahead's
    spare page never fails and never waits for a page; one record less fails."""
    n_layers, top_k, depth = 4, 3, 6
    sel, guesses = adversarial_trace(30, n_layers, top_k, depth)
    pages = [[[100 * t + 10 * i + j for j in range(4)] for i in range(2)] for t in range(30)]  # fresh ones
    config = CacheConfig(capacity=1, n_layers=n_layers, n_experts=64, top_k=top_k, prefetch_depth=depth)
    smallest = config.min_capacity * RECORD + (8 + 1) * PAGE
    run = lambda budget: simulate(sel, guesses, pages, record_bytes=RECORD, page_bytes=PAGE, budget=budget,
                                  ple_bytes=None, ple_layers=(0, 2), prefetch_depth=depth, used_pages_last=last)
    got = run(smallest)
    assert got.ple_waits == 0 and got.ple_pages_read == 30 * 8
    assert got.urgent_misses == 30 * n_layers * top_k
    with pytest.raises(ArenaTooSmallError):
        run(smallest - RECORD)


def test_used_pages_last_keeps_more_records_than_plain_lru():
    """Fresh pages every token, as hashed n-grams are: sent to the LRU back once used they cost
    the records nothing; at the front they push records out."""
    tr = synthetic_routing_trace(60, 4, 16, 3, 6, seed=5)
    pages = [[[100 * t + i for i in range(6)]] for t in range(60)]
    runs = [simulate(tr.selected, tr.guesses, pages, record_bytes=RECORD, page_bytes=RECORD, budget=46 * RECORD,
                     ple_bytes=None, ple_layers=(1,), prefetch_depth=6, used_pages_last=last) for last in (False, True)]
    assert runs[1].urgent_misses < runs[0].urgent_misses
    assert runs[0].ple_pages_read == runs[1].ple_pages_read == 60 * 6


def test_pages_of_the_made_shape_fall_in_their_tables():
    cfg = SHAPES["qwen4"]
    tables = store_layout(QuantType.F16, PAGE_BYTES, table_shapes(cfg))
    tokens = np.arange(40) % 23
    pages = ple_pages_per_token(cfg, tokens, tables)
    assert len(pages) == 40 and len(pages[0]) == len(tables)
    for per_token in pages:
        for t, page_ids in zip(tables, per_token):
            assert all(t.first_page <= p < t.first_page + t.n_pages for p in page_ids)


@pytest.mark.parametrize("capacity", [9, 16, 40])
def test_the_ple_side_reads_what_the_row_cache_reads(tmp_path, capacity):
    """The model's page counts against the runtime's row cache over a real store, token by token
    as the streaming engine asks (read ahead, then each PLE layer's rows), at the smallest reserve
    the budget rule allows (one position's 8 pages + 1) and above. Below it (refused by the rule)
    the row cache reads at use in chunks and its counts part from the model's: 760 against 767
    pages here at 5 pages."""
    from strata.families.qwen4_exp import ple_layers
    from strata.runtime.ngram_rows import StreamedNgramRows
    from strata.runtime.ngram_source import ModelRowIds
    from strata.testing.ngram_rows import write_synthetic_store

    cfg = SHAPES["qwen4"].with_fields(ngram_vocab_base=1009, ple_embed_dim=512)
    store = write_synthetic_store(tmp_path / "t.ngrams", shapes=table_shapes(cfg))
    tokens = np.frombuffer(b"the cat sat on the mat; the cat sat on the hat. " * 2, np.uint8).astype(np.int64)
    hash_ids = ModelRowIds(cfg)
    cache = StreamedNgramRows(store, capacity=capacity, row_ids=hash_ids, context_tokens=2, reader="threads")
    try:
        for t in range(len(tokens)):
            ids = cache.read_ahead(tokens[:t], tokens[t:t + 1])
            for i in sorted(ids):
                cache.rows(i, ids[i])
        want = cache.stats().total.pages_read
    finally:
        cache.close()
        store.close()
    pages = ple_pages_per_token(cfg, tokens, store.tables.values())
    got = simulate(np.zeros((len(tokens), cfg.n_layers, 1), np.int64), None, pages, record_bytes=RECORD,
                   page_bytes=PAGE, budget=cfg.n_layers * RECORD + capacity * PAGE, ple_bytes=capacity * PAGE,
                   ple_layers=ple_layers(cfg), prefetch_depth=0)
    assert got.ple_pages_read == want
    assert got.ple_waits == 0
