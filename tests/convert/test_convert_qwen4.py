"""`strata convert` of Qwen4-Exp against transformers: the text-only layout and the published
multimodal one (tests/hf_qwen4.py builds them; checked in under tests/fixtures/hf/ with
transformers' outputs: tests/hf_fixtures.py).

Teacher-forced over PARITY_TEXT (131 positions, holding the PLE's end-of-sequence token many
times): f16 experts within QWEN4_F16_LOGIT_BUDGET of the logit scale, the same 32 greedy tokens
as transformers' generate (a prompt holding that token), q8_0 the same argmax on >=
Q8_ARGMAX_AGREEMENT of positions. Then: the QSA selection is exercised (a budget below the
context) and decided by no tie; the n-gram table shards concatenate like one table; a pruned
checkpoint converts as an ordinary one; the vision tower and the MTP layer are skipped with
notes; unhandled config values are refused in one line.
"""

from __future__ import annotations

import json
import os
import shutil

import numpy as np
import pytest

os.environ.setdefault("HF_HUB_OFFLINE", "1")

from tests import hf_models, hf_qwen4  # noqa: E402
from strata.convert import convert  # noqa: E402
from strata.convert.safetensors_reader import Checkpoint  # noqa: E402
from strata.errors import ConfigError  # noqa: E402
from strata.formats.quant_types import QuantType  # noqa: E402
from strata.generate import generate  # noqa: E402
from strata.loader import load  # noqa: E402
from strata.model_config import Mixer  # noqa: E402
from strata.families.qwen4_exp import Qwen4Names, ple_layers  # noqa: E402
from strata.reference import indexed_attention as qsa  # noqa: E402
from strata.reference.model import router_rule  # noqa: E402
from strata.reference.routing import route  # noqa: E402
from tests.budgets import Q8_ARGMAX_AGREEMENT, QSA_TIE_MARGIN, QWEN4_F16_LOGIT_BUDGET  # noqa: E402
from tests.convert_parity import (argmax_agreement, assert_refused_in_one_line, convert_each, logit_error,  # noqa: E402
                                  mean_kld, parity_tokens, reference_logits, save_as_one_file, with_config)
from tests.hf_fixtures import GREEDY_STEPS, PROMPT_TOKENS  # noqa: E402


@pytest.fixture(scope="module", params=hf_qwen4.ARCHS)
def arch(request):
    return request.param


@pytest.fixture(scope="module")
def checkpoint(arch, tmp_path_factory):
    return hf_qwen4.cached_checkpoint(arch, tmp_path_factory)


@pytest.fixture(scope="module")
def converted(arch, checkpoint, tmp_path_factory):
    return convert_each(checkpoint[0], tmp_path_factory.mktemp(f"strata_{arch}"), (QuantType.F16, QuantType.Q8_0))


def test_f16_logits_match_transformers(arch, checkpoint, converted):
    model = converted[QuantType.F16][0]
    tokens = parity_tokens(model, checkpoint[1])
    assert len(tokens) >= 128
    assert np.count_nonzero(tokens == model.cfg.qwen4.ngram_eos_token) >= 2  # the shifts stop inside the text
    ref, got = checkpoint[1].logits, reference_logits(model, tokens)
    rel, scale = logit_error(ref, got)
    print(f"\n{arch} f16: max|dlogit|/scale = {rel:.2e} (scale {scale:.2f}, {len(tokens)} positions), "
          f"KLD {mean_kld(ref, got):.2e}")
    assert rel <= QWEN4_F16_LOGIT_BUDGET


def test_f16_greedy_matches_transformers(arch, checkpoint, converted):
    model = converted[QuantType.F16][0]
    prompt = [int(t) for t in parity_tokens(model, checkpoint[1])[:PROMPT_TOKENS]]
    assert checkpoint[1].eos_ids == sorted(model.tokenizer.eos_ids) and checkpoint[1].prompt == prompt
    assert model.cfg.qwen4.ngram_eos_token in prompt
    ours = generate(model, prompt, max_tokens=GREEDY_STEPS).tokens
    assert ours == checkpoint[1].greedy and len(ours) == GREEDY_STEPS


