"""`strata doctor` on a PLE model (Qwen4-Exp): the n-gram tables are the row store's, not dense
weights. Resident: none of them; per token: one row per n-gram head of every PLE layer; in
memory: the row cache (ple_reserve's default) beside the arena."""

from __future__ import annotations

import math

import pytest

from strata.doctor.byte_budget import PLE_PART, PLE_ROW_TYPE, byte_budget, bytes_per_weight
from strata.doctor.families import count_strata
from strata.doctor.source import read_source
from strata.formats.gguf_file import open_gguf
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


def test_a_llama_cpp_qwen4exp_gguf_counts_its_table_as_the_row_stores(tmp_path, tmp_path_factory):
    """llama.cpp's qwen4exp file holds its n-gram table as `per_layer_token_embd`: the doctor counts it
    as the row store's part (read a row per n-gram head per token), as its conversion will, not as
    a dense weight; the same per-token rows and table as the converted model's."""
    from strata.convert import convert
    from tests import hf_qwen4_released
    from tests.gguf_qwen4exp import write_qwen4exp_gguf

    hf_dir, _ = hf_qwen4_released.cached_checkpoint(hf_qwen4_released.ARCHS[0], tmp_path_factory)
    path = write_qwen4exp_gguf(hf_dir, tmp_path / "m.gguf")
    src = read_source(path)
    converted = count_strata(convert(path, tmp_path / "out").cfg)
    c = src.counts
    assert src.kind == "gguf" and c.ple_table_values == converted.ple_table_values > 0
    assert (c.ple_rows_per_token, c.ple_row_width) == (converted.ple_rows_per_token, converted.ple_row_width)
    assert src.stored["ple rows"] == c.ple_table_values * 4  # F32 in this file
    reader = open_gguf(path)  # every value of the file: dense, experts, or the table, once
    total = sum(math.prod(t.shape) for t in reader.tensors.values())
    reader.close()
    assert c.dense_weights + c.total_experts * c.expert_weights + c.ple_table_values == total
    assert _ple_row(byte_budget(c)).resident_bytes == 0


@pytest.mark.parametrize("table, row_bytes", [("Q8_0", 34 / 32), ("IQ4_NL", 18 / 32)])
def test_a_qwen4exp_gguf_run_in_place_reads_rows_in_their_stored_type(tmp_path, tmp_path_factory, table, row_bytes):
    """`strata generate model.gguf` reads the table's rows as the file stores them, so the doctor
    prices a token's rows in that type, not in the conversion's F16."""
    from tests import hf_qwen4_released
    from tests.gguf_qwen4exp import write_qwen4exp_gguf

    hf_dir, _ = hf_qwen4_released.cached_checkpoint(hf_qwen4_released.ARCHS[0], tmp_path_factory)
    c = read_source(write_qwen4exp_gguf(hf_dir, tmp_path / "m.gguf", table=table)).counts
    row = _ple_row(byte_budget(c))
    assert c.ple_row_type == row.qtype == table
    assert row.per_token_bytes == c.ple_rows_per_token * int(c.ple_row_width * row_bytes) > 0
