"""`strata convert` of the hybrid families against transformers: Qwen3-Next, Qwen3.5-MoE text-only
and the published multimodal layout (tests/hf_hybrid.py builds them; they are checked in under
tests/fixtures/hf/ with transformers' outputs on them: tests/hf_fixtures.py).

As tests/convert/test_convert.py does for the other families, teacher-forced over PARITY_TEXT (131
positions): f16 experts within HYBRID_F16_LOGIT_BUDGET of the logit scale and the same 32 greedy
tokens as transformers' generate; q8_0 the same argmax on >= Q8_ARGMAX_AGREEMENT of positions;
q2_0 KLD printed (-s) and held to a sanity bound. Then: fused gate_up experts convert to the same
model, the vision tower is skipped with a note, and every refused config value is one line
naming its key.
"""

from __future__ import annotations

import os
import shutil

import numpy as np
import pytest

os.environ.setdefault("HF_HUB_OFFLINE", "1")
os.environ.setdefault("TRANSFORMERS_OFFLINE", "1")

from tests import hf_hybrid, hf_models  # noqa: E402
from strata.convert import convert  # noqa: E402
from strata.convert.safetensors_reader import Checkpoint  # noqa: E402
from strata.errors import ConfigError  # noqa: E402
from strata.formats.quant_types import QuantType  # noqa: E402
from strata.generate import generate  # noqa: E402
from strata.loader import load  # noqa: E402
from strata.model_config import Mixer  # noqa: E402
from tests.budgets import HYBRID_F16_LOGIT_BUDGET, Q2_KLD_SANITY, Q8_ARGMAX_AGREEMENT  # noqa: E402
from tests.convert_parity import (argmax_agreement, assert_refused_in_one_line, convert_each, logit_error,  # noqa: E402
                                  mean_kld, parity_tokens, reference_logits, save_as_one_file, with_config)
from tests.hf_fixtures import GREEDY_STEPS, PROMPT_TOKENS  # noqa: E402


@pytest.fixture(scope="module", params=hf_hybrid.ARCHS)
def arch(request):
    return request.param


@pytest.fixture(scope="module")
def checkpoint(arch, tmp_path_factory):
    return hf_hybrid.cached_checkpoint(arch, tmp_path_factory)


@pytest.fixture(scope="module")
def converted(arch, checkpoint, tmp_path_factory):
    return convert_each(checkpoint[0], tmp_path_factory.mktemp(f"strata_{arch}"),
                        (QuantType.F16, QuantType.Q8_0, QuantType.Q2_0))


def test_f16_logits_match_transformers(arch, checkpoint, converted):
    model = converted[QuantType.F16][0]
    tokens = parity_tokens(model, checkpoint[1])
    assert len(tokens) >= 128
    ref, got = checkpoint[1].logits, reference_logits(model, tokens)
    rel, scale = logit_error(ref, got)
    print(f"\n{arch} f16: max|dlogit|/scale = {rel:.2e} (scale {scale:.2f}, {len(tokens)} positions), "
          f"KLD {mean_kld(ref, got):.2e}")
    assert rel <= HYBRID_F16_LOGIT_BUDGET


def test_f16_greedy_matches_transformers(arch, checkpoint, converted):
    model = converted[QuantType.F16][0]
    prompt = [int(t) for t in parity_tokens(model, checkpoint[1])[:PROMPT_TOKENS]]
    # transformers' generate ran with strata's stop tokens and this prompt
    assert checkpoint[1].eos_ids == sorted(model.tokenizer.eos_ids) and checkpoint[1].prompt == prompt
    ours = generate(model, prompt, max_tokens=GREEDY_STEPS).tokens
    assert ours == checkpoint[1].greedy and len(ours) == GREEDY_STEPS


def test_q8_0_argmax_agrees(arch, checkpoint, converted):
    model = converted[QuantType.Q8_0][0]
    tokens = parity_tokens(model, checkpoint[1])
    ref, got = checkpoint[1].logits, reference_logits(model, tokens)
    agree = argmax_agreement(ref, got)
    print(f"\n{arch} q8_0: argmax agreement {agree:.4f} over {len(tokens)} positions, KLD {mean_kld(ref, got):.2e}")
    assert agree >= Q8_ARGMAX_AGREEMENT


