"""The KLD of lossy PLE row types against F16 rows (strata.tools.ngram_rows_quality), on the
stand-in forward of strata.testing.ngram_rows (the lead hooks the real model's forward)."""

from __future__ import annotations

import numpy as np

from strata.formats.quant_types import QuantType
from strata.reference.ngram_rows import ResidentNgramRows
from strata.runtime.ngram_rows import StreamedNgramRows
from strata.testing.ngram_rows import StandInForward, write_synthetic_store
from strata.tools.ngram_rows_quality import row_source_kld, row_type_kld

SHAPES = {0: (3001, 64), 2: (2003, 64)}
HEADS = 8


def _forward() -> StandInForward:
    return StandInForward(widths={l: w for l, (_, w) in SHAPES.items()}, rows={l: r for l, (r, _) in SHAPES.items()},
                          heads=HEADS, seed=1)


def _tables():
    rng = np.random.default_rng(2)
    return {l: rng.standard_normal(s).astype(np.float32) for l, s in SHAPES.items()}


def test_lossy_row_types_cost_kld_in_order():
    tokens = np.random.default_rng(3).integers(0, 256, 200)
    res = {r.name: r for r in row_type_kld(_forward(), _tables(), tokens, qtypes=(QuantType.F16, QuantType.Q8_0, QuantType.Q4_0))}
    assert res["F16"].kld_mean == 0.0 and res["F16"].top1_agreement == 1.0  # the reference against itself
    assert 0 < res["Q8_0"].kld_mean < res["Q4_0"].kld_mean
    assert res["Q8_0"].positions == res["Q4_0"].positions == 200
    assert "KLD mean" in res["Q4_0"].line()


def test_row_stores_on_disk_measure_what_the_resident_rows_do(tmp_path):
    """Row stores streamed through the row cache measure what their rows held in memory do, exactly."""
    forward = _forward()
    tokens = np.random.default_rng(4).integers(0, 256, 64)
    stores = {q: write_synthetic_store(tmp_path / q.name, shapes=SHAPES, qtype=q, seed=5, shard_rows=500, scale=1.0)
              for q in (QuantType.F16, QuantType.Q4_0)}
    streamed = {q: StreamedNgramRows(s, capacity=64) for q, s in stores.items()}
    try:
        on_disk = row_source_kld(forward, streamed[QuantType.F16], {"Q4_0": streamed[QuantType.Q4_0]}, tokens)[0]
        every = {q: ResidentNgramRows({l: s.rows(l, np.arange(t.rows)) for l, t in s.tables.items()})
                 for q, s in stores.items()}  # each store's own values, read whole (a small store)
        in_memory = row_source_kld(forward, every[QuantType.F16], {"Q4_0": every[QuantType.Q4_0]}, tokens)[0]
    finally:
        for s in streamed.values():
            s.close()
    assert on_disk.kld_mean > 0 and on_disk == in_memory


def test_the_real_forward_over_row_stores_orders_the_row_types(tmp_path):
    """The made Qwen4-Exp model's own forward (model_forward), rows from stores on disk in each
    type: F16 against itself costs nothing, Q8_0 less than Q4_0 (benchmarks/ple_row_kld.py)."""
    import strata
    from strata.formats.ngram_rows_writer import write_ngram_rows
    from strata.testing.models import make_model
    from strata.tools.ngram_rows_quality import model_forward, model_tables

    made = make_model(tmp_path / "m", "qwen4", seed=1, ple_rows=QuantType.F32, ple_embed_dim=128)
    tokens = np.random.default_rng(5).integers(0, 256, 48)
    with strata.load(made.model_path) as model:
        tables = model_tables(model)
        shapes = {i: t.shape for i, t in tables.items()}
        stores = {q.name: write_ngram_rows(tmp_path / f"{q.name}.ngrams", qtype=q, shapes=shapes,
                                           pieces=tables.items())
                  for q in (QuantType.F16, QuantType.Q8_0, QuantType.Q4_0)}
        res = {r.name: r for r in row_source_kld(model_forward(model.resident_params()), stores["F16"], stores, tokens)}
    assert res["F16"].kld_max == 0.0
    assert 0 < res["Q8_0"].kld_mean < res["Q4_0"].kld_mean
