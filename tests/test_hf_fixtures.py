"""The checked-in fixtures (tests/fixtures, tests/hf_fixtures.py) are current.

Without torch: every family has its fixture, the saved config is the one its builder makes now,
the tokenizer files are the ones write_tokenizer trains now, and expected.npz fits the checkpoint.
With torch (pip install -e ".[test,regen]"): transformers recomputes every expected output from
the checked-in files, and rebuilds each checkpoint from its recipe, against what is checked in.
A failure here means: run `python scripts/make_hf_fixtures.py` (docs/testing.md)."""

from __future__ import annotations

import json
import os

import numpy as np
import pytest

os.environ.setdefault("HF_HUB_OFFLINE", "1")
pytest.importorskip("transformers")

from tests import gguf_models, hf_fixtures, hf_models  # noqa: E402
from tests.budgets import FIXTURE_REBUILD_BUDGET, FIXTURE_RECOMPUTE_BUDGET  # noqa: E402

ARCHS = hf_fixtures.fixture_archs()
GGUF_CASES = [*gguf_models.CASES, gguf_models.WIDE_CASE]
# what differs between a config as built and as saved: where it was read from, and what
# save_pretrained adds (the model class, the weights' dtype)
SAVED_ONLY_KEYS = {"_name_or_path", "architectures", "dtype"}


def _rel(got: np.ndarray, want: np.ndarray) -> float:
    return float(np.abs(got - want).max()) / float(np.abs(want).max())


@pytest.mark.parametrize("arch", ARCHS)
def test_every_family_has_a_fixture(arch):
    hf_fixtures.checkpoint_dir(arch)  # raises MissingFixture, naming the command


@pytest.mark.parametrize("case", GGUF_CASES, ids=gguf_models.case_id)
def test_every_gguf_case_has_a_fixture(case):
    hf_fixtures.gguf_expected(gguf_models.case_id(case))


@pytest.mark.parametrize("arch", ARCHS)
def test_saved_config_is_the_builders(arch):
    from transformers import AutoConfig

    built = hf_fixtures.family_of(arch).hf_config(arch).to_dict()
    saved = AutoConfig.from_pretrained(hf_fixtures.checkpoint_dir(arch)).to_dict()
    stale = sorted(k for k in (set(built) | set(saved)) - SAVED_ONLY_KEYS if built.get(k) != saved.get(k))
    assert not stale, f"{arch}: the builder's config differs in {stale}: regenerate the fixture"


@pytest.mark.parametrize("arch", ARCHS)
def test_tokenizer_files_are_the_builders(arch, tmp_path):
    hf_models.write_tokenizer(tmp_path)
    for name in ("tokenizer.json", "tokenizer_config.json"):
        assert (hf_fixtures.checkpoint_dir(arch) / name).read_text() == (tmp_path / name).read_text(), name


@pytest.mark.parametrize("arch", ARCHS)
def test_expected_outputs_fit_the_checkpoint(arch):
    from tokenizers import Tokenizer

    d = hf_fixtures.checkpoint_dir(arch)
    e = hf_fixtures.expected(arch)
    config = json.loads((d / "config.json").read_text())
    vocab = config.get("text_config", config)["vocab_size"]
    assert e.tokens.tolist() == Tokenizer.from_file(str(d / "tokenizer.json")).encode(hf_models.PARITY_TEXT).ids
    assert e.logits.shape == (len(e.tokens), vocab) and e.logits.dtype == np.float32
    assert np.isfinite(e.logits).all()
    assert e.prompt == e.tokens[: hf_fixtures.PROMPT_TOKENS].tolist()
    assert len(e.greedy) == hf_fixtures.GREEDY_STEPS and all(0 <= t < vocab for t in e.greedy)


# ---------------------------------------------------------------- with torch: recomputed


@pytest.fixture(scope="module")
def reference():
    pytest.importorskip("torch")
    from tests import hf_reference

    hf_reference.setup_torch()
    return hf_reference


@pytest.mark.parametrize("arch", ARCHS)
def test_transformers_recomputes_the_expected_outputs(arch, reference):
    d = hf_fixtures.checkpoint_dir(arch)
    e = hf_fixtures.expected(arch)
    got = reference.expected_outputs(reference.load_model(d), d)
    assert _rel(got["logits"], e.logits) <= FIXTURE_RECOMPUTE_BUDGET
    for key in ("tokens", "prompt", "greedy", "eos_ids"):
        assert got[key].tolist() == list(getattr(e, key)), key


@pytest.mark.parametrize("arch", ARCHS)
def test_the_recipe_rebuilds_the_checkpoint(arch, reference, tmp_path):
    family = hf_fixtures.family_of(arch)
    kw = {}
    if arch == "qwen3_5_moe":  # its language weights are the checked-in text-only model's
        kw["text_model"] = reference.load_model(hf_fixtures.checkpoint_dir("qwen3_5_moe_text"))
    model = family.build_checkpoint(arch, tmp_path / arch, **kw)
    e = hf_fixtures.expected(arch)
    assert _rel(reference.logits(model, e.tokens), e.logits) <= FIXTURE_REBUILD_BUDGET


@pytest.mark.parametrize("case", GGUF_CASES, ids=gguf_models.case_id)
def test_transformers_recomputes_the_gguf_logits(case, reference, tmp_path):
    arch, experts, dense = case[:3]
    if arch == gguf_models.WIDE_CASE[0]:
        hf_dir = gguf_models.build_wide_checkpoint(tmp_path / "hf")
    else:
        hf_dir = hf_fixtures.copy_checkpoint(arch, tmp_path / "hf")
    path = gguf_models.write_gguf(hf_dir, tmp_path / "model.gguf", experts=experts, dense=dense)
    ref_dir = gguf_models.dequantized_checkpoint(path, hf_dir, tmp_path / "dequantized")
    want = hf_fixtures.gguf_expected(gguf_models.case_id(case))
    assert gguf_models.weights_digest(ref_dir) == want.weights_digest
    got = reference.logits(reference.load_model(ref_dir), reference.parity_tokens(hf_dir))
    assert _rel(got, want.logits) <= FIXTURE_RECOMPUTE_BUDGET
