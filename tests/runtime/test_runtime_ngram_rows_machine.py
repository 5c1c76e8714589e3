"""The row cache as a hypothesis RuleBasedStateMachine: random prefetches, row requests in and
out of the prefetched layers, superseded windows, under random read delays. Invariants: no page in
two slots, no slot for two pages, at most `capacity` pages, a pinned page is resident and never a
victim, a page still reading is never a victim; and every row returned equals the store's."""

from __future__ import annotations

import tempfile

import numpy as np
from hypothesis import settings, strategies as st
from hypothesis.stateful import RuleBasedStateMachine, invariant, rule

from strata.formats.quant_types import QuantType
from strata.runtime.advised_reader import advice_available
from strata.runtime.ngram_rows import StreamedNgramRows
from strata.testing.faults import RandomDelays
from strata.testing.ngram_rows import write_synthetic_store
from tests.strategies import ngram_row_ids

SHAPES = {0: (900, 64), 3: (500, 128)}  # F16: 32 and 16 rows a page; 29 + 32 pages
_STORE = None


def _store():
    global _STORE
    if _STORE is None:
        _STORE = write_synthetic_store(tempfile.mkdtemp(prefix="strata-rows-") + "/m.ngrams", shapes=SHAPES,
                                       qtype=QuantType.F16, shard_rows=128)
        _STORE.every = {l: _STORE.rows(l, np.arange(t.rows)) for l, t in _STORE.tables.items()}
    return _STORE


class RowCacheMachine(RuleBasedStateMachine):
    reader = "threads"

    def __init__(self) -> None:
        super().__init__()
        self.store = _store()
        self.cache = StreamedNgramRows(self.store, capacity=12, threads=2, hook=RandomDelays(seed=1, max_ms=0.3),
                                       reader=self.reader)

    def teardown(self) -> None:
        self.cache.close()

    @rule(data=st.data(), layers=st.sets(st.sampled_from(sorted(SHAPES)), max_size=2))
    def prefetch(self, data, layers):
        self.cache.prefetch({l: data.draw(ngram_row_ids(SHAPES[l][0], max_ids=6)) for l in layers})

    @rule(data=st.data(), layer=st.sampled_from(sorted(SHAPES)))
    def rows(self, data, layer):
        ids = data.draw(ngram_row_ids(SHAPES[layer][0]))
        np.testing.assert_array_equal(self.cache.rows(layer, ids), self.store.every[layer][ids])

    @invariant()
    def slots_are_a_bijection(self):
        c = self.cache
        used = list(c._slot_of.values())
        assert len(used) == len(set(used)) <= c.capacity
        assert not set(used) & set(c._free) and len(used) + len(c._free) == c.capacity

    @invariant()
    def victims_are_unpinned_and_read(self):
        c = self.cache
        for p in c._lru:
            assert p in c._slot_of and p not in c._pins and p not in c._ticket
        for p in c._pins:
            assert p in c._slot_of and p not in c._lru
        for p in c._limbo:
            assert p in c._ticket and p not in c._lru and p not in c._pins


class AdvisedRowCacheMachine(RowCacheMachine):
    reader = "advise"


# the profile's example count (tests/conftest.py), capped: each example opens a reader and its
# steps wait on real (delayed) reads
_SETTINGS = settings(settings.default, max_examples=min(settings.default.max_examples, 40), stateful_step_count=25)
TestRowCache = RowCacheMachine.TestCase
TestRowCache.settings = _SETTINGS
if advice_available():
    TestAdvisedRowCache = AdvisedRowCacheMachine.TestCase
    TestAdvisedRowCache.settings = _SETTINGS
