"""Qwen3.8-Flash-Next as released: the Hugging Face checkpoint of its form (tests/hf_qwen4_released.py:
the sigmoid DeltaNet gate, one PLE layer `[2]` in row shards, `full_attention` spelled as released)
against transformers, and llama.cpp's `qwen4exp` GGUF of it (tests/gguf_qwen4exp.py writes
llama.cpp's layout: one `per_layer_token_embd` table, the hash constants as UINT64 metadata, no
seed, the norms stored as 1 + w, the DeltaNet value heads tiled, the indexer's q / k split, a
trailing MTP block). With every tensor F32 the GGUF converts to the model the Hugging Face
checkpoint converts to: the same config but for the hash's form (stored constants, no seeds),
which hashes every token to the same rows, and logits equal bit for bit; quantized as the UD
files mix types it converts with its types kept, computing what their values do. What the file says that strata does not compute
(a dense attention layer: compress ratio 0; several PLE layers) is refused in one line naming the
key."""

from __future__ import annotations

import numpy as np
import pytest

from strata.cli.main import main
from strata.convert import convert
from strata.errors import ConfigError, FormatError
from strata.families.qwen4_exp import ple_layers
from strata.formats.ngram_rows_file import NgramRowsFile
from strata.formats.quant_types import QuantType
from strata.generate import generate
from strata.loader import load
from strata.reference.model import ModelState, forward
from strata.reference.ngram_hash import NgramHash, initial_ngram_context, ngram_row_ids
from tests import hf_models, hf_qwen4_released
from tests.budgets import FLOAT32_REORDER_OF_SCALE
from tests.convert_parity import logit_error, parity_tokens
from tests.gguf_qwen4exp import write_qwen4exp_gguf
from tests.hf_fixtures import GREEDY_STEPS, PROMPT_TOKENS

ARCH = hf_qwen4_released.ARCHS[0]
HASH_FIELDS = ("ngram_multipliers", "ngram_head_sizes", "ngram_head_offsets", "ngram_table_rows", "ngram_seed",
               "ngram_vocab_base", "ngram_vocab_divisor")


@pytest.fixture(scope="module")
def checkpoint(tmp_path_factory):
    return hf_qwen4_released.cached_checkpoint(ARCH, tmp_path_factory)


@pytest.fixture(scope="module")
def from_hf(checkpoint, tmp_path_factory):
    return convert(checkpoint[0], tmp_path_factory.mktemp("q4r_hf") / "hf", expert_type=QuantType.F32,
                   dense_type=QuantType.F32)


@pytest.fixture(scope="module")
def from_gguf(checkpoint, tmp_path_factory):
    d = tmp_path_factory.mktemp("q4r_gguf")
    return convert(write_qwen4exp_gguf(checkpoint[0], d / "m.gguf"), d / "gguf")


def _logits(model_path) -> np.ndarray:
    with load(model_path) as m:
        tokens = np.asarray(m.tokenizer.encode(hf_models.PARITY_TEXT))
        return forward(m.resident_params(), ModelState.empty(m.cfg), tokens)[0]


def test_the_released_form_converts_and_matches_transformers(checkpoint, from_hf):
    cfg = from_hf.cfg
    assert cfg.qwen4.deltanet_sigmoid_gate and ple_layers(cfg) == (1,) and cfg.qwen4.ple_row_store
    with load(from_hf.model_path) as m:
        tokens = parity_tokens(m, checkpoint[1])
        rel, scale = logit_error(checkpoint[1].logits, forward(m.resident_params(), ModelState.empty(m.cfg),
                                                               tokens)[0])
        print(f"\n{ARCH}: max|dlogit|/scale = {rel:.2e} (scale {scale:.2f})")
        assert rel <= FLOAT32_REORDER_OF_SCALE
        prompt = [int(t) for t in tokens[:PROMPT_TOKENS]]
        assert generate(m, prompt, max_tokens=GREEDY_STEPS).tokens == checkpoint[1].greedy


def test_the_gguf_is_the_hugging_face_conversion(from_hf, from_gguf):
    a, b = from_gguf.cfg.to_dict(), from_hf.cfg.to_dict()
    assert {k: a[k] for k in a if k not in HASH_FIELDS} == {k: b[k] for k in b if k not in HASH_FIELDS}
    assert from_gguf.cfg.qwen4.ngram_multipliers and not from_hf.cfg.qwen4.ngram_multipliers
    stored, derived = NgramHash.of(from_gguf.cfg, 0), NgramHash.of(from_hf.cfg, 0)
    for field in ("multipliers", "head_sizes", "head_offsets"):
        np.testing.assert_array_equal(getattr(stored, field), getattr(derived, field))
    assert stored.table_rows == derived.table_rows
    tokens = np.arange(300) % from_hf.cfg.vocab_size
    np.testing.assert_array_equal(ngram_row_ids(stored, initial_ngram_context(stored), tokens),
                                  ngram_row_ids(derived, initial_ngram_context(derived), tokens))
    assert any("multi-token-prediction" in n for n in from_gguf.notes)
    np.testing.assert_array_equal(_logits(from_gguf.model_path), _logits(from_hf.model_path))


