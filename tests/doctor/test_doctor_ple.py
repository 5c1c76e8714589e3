"""`strata doctor` on a PLE model (Qwen4-Exp): the n-gram tables are the row store's, not dense
weights. Resident: none of them; per token: one row per n-gram head of every PLE layer; in
memory: the row cache (ple_reserve's default) beside the arena."""

from __future__ import annotations

from strata.doctor.byte_budget import PLE_PART, PLE_ROW_TYPE, byte_budget, bytes_per_weight
from strata.doctor.families import count_strata
from strata.doctor.source import read_source
from strata.formats.quant_types import QuantType
from strata.families.qwen4_exp import ngram_heads, ple_layers
from strata.runtime.ngram_budget import DEFAULT_CACHE_POSITIONS
from strata.testing.models import SHAPES, make_model


def _ple_row(budget):
    return next(r for r in budget.rows if r.part == PLE_PART)


def test_a_row_store_model_reads_rows_per_token_not_tables(tmp_path):
    made = make_model(tmp_path / "m", "qwen4", seed=1, ple_rows=QuantType.F16, ngram_vocab_base=5003)
    src = read_source(made.model_path)
    cfg = src.counts.model_config
    heads, width = ngram_heads(cfg), cfg.qwen4.ple_embed_dim // ngram_heads(cfg)
    budget = byte_budget(src.counts)
    row = _ple_row(budget)
    assert row.resident_bytes == 0
    assert row.per_token_bytes == len(ple_layers(cfg)) * heads * width * bytes_per_weight(PLE_ROW_TYPE)
    assert budget.ple_reserve == (DEFAULT_CACHE_POSITIONS * heads * len(ple_layers(cfg)) + 1) * 4096
    assert budget.all_resident == budget.dense_resident + budget.experts_resident + budget.kv_bytes + \
        budget.ple_reserve
    assert budget.dense_per_token + budget.expert_per_token + budget.ple_per_token == budget.per_token


def test_tables_among_the_dense_weights_are_counted_the_same(tmp_path):
    """A made model with its tables in the model file: the doctor counts them as the row store's
    all the same (never as dense weights read whole per token)."""
    dense, stored = SHAPES["qwen4"], SHAPES["qwen4"].with_fields(ple_row_store=True)
    a, b = byte_budget(count_strata(dense)), byte_budget(count_strata(stored))
    assert a.rows == b.rows and a.dense_resident == b.dense_resident and a.per_token == b.per_token
