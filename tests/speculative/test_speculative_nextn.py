"""The MTP drafter over DeepSeek-V3's and GLM-4.5's nextn layer (strata/reference/nextn.py) through
`strata.generate`: the tiny checked-in deepseek_v3 / glm4_moe checkpoint with a nextn layer added
(tests/hf_nextn.py; random weights, so drafts are mostly rejected, which exercises the rollback)
converts (Q2_0 experts: what MLX computes off a GPU); greedy output is identical with and
without MTP drafting on every engine (the reference, numpy streaming with every slot and at the
smallest legal arena; MLX where it is installed); and the drafter's logits are the published module's, computed independently from the
checkpoint's tensors (numpy for enorm / hnorm / eh_proj / shared_head, transformers' own
DeepseekV3DecoderLayer / Glm4MoeDecoderLayer for the decoder layer, DeepSeek's rope interleaved
as published)."""

from __future__ import annotations

import numpy as np
import pytest

pytest.importorskip("torch")
pytest.importorskip("transformers")

import strata  # noqa: E402
from strata.config import Config  # noqa: E402
from strata.convert import convert  # noqa: E402
from strata.formats.quant_types import QuantType  # noqa: E402
from strata.model_config import TensorNames  # noqa: E402
from strata.reference.attention import rms_norm  # noqa: E402
from strata.reference.model import forward  # noqa: E402
from strata.reference.model_state import ModelState  # noqa: E402
from strata.speculative import MtpDrafter  # noqa: E402
from tests.hf_nextn import checkpoint_with_nextn, nextn_logits  # noqa: E402
from mtp_checks import assert_mtp_drafting_is_lossless  # noqa: E402

PROMPT = [5, 17, 40, 5, 17, 41, 5, 17]
TOKENS = 12
EXACT0 = Config(moce_lambda=0.0, spec_gate=False)  # gate off: every window drafts
KINDS = ["reference", "numpy-full", "numpy-min", "mlx-resident", "mlx-min"]
LOGITS_ATOL = 2e-5  # float32 numpy vs torch float32 over one decoder layer (measured 2.9e-6 on logits spanning ~10)


@pytest.fixture(scope="module", params=["deepseek_v3", "glm4_moe"])
def made(request, tmp_path_factory):
    src, nextn, layer, config = checkpoint_with_nextn(tmp_path_factory, request.param)
    out = tmp_path_factory.mktemp("nextn_model") / "model"
    model = strata.load(convert(src, out, expert_type=QuantType.Q2_0, dense_type=QuantType.F32).model_path)
    yield model, nextn, layer, config
    model.close()


@pytest.mark.parametrize("kind", KINDS)
def test_greedy_output_is_the_same_with_mtp_drafting(made, kind):
    assert_mtp_drafting_is_lossless(made[0], kind, PROMPT, TOKENS, EXACT0)



def test_the_draft_is_the_published_modules_argmax(made):
    model, nextn, layer, config = made
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
    embedding = np.asarray(model.dense[n.token_embd], np.float32)
    want = nextn_logits(config, nextn, layer, hidden, embedding[np.asarray(context[1:])])
    ours = drafter.nextn.logits(hidden, embedding[np.asarray(context[1:])])
    np.testing.assert_allclose(ours, want, rtol=0, atol=LOGITS_ATOL)
    assert np.ptp(want[-1]) > 100 * LOGITS_ATOL  # the logits are not flat: the comparison can fail
    assert got.tokens == (int(np.argmax(want[-1])),) and got.probs is None
