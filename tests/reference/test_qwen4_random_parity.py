"""Randomized parity of Qwen4-Exp against transformers: checkpoints drawn over the family's
configuration space (tests/hf_qwen4_random.py: stream counts, layer patterns, PLE layers, rotary
fraction / sections / interleaving, indexer heads, block and budget, n-gram sizes, heads and table
shards, eos ids, noise on every constant-initialized parameter), checked in with transformers'
float32 outputs (tests/fixtures/hf/qwen4_exp_random_*; scripts/make_hf_fixtures.py regenerates
them, tests/test_hf_fixtures.py checks them current).

Each converts with f32 experts (every weight as saved) and strata's reference forward gives, over
the parity text (teacher-forced), logits within FLOAT32_REORDER_OF_SCALE of transformers' (both
float32; only the order of sums differs: seen up to 1.4e-5 of the scale over the 90 configurations
scripts/qwen4_parity_sweep.py drew), and the same 32 greedy tokens as transformers' generate. Where two QSA blocks tie, torch.topk
chooses in no defined order (docs/qwen4.md): the test checks that no tie decides a selection in
these fixtures, at every indexed attention layer, so the comparison is a test and not a coin toss.
"""

from __future__ import annotations

import os

import numpy as np
import pytest

os.environ.setdefault("HF_HUB_OFFLINE", "1")

from tests import hf_qwen4_random  # noqa: E402
from strata.convert import convert  # noqa: E402
from strata.formats.quant_types import QuantType  # noqa: E402
from strata.generate import generate  # noqa: E402
from strata.loader import load  # noqa: E402
from strata.model_config import Mixer  # noqa: E402
from strata.reference import indexed_attention as qsa  # noqa: E402
from tests.budgets import FLOAT32_REORDER_OF_SCALE, QSA_TIE_MARGIN  # noqa: E402
from tests.convert_parity import logit_error, parity_tokens, reference_logits  # noqa: E402
from tests.hf_fixtures import GREEDY_STEPS, PROMPT_TOKENS  # noqa: E402


@pytest.fixture(scope="module", params=hf_qwen4_random.ARCHS)
def arch(request):
    return request.param


@pytest.fixture(scope="module")
def checkpoint(arch, tmp_path_factory):
    return hf_qwen4_random.cached_checkpoint(arch, tmp_path_factory)


@pytest.fixture(scope="module")
def model(arch, checkpoint, tmp_path_factory):
    r = convert(checkpoint[0], tmp_path_factory.mktemp(f"strata_{arch}") / "f32", expert_type=QuantType.F32)
    with load(r.model_path) as m:
        yield m


def test_logits_match_transformers(arch, checkpoint, model):
    tokens = parity_tokens(model, checkpoint[1])
    rel, scale = logit_error(checkpoint[1].logits, reference_logits(model, tokens))
    print(f"\n{arch}: max|dlogit|/scale = {rel:.2e} (scale {scale:.2f}, {len(tokens)} positions)")
    assert rel <= FLOAT32_REORDER_OF_SCALE


def test_greedy_matches_transformers(checkpoint, model):
    prompt = [int(t) for t in parity_tokens(model, checkpoint[1])[:PROMPT_TOKENS]]
    assert checkpoint[1].eos_ids == sorted(model.tokenizer.eos_ids) and checkpoint[1].prompt == prompt
    assert generate(model, prompt, max_tokens=GREEDY_STEPS).tokens == checkpoint[1].greedy


def _selections(model, tokens) -> list[tuple[np.ndarray, np.ndarray]]:
    """(queries [T, Hi, di], block keys [B, di]) of every indexed attention layer's selection."""
    seen = []
    original = qsa.selected_keys

    def spy(cfg_, queries, blocks, positions, n_keys):
        seen.append((queries, blocks))
        return original(cfg_, queries, blocks, positions, n_keys)

    qsa.selected_keys = spy
    try:
        reference_logits(model, tokens)
    finally:
        qsa.selected_keys = original
    return seen


def test_no_tie_decides_a_qsa_selection(checkpoint, model):
    cfg = model.cfg
    tokens = parity_tokens(model, checkpoint[1])
    selections = _selections(model, tokens)
    assert len(selections) == sum(k.mixer is Mixer.INDEXED_ATTENTION for k in cfg.kinds)
    top, limited = cfg.qwen4.indexer_budget // cfg.qwen4.indexer_block, 0
    for layer, (queries, blocks) in enumerate(selections):
        for p in range(len(queries)):
            complete = (p + 1) // cfg.qwen4.indexer_block
            if complete <= top:
                continue
            limited += 1
            scores = np.sort(np.maximum(queries[p] @ blocks[:complete].T, 0).sum(axis=0))[::-1]
            assert scores[top - 1] - scores[top] > QSA_TIE_MARGIN * max(scores[0], 1e-6), (layer, p)
    assert limited > 0  # the selection decides something in every fixture