def test_q2_0_kld_reported(arch, checkpoint, converted):
    model = converted[QuantType.Q2_0][0]
    tokens = parity_tokens(model, checkpoint[1])
    ref, got = checkpoint[1].logits, reference_logits(model, tokens)
    kld = mean_kld(ref, got)
    agree = argmax_agreement(ref, got)
    print(f"\n{arch} q2_0: mean KLD {kld:.4f} nats, argmax agreement {agree:.3f} over {len(tokens)} positions")
    assert np.isfinite(kld) and kld < Q2_KLD_SANITY


def test_config_carried_over(arch, checkpoint, converted):
    cfg, r = converted[QuantType.F16][0].cfg, converted[QuantType.F16][1]
    assert cfg.architecture == arch
    assert [k.mixer for k in cfg.kinds] == [Mixer.DELTANET] * 3 + [Mixer.ATTENTION]
    assert cfg.rotary_dim == int(hf_hybrid.HEAD_DIM * hf_hybrid.PARTIAL_ROTARY) and cfg.attention_output_gate
    assert (cfg.deltanet.linear_k_heads, cfg.deltanet.linear_v_heads, cfg.deltanet.linear_conv_kernel) == (2, 4, 4)
    assert cfg.shared_expert_gated and cfg.shared_ffn_size == hf_hybrid.SHARED_FFN
    skipped_vision = any("vision tower" in n for n in r.notes)
    assert skipped_vision == (arch == "qwen3_5_moe")


# ---------------------------------------------------------------- layouts and refusals


def test_fused_gate_up_experts_convert_to_the_same_model(checkpoint, converted, arch, tmp_path):
    """transformers 5's in-memory expert layout (gate_up_proj [E, 2F, D], down_proj [E, D, F])."""
    if arch != "qwen3_next":
        pytest.skip("one family is enough: the expert reader is shared")
    src = tmp_path / "fused"
    shutil.copytree(checkpoint[0], src)
    with Checkpoint(src) as ck:
        tensors = {n: ck.read(n) for n in ck.tensors}
    for l in range(hf_hybrid.LAYERS):
        base = f"model.layers.{l}.mlp.experts."
        per = lambda e, p: tensors.pop(f"{base}{e}.{p}.weight")  # noqa: E731
        gate_up = [np.concatenate([per(e, "gate_proj"), per(e, "up_proj")]) for e in range(hf_models.EXPERTS)]
        tensors[base + "gate_up_proj"] = np.stack(gate_up)
        tensors[base + "down_proj"] = np.stack([per(e, "down_proj") for e in range(hf_models.EXPERTS)])
    save_as_one_file(src, tensors)
    model = load(convert(src, tmp_path / "out", expert_type=QuantType.F16).model_path)
    tokens = parity_tokens(model)
    want = reference_logits(converted[QuantType.F16][0], tokens)
    np.testing.assert_array_equal(reference_logits(model, tokens), want)


REFUSALS = [
    (lambda c: c.update(some_new_feature=1), "config key 'some_new_feature'"),
    (lambda c: c.update(mlp_only_layers=[1]), "dense MLP layers"),
    (lambda c: c.update(layer_types=["linear_attention", "sliding_attention", "linear_attention",
                                     "full_attention"]), "layer type 'sliding_attention'"),
    (lambda c: c["rope_parameters"].update(rope_type="yarn", factor=4.0), "rope_type = 'yarn'"),
    (lambda c: c["rope_parameters"].update(partial_rotary_factor=0.1), "partial_rotary_factor = 0.1"),
    (lambda c: c.update(attn_output_gate=False), "attn_output_gate"),
    (lambda c: c.update(hidden_act="gelu"), "hidden_act"),
]


@pytest.mark.parametrize("change, message", REFUSALS, ids=[m for _, m in REFUSALS])
def test_unhandled_config_values_are_refused_in_one_line(checkpoint, arch, change, message, tmp_path):
    if arch != "qwen3_next":
        pytest.skip("the key table is shared by both families")
    assert_refused_in_one_line(with_config(checkpoint[0], tmp_path / "ckpt", change), tmp_path / "out", message)


def test_an_unknown_key_in_the_multimodal_text_config_is_named(checkpoint, arch, tmp_path):
    if arch != "qwen3_5_moe":
        pytest.skip("the nested layout only")
    src = with_config(checkpoint[0], tmp_path / "ckpt", lambda c: c["text_config"].update(some_new_feature=True))
    with pytest.raises(ConfigError, match="config key 'some_new_feature' in text_config"):
        convert(src, tmp_path / "out", expert_type=QuantType.F16)