def test_q8_0_argmax_agrees(arch, checkpoint, converted):
    model = converted[QuantType.Q8_0][0]
    tokens = parity_tokens(model, checkpoint[1])
    ref, got = checkpoint[1].logits, reference_logits(model, tokens)
    agree = argmax_agreement(ref, got)
    print(f"\n{arch} q8_0: argmax agreement {agree:.4f}, KLD {mean_kld(ref, got):.2e}")
    assert agree >= Q8_ARGMAX_AGREEMENT


def test_config_carried_over(arch, converted):
    cfg, r = converted[QuantType.F16][0].cfg, converted[QuantType.F16][1]
    assert cfg.architecture == arch
    assert [k.mixer for k in cfg.kinds] == [Mixer.DELTANET] * 3 + [Mixer.INDEXED_ATTENTION]
    assert (cfg.qwen4.hc_count, cfg.qwen4.hc_lowrank) == (hf_qwen4.HC_COUNT, hf_qwen4.HC_LOWRANK)
    assert ple_layers(cfg) == tuple(i - 1 for i in hf_qwen4.PLE_LAYER_IDS)
    assert (cfg.qwen4.indexer_heads, cfg.qwen4.indexer_budget, cfg.qwen4.indexer_block) == (
        hf_qwen4.INDEXER_HEADS, hf_qwen4.INDEXER_BUDGET, hf_qwen4.INDEXER_BLOCK)
    assert any("hash buffers" in n for n in r.notes)
    assert any("vision tower" in n for n in r.notes) == (arch == "qwen4_exp")


def _read_all(directory) -> dict[str, np.ndarray]:
    """Every tensor of a checkpoint: floats as float32 (exact for its bf16), the hash buffers as int64."""
    with Checkpoint(directory) as ck:
        return {n: ck.read_raw(n, np.dtype("<i8")) if ck.info(n).dtype == "I64" else ck.read(n) for n in ck.tensors}


def _index_scores(model, tokens):
    """The QSA layer's block scores per query over the parity text, as reference/indexed_attention
    computes them (the hyper-connection input is taken from a traced forward)."""
    seen = {}
    original = qsa.selected_keys

    def spy(cfg_, queries, blocks, positions, n_keys):
        seen["queries"], seen["blocks"] = queries, blocks
        return original(cfg_, queries, blocks, positions, n_keys)

    qsa.selected_keys = spy
    try:
        reference_logits(model, tokens)
    finally:
        qsa.selected_keys = original
    return seen["queries"], seen["blocks"]


def test_qsa_selection_matters_and_no_tie_decides_it(arch, converted):
    """The budget (4 blocks) is below most queries' complete blocks, and at every such query the
    last chosen block's score is clear of the first one left out (ties are broken by index here,
    in an implementation-defined order by torch.topk: a tie would make the parity a coin toss)."""
    if arch != "qwen4_exp_text":
        pytest.skip("the same language model in both layouts")
    model = converted[QuantType.F16][0]
    cfg = model.cfg
    queries, blocks = _index_scores(model, parity_tokens(model))
    top, limited = cfg.qwen4.indexer_budget // cfg.qwen4.indexer_block, 0
    for p in range(len(queries)):
        complete = (p + 1) // cfg.qwen4.indexer_block
        if complete <= top:
            continue
        limited += 1
        scores = np.sort(np.maximum(queries[p] @ blocks[:complete].T, 0).sum(axis=0))[::-1]
        assert scores[top - 1] - scores[top] > QSA_TIE_MARGIN * max(scores[0], 1e-6), p
    assert limited >= len(queries) // 2


