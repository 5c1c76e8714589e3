"""Engines on a Qwen4-Exp model (the made shape `qwen4`: hyper-connection streams, DeltaNet layers
with PLE modules, indexed attention): the reference engine and the numpy streaming engine
(experts paged through the smallest legal arena and through one holding every expert; PLE rows
resident) against the reference forward, bit for bit where positions are grouped alike; a decode
window, trim at a kept position; MLX refused in one line naming the field.
"""

from __future__ import annotations

import numpy as np
import pytest

import strata
from strata.formats.quant_types import QuantType
from strata.reference.model import ModelState, forward
from strata.testing.models import make_model
from engine_kinds import EXACT0, agree, open_kind  # noqa: E402

KINDS = ["reference", "numpy-min", "numpy-full"]


@pytest.fixture(scope="module")
def model(tmp_path_factory):
    made = make_model(tmp_path_factory.mktemp("q4e") / "qwen4", "qwen4", seed=7, expert_type=QuantType.F16)
    m = strata.load(made.model_path)
    yield m
    m.close()


def _prompt(model) -> list[int]:
    eos = model.cfg.qwen4.ngram_eos_token
    return list(b"def fib(n):") + [eos] + list(b" return n")


@pytest.mark.parametrize("kind", KINDS)
def test_prefill_and_decode_match_the_reference_forward(model, kind):
    prompt, follow = _prompt(model), list(b"abcdefgh")
    whole, _ = forward(model.resident_params(), ModelState.empty(model.cfg), np.asarray(prompt + follow))
    with open_kind(model, kind, EXACT0) as engine:
        last = engine.prefill(np.asarray(prompt))
        agree(kind, whole[len(prompt) - 1], last, "prefill", regrouped=True)
        for i, t in enumerate(follow):
            agree(kind, whole[len(prompt) + i], engine.decode(t), f"decode {i}", regrouped=True)


@pytest.mark.parametrize("kind", KINDS)
def test_window_then_trim_at_a_kept_position(model, kind):
    prompt, drafts = _prompt(model), list(b"xyzw")
    whole, _ = forward(model.resident_params(), ModelState.empty(model.cfg), np.asarray(prompt + drafts))
    with open_kind(model, kind, EXACT0) as engine:
        engine.prefill(np.asarray(prompt))
        got = engine.decode_window(np.asarray(drafts))
        agree(kind, whole[len(prompt):], got, "window", regrouped=True)
        keep = len(prompt) + 2
        assert engine.kept_position(keep) == keep  # a window keeps every position
        engine.trim(keep)
        agree(kind, whole[keep], engine.decode(drafts[2]), "after trim", regrouped=True)


def test_a_prompt_in_chunks_matches_the_reference_forward(model):
    """The streaming prompt path in chunks of 5: each chunk's PLE layers hash after the previous
    chunk's n-gram context, its QSA layer selects over every earlier chunk's blocks."""
    prompt = _prompt(model) * 2
    whole, _ = forward(model.resident_params(), ModelState.empty(model.cfg), np.asarray(prompt + [7]))
    with open_kind(model, "numpy-min", EXACT0.replace(prefill_chunk=5)) as engine:
        agree("numpy-min", whole[len(prompt) - 1], engine.prefill(np.asarray(prompt)), "prefill", regrouped=True)
        agree("numpy-min", whole[len(prompt)], engine.decode(7), "decode", regrouped=True)
