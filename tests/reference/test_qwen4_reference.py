"""The Qwen4-Exp reference pieces on the made shape `qwen4` (4 hyper-connection streams, DeltaNet
layers with PLE modules, indexed attention whose budget is below the context): the n-gram ids
(chunked = whole, a fresh start after EOS), the forward by pieces = whole, trim at kept positions,
the PLE rows coming only from the row source, QSA with a budget past the context = plain gated
attention, the config fields through the model file, and generation on the numpy engines.
"""

from __future__ import annotations

import dataclasses

import numpy as np
import pytest

import strata
from strata.config import Config
from strata.errors import ConfigError
from strata.formats.quant_types import QuantType
from strata.model_config import Mixer, ModelConfig
from strata.numpy_backend.prompt import prompt_forward
from strata.families.qwen4_exp import ple_layers
from strata.reference.attention import LayerKV, attention
from strata.reference.indexed_attention import IndexedKV, indexed_attention
from strata.reference.model import ModelState, forward
from strata.reference.ngram_hash import (
    NgramHash, initial_ngram_context, ngram_context_after, ngram_row_ids, primes_from,
)
from strata.reference.ngram_rows import ResidentNgramRows
from strata.reference.ple import resident_rows
from strata.testing.models import SHAPES, make_model
from tests.budgets import FLOAT32_REORDER

CFG = SHAPES["qwen4"]
EOS = CFG.qwen4.ngram_eos_token


@pytest.fixture(scope="module")
def model(tmp_path_factory):
    made = make_model(tmp_path_factory.mktemp("q4") / "qwen4", "qwen4", seed=5, expert_type=QuantType.F16)
    m = strata.load(made.model_path)
    yield m
    m.close()


