"""`strata convert` of gpt-oss against transformers on tiny checkpoints built offline
(tests/hf_gpt_oss.py: the bf16 form and the released MXFP4 form of one trained model), checked in
with transformers' outputs on them (tests/fixtures/hf/gpt_oss_<form>/): no torch at test time.

Teacher-forced over PARITY_TEXT (131 positions, longer than the sliding window of 16, so the
sinks and the window both shape the result): f16 experts (bf16 form) within
GPT_OSS_F16_LOGIT_BUDGET of the logit scale, MXFP4 experts kept bit for bit (MXFP4 form) within
GPT_OSS_MXFP4_LOGIT_BUDGET of transformers' own dequantization; 32 greedy tokens identical to
transformers' generate (with its sliding-window cache) for both; q8_0 the same argmax on >=
Q8_ARGMAX_AGREEMENT of positions, q2_0's KLD printed (-s) and held to a sanity bound. Then the
records hold the checkpoint's bytes, and every refused config value is one line naming it.
"""

from __future__ import annotations

import os

import numpy as np
import pytest

os.environ.setdefault("HF_HUB_OFFLINE", "1")
os.environ.setdefault("TRANSFORMERS_OFFLINE", "1")
pytest.importorskip("transformers")

from tests import hf_fixtures, hf_gpt_oss, hf_models  # noqa: E402
from strata.convert import convert  # noqa: E402
from strata.convert.safetensors_reader import Checkpoint  # noqa: E402
from strata.formats.experts_file import ExpertsFile  # noqa: E402
from strata.formats.quant_types import QuantType  # noqa: E402
from strata.generate import generate  # noqa: E402
from strata.loader import load  # noqa: E402
from strata.model_config import ExpertKind, Mixer, RopeScaling  # noqa: E402
from tests.convert_parity import (argmax_agreement, assert_refused_in_one_line, logit_error, mean_kld,  # noqa: E402
                                  parity_tokens, reference_logits, with_config)
from tests.budgets import (GPT_OSS_F16_LOGIT_BUDGET, GPT_OSS_MXFP4_LOGIT_BUDGET, Q2_KLD_SANITY,  # noqa: E402
                           Q8_ARGMAX_AGREEMENT)

# (form, --experts) -> what the conversion is held to
CONVERSIONS = [("bf16", QuantType.F16), ("bf16", QuantType.Q8_0), ("bf16", QuantType.Q2_0), ("mxfp4", None),
               ("mxfp4", QuantType.Q8_0)]


@pytest.fixture(scope="module")
def checkpoints(tmp_path_factory):
    return {form: hf_gpt_oss.cached_checkpoint(form, tmp_path_factory) for form in hf_gpt_oss.FORMS}


@pytest.fixture(scope="module")
def converted(checkpoints, tmp_path_factory):
    out = tmp_path_factory.mktemp("strata_gpt_oss")
    models = {}
    for form, qt in CONVERSIONS:
        r = convert(checkpoints[form][0], out / f"{form}_{qt.name.lower() if qt is not None else 'kept'}",
                    expert_type=qt)
        models[form, qt] = (load(r.model_path), r)
    return models


@pytest.mark.parametrize("form, qt, budget", [("bf16", QuantType.F16, GPT_OSS_F16_LOGIT_BUDGET),
                                              ("mxfp4", None, GPT_OSS_MXFP4_LOGIT_BUDGET)], ids=["bf16-f16", "mxfp4"])
def test_logits_match_transformers(checkpoints, converted, form, qt, budget):
    model, r = converted[form, qt]
    assert r.expert_type is (QuantType.MXFP4 if qt is None else qt)
    tokens = parity_tokens(model, checkpoints[form][1])
    assert len(tokens) >= 128 and len(tokens) > hf_gpt_oss.WINDOW
    ref, got = checkpoints[form][1].logits, reference_logits(model, tokens)
    rel, scale = logit_error(ref, got)
    print(f"\ngpt_oss {form} ({r.expert_type.name}): max|dlogit|/scale = {rel:.2e} (scale {scale:.2f}, "
          f"{len(tokens)} positions), KLD {mean_kld(ref, got):.2e}")
    assert rel <= budget


@pytest.mark.parametrize("form, qt", [("bf16", QuantType.F16), ("mxfp4", None)], ids=["bf16-f16", "mxfp4"])
def test_greedy_matches_transformers(checkpoints, converted, form, qt):
    model = converted[form, qt][0]
    expected = checkpoints[form][1]
    prompt = [int(t) for t in parity_tokens(model, expected)[: hf_fixtures.PROMPT_TOKENS]]
    # transformers' generate (its sliding-window cache) ran on this prompt with these stop ids
    assert expected.prompt == prompt and expected.eos_ids == sorted(model.tokenizer.eos_ids)
    ours = generate(model, prompt, max_tokens=hf_fixtures.GREEDY_STEPS).tokens
    assert hf_fixtures.PROMPT_TOKENS + hf_fixtures.GREEDY_STEPS > hf_gpt_oss.WINDOW  # decode runs past the window
    assert ours == expected.greedy and len(ours) == hf_fixtures.GREEDY_STEPS


@pytest.mark.parametrize("form", ["bf16", "mxfp4"])
def test_q8_0_argmax_agrees(checkpoints, converted, form):
    model = converted[form, QuantType.Q8_0][0]
    tokens = parity_tokens(model, checkpoints[form][1])
    ref, got = checkpoints[form][1].logits, reference_logits(model, tokens)
    agree = argmax_agreement(ref, got)
    print(f"\ngpt_oss {form} q8_0: argmax agreement {agree:.4f} over {len(tokens)} positions, "
          f"KLD {mean_kld(ref, got):.2e}")
    assert agree >= Q8_ARGMAX_AGREEMENT


