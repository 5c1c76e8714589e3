"""Qwen4-Exp's n-gram hash from constants a file stores (llama.cpp's `ple.layer_multipliers` /
`ple.head_vocab_sizes` / `ple.head_offsets`: the config's ngram_multipliers, ngram_head_sizes,
ngram_head_offsets, and ngram_table_rows for the table it holds) on the made shape `qwen4`:
where a file holds both, the stored constants equal the ones derived from the seeds and the
forward is the derived one's bit for bit; other stored constants are the ones hashed with; the
fields survive the model file; bad ones are refused naming the field.
"""

from __future__ import annotations

import numpy as np
import pytest

import strata
from strata.errors import ConfigError
from strata.families.qwen4_exp import (
    StoredHashConstants, derived_table_sizes, hash_constant_fields, ple_layers, stored_hash_constants,
)
from strata.formats.quant_types import QuantType
from strata.model_config import ModelConfig
from strata.reference.model import ModelState, forward
from strata.reference.ngram_hash import NgramHash, initial_ngram_context, layer_multipliers, ngram_row_ids
from strata.testing.models import SHAPES, make_model

CFG = SHAPES["qwen4"]
EOS = CFG.qwen4.ngram_eos_token


def _derived(cfg: ModelConfig) -> list[StoredHashConstants]:
    """Each PLE layer's constants as transformers derives them (what a converter would store)."""
    out = []
    for i in range(len(ple_layers(cfg))):
        sizes, offsets = derived_table_sizes(cfg, i)
        out.append(StoredHashConstants(layer_multipliers(cfg.vocab_size, cfg.qwen4.ngram_size, i,
                                                         cfg.qwen4.ngram_seed), sizes, offsets))
    return out


# the derived constants stored, with the seeds a GGUF does not hold cleared
STORED = CFG.with_fields(**hash_constant_fields(_derived(CFG)), ngram_seed=0, ngram_vocab_base=0)


def _tokens(n: int = 40) -> np.ndarray:
    tokens = np.random.default_rng(3).integers(0, CFG.vocab_size - 1, n)
    tokens[[5, 20]] = EOS
    return tokens


def test_stored_constants_equal_to_the_derived_ones_hash_the_same():
    for i in range(len(ple_layers(CFG))):
        derived, stored = NgramHash.of(CFG, i), NgramHash.of(STORED, i)
        assert stored_hash_constants(CFG, i) is None and stored_hash_constants(STORED, i) is not None
        for field in ("multipliers", "head_sizes", "head_offsets"):
            np.testing.assert_array_equal(getattr(stored, field), getattr(derived, field))
        assert stored.table_rows == derived.table_rows
        np.testing.assert_array_equal(ngram_row_ids(stored, initial_ngram_context(stored), _tokens()),
                                      ngram_row_ids(derived, initial_ngram_context(derived), _tokens()))


def test_other_stored_constants_are_the_ones_hashed_with():
    """A file's constants win over the seeds: other multipliers give other rows."""
    other = _derived(CFG)
    other[0] = StoredHashConstants(other[0].multipliers + 2, other[0].head_sizes, other[0].head_offsets)
    cfg = CFG.with_fields(**hash_constant_fields(other))
    h, derived = NgramHash.of(cfg, 0), NgramHash.of(CFG, 0)
    np.testing.assert_array_equal(h.multipliers, derived.multipliers + 2)
    assert (ngram_row_ids(h, initial_ngram_context(h), _tokens())
            != ngram_row_ids(derived, initial_ngram_context(derived), _tokens())).any()


def test_stored_table_rows_size_the_table():
    """ngram_table_rows: the table as the file holds it (llama.cpp's, padded by a divisor it does not store)."""
    cfg = STORED.with_fields(ngram_table_rows=NgramHash.of(CFG, 1).table_rows + 24)
    assert NgramHash.of(cfg, 0).table_rows == NgramHash.of(CFG, 1).table_rows + 24


def test_the_forward_with_stored_constants_is_the_derived_ones(tmp_path):
    """The same made model (same seed and shapes) with the constants stored: logits bit for bit."""
    tokens = _tokens()
    logits = []
    for name, cfg in (("derived", CFG), ("stored", STORED)):
        made = make_model(tmp_path / name, cfg, seed=11, expert_type=QuantType.F16)
        with strata.load(made.model_path) as m:
            assert m.cfg == cfg  # the fields survive the model file
            logits.append(forward(m.resident_params(), ModelState.empty(m.cfg), tokens)[0])
    np.testing.assert_array_equal(logits[0], logits[1])


def _with(**fields):
    return lambda: STORED.with_fields(**fields)


@pytest.mark.parametrize("make, field", [
    (_with(ngram_multipliers="3,5"), "ngram_multipliers"),  # one list for two PLE layers
    (_with(ngram_multipliers="3,5,7;-3,5,9"), "ngram_multipliers"),  # a negative multiplier
    (_with(ngram_multipliers=f"{2 ** 62 + 1},5,7;3,5,9"), "ngram_multipliers"),  # token x it would wrap
    (_with(ngram_head_sizes="7,11,13;17,19,23,29,31"), "ngram_head_sizes"),  # 3 heads, not 4
    (_with(ngram_head_offsets="-1,101,204,313;0,1,2,3"), "ngram_head_offsets"),  # before the table
    (_with(ngram_head_sizes="x"), "comma-separated integers"),
    (lambda: CFG.with_fields(ngram_multipliers="3,5,7;3,5,9"), "stored together"),
    (lambda: CFG.with_fields(ngram_table_rows=600), "ngram_table_rows"),
    (lambda: STORED.with_fields(ngram_table_rows=100), "fit its 100 rows"),
])
def test_bad_stored_constants_are_refused_naming_the_field(make, field):
    with pytest.raises(ConfigError, match=field):
        make()