def test_the_layer_pattern_as_recurrent_layers(checkpoint, from_gguf, tmp_path):
    """`attention.recurrent_layers` (a bool per block) is the layer pattern where the file has it,
    before a `full_attention_interval` (2 here) that would mean another."""
    path = write_qwen4exp_gguf(checkpoint[0], tmp_path / "m.gguf", recurrent_layers=True)
    assert convert(path, tmp_path / "out").cfg == from_gguf.cfg


@pytest.mark.parametrize("table", ["Q8_0", "IQ4_NL"])
def test_a_quantized_gguf_keeps_its_types(checkpoint, tmp_path, table):
    """Q5_1 experts, Q8_0 dense matrices, a Q8_0 or IQ4_NL table (types the UD recipes use; the
    K-types need rows of 256, wider than this model's 64): the experts and dense matrices are kept
    as stored and compute what their values do, the table's rows are read as the file stores them:
    the logits equal, bit for bit, those of the same file converted to F32 experts and dense (its
    values dequantized exactly), the row store's rows the table's dequantized rows."""
    import gguf

    path = write_qwen4exp_gguf(checkpoint[0], tmp_path / "q.gguf", experts="Q5_1", dense="Q8_0", table=table)
    stored = {t.name: t.tensor_type.name for t in gguf.GGUFReader(str(path)).tensors}
    assert stored["per_layer_token_embd.weight"] == table and stored["blk.0.ffn_down_exps.weight"] == "Q5_1"
    assert stored["blk.3.attn_q.weight"] == "Q8_0"
    kept = convert(path, tmp_path / "kept", ngram_type=QuantType.F32)
    assert kept.expert_type is QuantType.Q5_1 and kept.dense_kept
    widened = convert(path, tmp_path / "f32", expert_type=QuantType.F32, dense_type=QuantType.F32,
                      ngram_type=QuantType.F32)
    assert kept.cfg == widened.cfg
    np.testing.assert_array_equal(_logits(kept.model_path), _logits(widened.model_path))
    rows = NgramRowsFile.open(kept.ngrams_path)
    ids = np.arange(kept.cfg.qwen4.ngram_table_rows)
    want = gguf.dequantize(gguf.GGUFReader(str(path)).get_tensor(
        [t.name for t in gguf.GGUFReader(str(path)).tensors].index("per_layer_token_embd.weight")).data,
        getattr(gguf.GGMLQuantizationType, table))
    np.testing.assert_array_equal(rows.rows(0, ids), want.reshape(len(ids), -1))


@pytest.mark.parametrize("change, error, message", [
    (dict(compress_ratios=[0, 0, 0, 0, 0]), ConfigError, r"compress_ratios is 0 at attention layer 3: dense attention"),
    (dict(mtp=False, compress_ratios=[0, 0, 0, 4]), None, None),  # the converter's own ratios: accepted
])
def test_compress_ratios(checkpoint, tmp_path, change, error, message):
    path = write_qwen4exp_gguf(checkpoint[0], tmp_path / "m.gguf", **change)
    if error is None:
        assert convert(path, tmp_path / "out").cfg.qwen4.indexer_block == 4
        return
    with pytest.raises(error, match=message):
        convert(path, tmp_path / "out")


def _rewrite_key(src, dst, key: str, values, sub_type: str):
    """`src` with metadata `key` replaced (an array of `sub_type`), or removed (values None)."""
    import gguf

    r = gguf.GGUFReader(str(src))
    w = gguf.GGUFWriter(str(dst), "qwen4exp")
    for field in r.fields.values():
        if field.name in (key, "general.architecture") or field.name.startswith("GGUF."):
            continue
        kind = field.types[0]
        sub = field.types[-1] if kind == gguf.GGUFValueType.ARRAY else None
        w.add_key_value(field.name, field.contents(), kind, sub_type=sub)
    if values is not None:
        w.add_key_value(key, values, gguf.GGUFValueType.ARRAY, sub_type=getattr(gguf.GGUFValueType, sub_type))
    for t in r.tensors:
        w.add_tensor(t.name, np.asarray(t.data), raw_shape=tuple(int(n) for n in reversed(t.shape)),
                     raw_dtype=t.tensor_type)
    w.write_header_to_file()
    w.write_kv_data_to_file()
    w.write_tensors_to_file()
    w.close()
    return dst


@pytest.mark.parametrize("key, values, sub_type, message", [
    ("qwen4exp.ple.layers", [1, 2], "UINT32", r"ple\.layers lists 2 layers"),
    ("qwen4exp.ple.layer_multipliers", [3, 5], "UINT64", r"ple\.layer_multipliers has 2 entries, expected 3"),
    ("qwen4exp.ple.head_offsets", None, None, r"missing metadata key qwen4exp\.ple\.head_offsets"),
])
def test_bad_ple_metadata_is_one_line_naming_the_key(checkpoint, tmp_path, capsys, key, values, sub_type, message):
    src = write_qwen4exp_gguf(checkpoint[0], tmp_path / "m.gguf", mtp=False)
    path = _rewrite_key(src, tmp_path / "bad.gguf", key, values, sub_type)
    with pytest.raises((ConfigError, FormatError), match=message):
        convert(path, tmp_path / "out")
    assert main(["convert", str(path), str(tmp_path / "cli"), "--quiet"]) == 2
    err = capsys.readouterr().err.strip().splitlines()
    assert len(err) == 1 and key in err[0] and "internal error" not in err[0]
    assert not (tmp_path / "out").exists() and not (tmp_path / "cli").exists()
