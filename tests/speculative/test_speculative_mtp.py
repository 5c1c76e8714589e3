"""The MTP drafter (strata/speculative/mtp.py) through `strata.generate` on a made hybrid model
that keeps an MTP layer (random weights: drafts are mostly rejected, which exercises the
rollback): greedy output identical with and without MTP drafting on every engine (the
reference, numpy streaming with every slot and at the smallest legal arena; MLX where it is
installed), its draft the MTP reference's argmax over the target's hidden states, and the
options refused in one line where they cannot work."""

from __future__ import annotations

import numpy as np
import pytest

import strata
from strata.config import Config
from strata.errors import ConfigError, ParameterError
from strata.formats.quant_types import QuantType
from strata.model_config import TensorNames
from strata.reference.attention import rms_norm
from strata.reference.model import forward
from strata.reference.model_state import ModelState
from strata.reference.mtp import MtpShape, MtpWeights, mtp_logits
from strata.speculative import MtpDrafter, drafter_for
from strata.speculative.mtp import drafter_dense
from strata.testing.models import make_model
from mtp_checks import assert_mtp_drafting_is_lossless  # noqa: E402

PROMPT = list(b"x = f(a)\ny = f(b)\nz = f(")
TOKENS = 16
EXACT0 = Config(moce_lambda=0.0, spec_gate=False)  # gate off: every window drafts
KINDS = ["reference", "numpy-full", "numpy-min", "mlx-resident", "mlx-min"]


@pytest.fixture(scope="module")
def model(tmp_path_factory):
    made = make_model(tmp_path_factory.mktemp("mtp") / "hybrid", "hybrid", seed=3, dense_type=QuantType.F16,
                      mtp_layers=1)
    m = strata.load(made.model_path)
    yield m
    m.close()


@pytest.mark.parametrize("kind", KINDS)
def test_greedy_output_is_the_same_with_mtp_drafting(model, kind):
    assert_mtp_drafting_is_lossless(model, kind, PROMPT, TOKENS, EXACT0)



def test_the_draft_is_the_mtp_layers_argmax_over_the_targets_hidden_states(model):
    cfg, n = model.cfg, TensorNames
    context = PROMPT + [7, 11]
    drafter = MtpDrafter(model)
    drafter.start(PROMPT)
    drafter.extend([7])
    drafter.draft(1)  # the hidden states so far, then the rest: catching up in pieces
    drafter.extend([11])
    got = drafter.draft(3)
    x, _ = forward(model.resident_params(), ModelState.empty(cfg), np.asarray(context[:-1]), hidden=True)
    hidden = rms_norm(x, model.dense[n.output_norm], cfg.rms_norm_eps)
    logits = mtp_logits(MtpWeights.from_dense(drafter_dense(model), cfg.n_experts), MtpShape.of(cfg), hidden,
                        np.asarray(context[1:]), model.dense[n.token_embd], model.dense[n.output],
                        np.arange(len(hidden)))
    assert got.tokens == (int(np.argmax(logits[-1])),) and got.probs is None
    assert np.isfinite(logits).all()


def test_mtp_draft_is_refused_where_it_cannot_work(tmp_path):
    with pytest.raises(ConfigError, match="choose one"):
        Config(mtp_draft=True, suffix_draft=2)
    assert Config(mtp_draft=True).window >= 2
    made = make_model(tmp_path / "plain", "hybrid", seed=1)
    with strata.load(made.model_path) as plain:
        with pytest.raises(ParameterError, match="has no MTP layer") as err:
            drafter_for(Config(mtp_draft=True), plain)
        assert "\n" not in str(err.value)


def test_mtp_draft_needs_the_engines_model():
    with pytest.raises(ParameterError, match="no model to read the MTP layer from"):
        drafter_for(Config(mtp_draft=True), None)
