"""The streaming engine reads PLE rows ahead: every window (a decoded token, a prompt chunk)
prefetches every PLE layer's rows before layer 0, with the model's row ids computed from the
tokens before the window and the window's own; the stream report carries the row traffic of the
decode windows. The made model has no PLE layer (the Qwen4-Exp model's PLE layers take their rows
from the same cache), so here the reads are issued and counted, and the logits are unchanged."""

from __future__ import annotations

import numpy as np
import pytest

import strata
from strata.config import Backend, Config
from strata.formats.quant_types import QuantType
from strata.numpy_backend.engine import streaming_parts
from strata.runtime.decode import StreamingEngine, arena_plan_for
from strata.runtime.io import ReaderPool
from strata.runtime.ngram_rows import StreamedNgramRows
from strata.testing.models import make_model
from strata.testing.ngram_rows import StandInHash, write_synthetic_store

SHAPES = {0: (4000, 64), 1: (3000, 64)}
HEADS = 4
CONFIG = Config(moce_lambda=0.0, arena="", backend=Backend.NUMPY, prefill_chunk=8)


@pytest.fixture(scope="module")
def model(tmp_path_factory):
    made = make_model(tmp_path_factory.mktemp("ple") / "tiny", "tiny", seed=3, n_experts=16)
    return strata.load(made.model_path)


class Recording(StandInHash):
    def __init__(self) -> None:
        super().__init__({l: r for l, (r, _) in SHAPES.items()}, HEADS)
        self.calls: list[tuple[list[int], list[int]]] = []

    def __call__(self, context, tokens):
        self.calls.append((list(context), list(tokens)))
        return super().__call__(context, tokens)


def _engine(model, rows=None) -> StreamingEngine:
    plan = arena_plan_for(model, CONFIG.replace(arena="100%"))
    arena, compute, notes = streaming_parts(model, CONFIG, plan)
    pool = ReaderPool(model.experts_file, arena, threads=2)
    return StreamingEngine(model, CONFIG, arena, compute, pool, notes=notes, ngram_rows=rows)


def test_every_window_reads_ahead_with_its_context(model, tmp_path):
    store = write_synthetic_store(tmp_path / "r.ngrams", shapes=SHAPES, qtype=QuantType.F16, shard_rows=1000)
    ids = Recording()
    prompt = list(range(30, 50))  # 20 tokens: chunks of 8, 8, 4
    with _engine(model) as plain:
        want = [plain.prefill(prompt)] + [plain.decode(t) for t in (7, 8, 9)]
    with _engine(model, StreamedNgramRows(store, capacity=200, row_ids=ids, context_tokens=10)) as engine:
        since = engine.ledger()
        got = [engine.prefill(prompt)] + [engine.decode(t) for t in (7, 8, 9)]
        rep = engine.report(since)
        rows = engine.ngram_rows
        assert rows.stats().positions == 23
    for g, w in zip(got, want):
        np.testing.assert_array_equal(g, w)  # the reads change nothing the model computes
    # the hash sees the last 10 tokens before each window (context_tokens), then the window
    assert ids.calls == [([], prompt[:8]), (prompt[:8], prompt[8:16]), (prompt[6:16], prompt[16:]),
                         (prompt[10:], [7]), (prompt[11:] + [7], [8]), (prompt[12:] + [7, 8], [9])]
    # decode windows only: 3 tokens, each HEADS rows of both tables prefetched (pages; no PLE layer uses them)
    pages = rep.ple_bytes_per_token / store.page_bytes
    assert 1 <= pages <= HEADS * len(SHAPES) and rep.tokens == 3
    assert f"ple rows read 0.0/token, hit 0.0/token ({rep.ple_bytes_per_token / 1e3:.2f} kB/token)" in rep.text()


def test_a_model_without_a_row_store_reports_zero(model):
    with _engine(model) as engine:
        engine.prefill([1, 2, 3])
        engine.decode(4)
        rep = engine.report()
    assert rep.ple_bytes_per_token == rep.ple_rows_read_per_token == rep.ple_wait_ms_per_token == 0
