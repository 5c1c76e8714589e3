"""A PLE model's row store beside its model file (strata/ple_store.py): opened by strata.load,
refused in one line when missing, foreign or shaped for another config."""

from __future__ import annotations

import pytest

import strata
from strata.errors import FormatError
from strata.formats.quant_types import QuantType
from strata.ple_store import ngrams_path_for, open_ngram_store, table_shapes
from strata.testing.models import SHAPES, make_model
from strata.testing.ngram_rows import write_synthetic_store


@pytest.fixture(scope="module")
def made(tmp_path_factory):
    return make_model(tmp_path_factory.mktemp("store") / "m", "qwen4", seed=1, ple_rows=QuantType.F16)


def test_load_opens_the_store_and_the_model_file_has_no_table(made):
    with strata.load(made.model_path) as model:
        assert model.cfg.qwen4.ple_row_store and model.ngrams_file.path == str(ngrams_path_for(made.model_path))
        assert {l: (t.rows, t.width) for l, t in model.ngrams_file.tables.items()} == table_shapes(model.cfg)
        assert not any(k.endswith("ple_ngram.weight") for k in model.dense)


def test_a_store_for_another_config_is_refused_in_one_line(made, tmp_path):
    other = SHAPES["qwen4"].with_fields(ngram_vocab_base=211, ple_row_store=True)  # other primes: other rows
    wrong = write_synthetic_store(tmp_path / "w.ngrams", shapes=table_shapes(other))
    wrong.close()
    with pytest.raises(FormatError, match="holds tables") as err:
        open_ngram_store(made.cfg, made.model_path, None, path=tmp_path / "w.ngrams")
    assert "\n" not in str(err.value)


def test_a_model_without_a_row_store_opens_none(tmp_path):
    plain = make_model(tmp_path / "p", "qwen4", seed=1)
    with strata.load(plain.model_path) as model:
        assert model.ngrams_file is None and not model.cfg.qwen4.ple_row_store


def test_ple_row_store_without_ple_layers_is_refused():
    from strata.errors import ConfigError

    with pytest.raises(ConfigError, match="ple_row_store"):
        SHAPES["qwen4"].with_fields(ple_layer_ids="", ple_row_store=True)