def _tokens(n: int, seed: int = 0) -> np.ndarray:
    rng = np.random.default_rng(seed)
    tokens = rng.integers(0, CFG.vocab_size - 1, n)
    tokens[[3, n // 2, n // 2 + 1]] = EOS  # an EOS, and two in a row
    return tokens


# ---------------------------------------------------------------- n-gram ids


def test_primes_are_the_successive_primes_from_the_base():
    assert primes_from(101, 8) == (101, 103, 107, 109, 113, 127, 131, 137)
    assert primes_from(20_000_000, 3) == (20000003, 20000023, 20000033)


@pytest.mark.parametrize("seed", range(4))
def test_row_ids_of_chunks_equal_the_whole(seed):
    h = NgramHash.of(CFG, 1)
    tokens = _tokens(40, seed)
    whole = ngram_row_ids(h, initial_ngram_context(h), tokens)
    cuts = sorted(np.random.default_rng(seed).choice(np.arange(1, 40), 5, replace=False))
    context, parts = initial_ngram_context(h), []
    for chunk in np.split(tokens, cuts):
        parts.append(ngram_row_ids(h, context, chunk))
        context = ngram_context_after(h, context, chunk)
    np.testing.assert_array_equal(np.concatenate(parts), whole)
    assert whole.shape == (40, (CFG.qwen4.ngram_size - 1) * CFG.qwen4.ngram_heads_per_order) and whole.dtype == np.int64
    assert (whole >= 0).all() and (whole < h.table_rows).all()


def test_after_an_eos_the_ids_are_a_fresh_sequences():
    """The shifts stop at end-of-sequence: what follows an EOS hashes as if the sequence began there."""
    h = NgramHash.of(CFG, 0)
    tail = np.asarray([7, 8, 9, 10])
    after = ngram_row_ids(h, initial_ngram_context(h), np.concatenate([[1, 2, 3, EOS], tail]))[4:]
    np.testing.assert_array_equal(after, ngram_row_ids(h, initial_ngram_context(h), tail))
    # without the EOS the earlier tokens count
    joined = ngram_row_ids(h, initial_ngram_context(h), np.concatenate([[1, 2, 3, 4], tail]))[4:]
    assert (joined[:2] != after[:2]).any()


def test_each_ple_layer_hashes_differently():
    a, b = NgramHash.of(CFG, 0), NgramHash.of(CFG, 1)
    assert not np.array_equal(a.multipliers, b.multipliers)
    assert set(a.head_sizes.tolist()).isdisjoint(b.head_sizes.tolist())


# ---------------------------------------------------------------- the forward


def test_prefill_then_decode_equals_the_whole_forward(model):
    params, tokens = model.resident_params(), _tokens(40)
    whole, _ = forward(params, ModelState.empty(model.cfg), tokens)
    logits, state = forward(params, ModelState.empty(model.cfg), tokens[:13])
    parts = [logits]
    for t in tokens[13:]:
        logits, state = forward(params, state, np.asarray([t]))
        parts.append(logits)
    np.testing.assert_allclose(np.concatenate(parts), whole, **FLOAT32_REORDER)
    assert state.length == 40


def test_prompt_path_equals_the_forward(model):
    params, tokens = model.resident_params(), _tokens(33, 1)
    whole, _ = forward(params, ModelState.empty(model.cfg), tokens)
    grouped, _ = prompt_forward(params, ModelState.empty(model.cfg), tokens, all_logits=True)
    np.testing.assert_allclose(grouped, whole, **FLOAT32_REORDER)


def test_trim_restores_a_kept_position(model):
    """A PLE module keeps its snapshots where its DeltaNet layer does: trimming to a kept position
    and decoding again gives the logits of a fresh run."""
    params, tokens = model.resident_params(), _tokens(30, 2)
    _, state = forward(params, ModelState.empty(model.cfg), tokens[:20])
    _, state = forward(params, state, tokens[20:26], window=True)
    assert state.kept_position(23) == 23 and state.kept_position(19) == 0
    again, _ = forward(params, state.trim(23), tokens[23:])
    fresh, _ = forward(params, ModelState.empty(model.cfg), tokens)
    np.testing.assert_allclose(again, fresh[23:], **FLOAT32_REORDER)
    with pytest.raises(ValueError, match="snapshot"):
        state.trim(19)


class CountingRows:
    """A row source that records the ids it is asked for and serves the given tables."""

    def __init__(self, tables):
        self.inner, self.asked = ResidentNgramRows(tables), []

    def rows(self, layer, row_ids):
        self.asked.append((layer, np.asarray(row_ids)))
        return self.inner.rows(layer, row_ids)


def test_ple_rows_come_only_from_the_row_source(model):
    params, tokens = model.resident_params(), _tokens(24, 3)
    tables = dict(enumerate(t for _, t in sorted(resident_rows(model.cfg, params.dense).tables.items())))
    counting = CountingRows(tables)
    default, _ = forward(params, ModelState.empty(model.cfg), tokens)
    np.testing.assert_array_equal(forward(params, ModelState.empty(model.cfg), tokens, rows=counting)[0], default)
    assert [layer for layer, _ in counting.asked] == list(range(len(ple_layers(model.cfg))))
    for layer, ids in counting.asked:  # exactly the hashed ids, known from the tokens alone
        h = NgramHash.of(model.cfg, layer)
        np.testing.assert_array_equal(ids, ngram_row_ids(h, initial_ngram_context(h), tokens))
    zeroed = CountingRows({i: np.zeros_like(t) for i, t in tables.items()})
    assert not np.allclose(forward(params, ModelState.empty(model.cfg), tokens, rows=zeroed)[0], default)


def test_indexed_attention_with_a_budget_past_the_context_is_gated_attention(model):
    params = model.resident_params()
    layer = next(l for l, k in enumerate(model.cfg.kinds) if k.mixer is Mixer.INDEXED_ATTENTION)
    wide = model.cfg.with_fields(indexer_budget=64 * model.cfg.qwen4.indexer_block)
    x = np.random.default_rng(4).standard_normal((30, wide.hidden_size)).astype(np.float32)
    got, state = indexed_attention(wide, params.dense, layer, IndexedKV.empty(wide), x)
    want, _ = attention(wide, params.dense, layer, LayerKV.empty(wide), x)
    np.testing.assert_allclose(got, want, **FLOAT32_REORDER)
    narrow, _ = indexed_attention(model.cfg, params.dense, layer, IndexedKV.empty(model.cfg), x)
    assert not np.allclose(narrow[-1], want[-1], **FLOAT32_REORDER)  # the budget (2 blocks) selects
    assert state.trim(9).index_keys.shape[0] == 9 and state.trim(9).length == 9


# ---------------------------------------------------------------- config, files, engines


def test_the_fields_survive_the_model_file(model):
    assert model.cfg == dataclasses.replace(CFG)
    assert ModelConfig.from_dict(CFG.to_dict()) == CFG


@pytest.mark.parametrize("change, field", [
    (dict(ple_layer_ids="3"), "ple_layer_ids"),  # layer 3 is the indexed-attention layer
    (dict(indexer_budget=6), "indexer_budget"),
    (dict(hc_count=1), "hc_count"),
    (dict(ple_embed_dim=30), "ple_embed_dim"),
])
def test_bad_fields_are_refused_naming_the_field(change, field):
    with pytest.raises(ConfigError, match=field):
        CFG.with_fields(**change)


def test_generate_on_the_numpy_engines(model):
    """The reference engine and the streaming one (experts paged through 40 slots) agree."""
    prompt = list(b"abc") + [EOS] + list(b"d")
    resident = strata.generate(model, prompt, max_tokens=6, config=Config(backend="numpy", moce_lambda=0.0))
    streamed = strata.generate(model, prompt, max_tokens=6,
                               config=Config(backend="numpy", moce_lambda=0.0, arena="40slots"))
    assert len(resident.tokens) == 6 and streamed.tokens == resident.tokens