def test_unsharded_table_converts_to_the_same_model(arch, checkpoint, converted, tmp_path):
    """A table saved whole (`ngram_embedding.weight`) reads like its row shards concatenated."""
    if arch != "qwen4_exp_text":
        pytest.skip("one layout is enough: the table reader is shared")
    src = tmp_path / "whole"
    shutil.copytree(checkpoint[0], src)
    raw = _read_all(src)
    for layer in (i - 1 for i in hf_qwen4.PLE_LAYER_IDS):
        base = f"model.layers.{layer}.ple.ple_embedding.ngram_embedding."
        shards = [raw.pop(f"{base}shard_{i}.weight") for i in range(hf_qwen4.NGRAM_SHARDS)]
        raw[base + "weight"] = np.concatenate(shards)
    save_as_one_file(src, raw)
    model = load(convert(src, tmp_path / "out", expert_type=QuantType.F16).model_path)
    tokens = parity_tokens(model)
    want = reference_logits(converted[QuantType.F16][0], tokens)
    np.testing.assert_array_equal(reference_logits(model, tokens), want)


def test_pruned_experts_convert_as_ordinary_ones(arch, checkpoint, converted, tmp_path):
    """Experts 6 and 7 dropped with their router rows (config.json still says 8): the model is one
    of 6 experts, and computes what the original computes when routing only among the first 6
    (softmax then top-k renormalized: the dropped experts' probabilities cancel)."""
    if arch != "qwen4_exp_text":
        pytest.skip("one layout is enough")
    keep = hf_models.EXPERTS - 2
    src = tmp_path / "pruned"
    shutil.copytree(checkpoint[0], src)
    raw = _read_all(src)
    for name in list(raw):
        parts = name.split(".")
        if "experts" in parts and int(parts[parts.index("experts") + 1]) >= keep:
            del raw[name]
        elif name.endswith("mlp.gate.weight"):
            raw[name] = raw[name][:keep]
    save_as_one_file(src, raw)
    model = load(convert(src, tmp_path / "out", expert_type=QuantType.F16).model_path)
    assert model.cfg.n_experts == keep
    full = converted[QuantType.F16][0]
    rule = router_rule(full.cfg)
    tokens = parity_tokens(model)
    restricted = reference_logits(full, tokens, select=lambda m, z: route(z[:keep], rule))
    np.testing.assert_allclose(reference_logits(model, tokens), restricted, rtol=0, atol=1e-5)


def test_mtp_layer_is_skipped_with_a_note(arch, checkpoint, tmp_path):
    from safetensors.numpy import save_file

    if arch != "qwen4_exp_text":
        pytest.skip("one layout is enough")
    src = tmp_path / "mtp"
    shutil.copytree(checkpoint[0], src)
    save_file({"mtp.fc.weight": np.zeros((4, 4), np.float32)}, str(src / "mtp.safetensors"))
    index = {"metadata": {}, "weight_map": {}}
    with Checkpoint(checkpoint[0]) as ck:
        index["weight_map"] = {n: "model.safetensors" for n in ck.tensors}
    index["weight_map"]["mtp.fc.weight"] = "mtp.safetensors"
    (src / "model.safetensors.index.json").write_text(json.dumps(index))
    r = convert(src, tmp_path / "out", expert_type=QuantType.F16)
    assert any("multi-token-prediction" in n for n in r.notes)


def test_without_a_partial_rotary_factor_the_whole_head_rotates(arch, checkpoint, tmp_path):
    """transformers' Qwen4-Exp default rope reads partial_rotary_factor with a default of 1.0: the
    whole head (32 dims) then no longer fits the 16-wide indexer heads, which transformers' own
    validation refuses too."""
    if arch != "qwen4_exp_text":
        pytest.skip("one layout is enough")
    src = with_config(checkpoint[0], tmp_path / "ckpt", lambda c: c["rope_parameters"].pop("partial_rotary_factor"))
    with pytest.raises(ConfigError, match=f"indexer_head_dim={hf_qwen4.INDEXER_HEAD_DIM} must hold the "
                                          f"{hf_qwen4.HEAD_DIM} rotary dims"):
        convert(src, tmp_path / "out", expert_type=QuantType.F16)


