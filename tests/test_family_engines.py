"""The (family x engine) table: every family's made model, through every engine, agrees with the
numpy reference's forward. A new family joins by adding a row (docs/adding-a-family.md).

Each row is a made shape (strata/families/<family>.py MADE_SHAPES, or a shared one) and how its
made model is written; each engine prefills a short prompt and decodes a few tokens, and every
logit row is held to `reference.model.forward` over the whole sequence: bit for bit up to float32
reordering on the numpy engines (FLOAT32_REORDER: the prompt is one call there, positions grouped
otherwise), FORWARD on MLX. The families' own engine tests (trim, windows, streaming at every
arena, quantized experts) stay in their files; this table is the one every family is in.
"""

from __future__ import annotations

from dataclasses import dataclass, field

import numpy as np
import pytest

import strata
from strata.formats.quant_types import QuantType
from strata.reference.model import ModelState, forward
from strata.testing.models import make_model
from engine_kinds import EXACT0, agree, open_kind  # noqa: E402


@dataclass(frozen=True)
class Row:
    family: str
    shape: str  # a key of strata.testing.models.SHAPES
    make: dict = field(default_factory=dict)  # make_model's keywords (quant types)


F16_DENSE = {"dense_type": QuantType.F16}
ROWS = (
    Row("shared layers (Qwen3-MoE-like)", "tiny"),
    Row("shared layers, a dense first layer", "dense-first", F16_DENSE),
    Row("Qwen3-Next / Qwen3.5-MoE", "hybrid", F16_DENSE),
    Row("DeepSeek-V3 routing", "sigmoid", F16_DENSE),
    Row("DeepSeek-V3 latent attention", "mla", F16_DENSE),
    Row("gpt-oss", "gpt-oss", F16_DENSE),
    Row("Qwen4-Exp", "qwen4"),
)
ENGINES = ("reference", "numpy-min", "mlx-resident")
PROMPT = list(b"def fib(n): ret")  # past gpt-oss's made window (8) and Qwen4-Exp's indexer budget (8)
FOLLOW = list(b"urn")


@pytest.fixture(scope="module", params=ROWS, ids=lambda r: r.shape)
def row_model(request, tmp_path_factory):
    row = request.param
    made = make_model(tmp_path_factory.mktemp("family") / row.shape, row.shape, seed=11, **row.make)
    model = strata.load(made.model_path)
    tokens = np.asarray(PROMPT + FOLLOW)
    whole, _ = forward(model.resident_params(), ModelState.empty(model.cfg), tokens)
    yield row, model, whole
    model.close()


@pytest.mark.parametrize("kind", ENGINES)
def test_family_through_engine(row_model, kind):
    row, model, whole = row_model
    with open_kind(model, kind, EXACT0) as engine:
        got = [engine.prefill(np.asarray(PROMPT))] + [engine.decode(t) for t in FOLLOW]
    want = whole[len(PROMPT) - 1:]
    agree(kind, want, np.stack(got), f"{row.family} ({row.shape}) on {kind}", regrouped=True)