def test_q2_0_kld_reported(checkpoints, converted):
    model = converted["bf16", QuantType.Q2_0][0]
    tokens = parity_tokens(model, checkpoints["bf16"][1])
    ref, got = checkpoints["bf16"][1].logits, reference_logits(model, tokens)
    kld, agree = mean_kld(ref, got), argmax_agreement(ref, got)
    print(f"\ngpt_oss q2_0: mean KLD {kld:.4f} nats, argmax agreement {agree:.3f} over {len(tokens)} positions")
    assert np.isfinite(kld) and kld < Q2_KLD_SANITY


def test_config_carried_over(converted):
    cfg = converted["bf16", QuantType.F16][0].cfg
    assert cfg.architecture == "gpt_oss"
    assert [k.mixer for k in cfg.kinds] == [Mixer.SLIDING_ATTENTION, Mixer.ATTENTION]
    assert cfg.gpt_oss.sliding_window == hf_gpt_oss.WINDOW and cfg.max_context == hf_models.MAX_POSITIONS  # not capped
    g = cfg.gpt_oss
    assert g.router_logit_bias and g.expert_bias and g.attention_sinks and g.attention_output_bias
    assert cfg.gpt_oss.expert_kind is ExpertKind.CLAMPED_SWIGLU and cfg.gpt_oss.swiglu_limit == hf_gpt_oss.SWIGLU_LIMIT
    assert cfg.yarn.rope_scaling is RopeScaling.YARN and cfg.yarn.yarn_factor == 8.0 and not cfg.yarn.yarn_truncate
    assert cfg.yarn.yarn_attention_factor == pytest.approx(0.1 * np.log(8.0) + 1.0, rel=1e-15)


def test_mxfp4_experts_are_the_checkpoints_bytes(checkpoints, converted):
    """gate = even rows of gate_up_proj_blocks, up = odd rows, down as stored; scales alike."""
    r = converted["mxfp4", None][1]
    with Checkpoint(checkpoints["mxfp4"][0]) as ck, ExpertsFile.open(r.experts_path) as xf:
        assert xf.header.qtype is QuantType.MXFP4 and xf.header.biases
        for layer, e in ((0, 0), (1, hf_models.EXPERTS - 1)):
            base = f"model.layers.{layer}.mlp.experts."
            raw = lambda n: ck.read_raw(base + n, np.dtype(np.uint8), e)  # noqa: E731
            w = xf.expert(layer, e)
            gu_codes = raw("gate_up_proj_blocks").reshape(2 * hf_models.EXPERT_FFN, -1)
            gu_scales = raw("gate_up_proj_scales")
            np.testing.assert_array_equal(w.gate.codes, gu_codes[0::2])
            np.testing.assert_array_equal(w.up.codes, gu_codes[1::2])
            np.testing.assert_array_equal(w.gate.scales, gu_scales[0::2])
            np.testing.assert_array_equal(w.up.scales, gu_scales[1::2])
            np.testing.assert_array_equal(w.down.codes, raw("down_proj_blocks").reshape(hf_models.HIDDEN, -1))
            np.testing.assert_array_equal(w.down.scales, raw("down_proj_scales"))
            bias = ck.read(base + "gate_up_proj_bias", e)
            np.testing.assert_array_equal(w.biases.gate, bias[0::2])
            np.testing.assert_array_equal(w.biases.up, bias[1::2])
            np.testing.assert_array_equal(w.biases.down, ck.read(base + "down_proj_bias", e))


def test_the_released_configs_v4_rope_form_reads_the_same(checkpoints, converted, tmp_path):
    """The released config.json spells YaRN as `rope_scaling` + a top-level `rope_theta` (v4)."""
    def to_v4(config: dict) -> None:
        rope = config.pop("rope_parameters")
        config.update(rope_theta=rope.pop("rope_theta"), rope_scaling=rope,
                      experts_per_token=config["num_experts_per_tok"],
                      initial_context_length=rope["original_max_position_embeddings"])

    src = with_config(checkpoints["mxfp4"][0], tmp_path / "ckpt", to_v4)
    r = convert(src, tmp_path / "out")
    assert r.cfg == converted["mxfp4", None][0].cfg


REFUSALS = [
    (lambda c: c.update(some_new_feature=1), "config key 'some_new_feature'"),
    (lambda c: c.update(layer_types=["sliding_attention", "chunked_attention"]), "layer type 'chunked_attention'"),
    (lambda c: c["rope_parameters"].update(rope_type="linear"), "rope_type = 'linear'"),
    (lambda c: c["rope_parameters"].update(partial_rotary_factor=0.5), "partial_rotary_factor = 0.5"),
    (lambda c: c["rope_parameters"].update(low_freq_factor=1.0), "rope_parameters key 'low_freq_factor'"),
    (lambda c: c.update(quantization_config={"quant_method": "fp8"}), "quant_method = 'fp8'"),
    (lambda c: c.update(sliding_window=None), "sliding_window must be a positive integer"),
]


@pytest.mark.parametrize("change, message", REFUSALS, ids=[m for _, m in REFUSALS])
def test_unhandled_config_values_are_refused_in_one_line(checkpoints, change, message, tmp_path):
    assert_refused_in_one_line(with_config(checkpoints["bf16"][0], tmp_path / "ckpt", change), tmp_path / "out",
                               message)