REFUSALS = [
    (lambda c: c.update(some_new_feature=1), "config key 'some_new_feature'"),
    (lambda c: c.update(output_gate_type="gelu"), "output_gate_type = 'gelu'"),
    (lambda c: c.update(indexer_kv_heads=2), "indexer_kv_heads = 2"),
    (lambda c: c.update(layer_types=["linear_attention", "sliding_attention", "linear_attention",
                                     "indexed_attention"]), "layer type 'sliding_attention'"),
    (lambda c: c["rope_parameters"].update(rope_type="yarn", factor=4.0), "rope_type = 'yarn'"),
]


@pytest.mark.parametrize("change, message", REFUSALS, ids=[m for _, m in REFUSALS])
def test_unhandled_config_values_are_refused_in_one_line(checkpoint, arch, change, message, tmp_path):
    if arch != "qwen4_exp_text":
        pytest.skip("the key table is shared by both layouts")
    assert_refused_in_one_line(with_config(checkpoint[0], tmp_path / "ckpt", change), tmp_path / "out", message)


def test_tables_go_to_the_row_store_in_shard_order(arch, checkpoint, converted):
    """The n-gram tables are not in the model file: `<name>.ngrams` holds them by PLE index, the
    shards concatenated in order (F16 rows: the BF16 values exactly), and the model file records
    the store's identity."""
    from strata.formats.model_file import read_model

    model, result = converted[QuantType.F16]
    assert model.cfg.qwen4.ple_row_store and result.ngrams_path == result.model_path.with_suffix(".ngrams")
    assert not any(k.endswith(Qwen4Names.ple_ngram) for k in model.dense)
    store = model.ngrams_file
    assert read_model(result.model_path).ngrams_identity == store.identity
    assert sorted(store.tables) == list(range(len(hf_qwen4.PLE_LAYER_IDS)))
    raw = _read_all(checkpoint[0])
    prefix = "model.language_model." if arch == "qwen4_exp" else "model."
    for i, layer in enumerate(ple_layers(model.cfg)):
        base = f"{prefix}layers.{layer}.ple.ple_embedding.ngram_embedding."
        want = np.concatenate([raw[f"{base}shard_{s}.weight"] for s in range(hf_qwen4.NGRAM_SHARDS)])
        got = store.rows(i, np.arange(store.tables[i].rows))
        np.testing.assert_array_equal(got, want.astype(np.float32))  # bf16 values: exact in F16


def test_f32_rows_read_in_small_ranges_give_the_same_model(arch, checkpoint, converted, tmp_path, monkeypatch):
    """The tables stream into the store a row range at a time (no table, no shard whole: the
    published ~90 GB convert the same way); F32 rows hold the BF16 values as F16 rows do."""
    from strata.convert import ngram_tables as tables_module

    if arch != "qwen4_exp_text":
        pytest.skip("one layout is enough")
    monkeypatch.setattr(tables_module, "ROWS_PER_READ", 7)  # many reads per shard, some ending mid-shard
    model = load(convert(checkpoint[0], tmp_path / "f32", expert_type=QuantType.F16,
                         ngram_type=QuantType.F32).model_path)
    assert model.ngrams_file.qtype is QuantType.F32
    tokens = parity_tokens(model)
    want = reference_logits(converted[QuantType.F16][0], tokens)
    np.testing.assert_array_equal(reference_logits(model, tokens), want)


def test_the_row_store_must_be_there_and_be_its_own(arch, checkpoint, converted, tmp_path):
    from strata.errors import FormatError

    if arch != "qwen4_exp_text":
        pytest.skip("one layout is enough")
    r = convert(checkpoint[0], tmp_path / "out", expert_type=QuantType.F16)
    other = convert(checkpoint[0], tmp_path / "other", expert_type=QuantType.F16, ngram_type=QuantType.F32)
    os.replace(other.ngrams_path, r.ngrams_path)  # another conversion's store (another identity)
    with pytest.raises(FormatError, match="not the row store out.gguf was written with") as err:
        load(r.model_path)
    assert "\n" not in str(err.value)
    r.ngrams_path.unlink()
    with pytest.raises(FormatError, match="no such PLE row store") as err:
        load(r.model_path)
    assert "\n" not in str(err.value)
