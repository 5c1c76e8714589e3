"""DeepSeek-V3 / Kimi-K2 YaRN: the converter reads `rope_scaling` (v4) / `rope_parameters` (v5) of
type yarn, and strata's latent attention computes what transformers does with it.

- Parity on the tiny deepseek_v3_yarn checkpoint (tests/hf_deepseek_yarn.py: factor 4 over 64
  original positions, mscale 1, mscale_all_dim 0.8): f16 experts within
  SIGMOID_F16_LOGIT_BUDGET of the logit scale teacher-forced over every parity position (> 128),
  the same 32 greedy tokens, q8_0 the same argmax at Q8_ARGMAX_AGREEMENT; and dropping YaRN's
  frequencies or its softmax mscale each moves the logits far past the budget (the fixture
  exercises both).
- The published config.json of DeepSeek-V3 and of Kimi-K2-Instruct: refused as published in one
  line naming their FP8 `quantization_config`; their bf16 releases (the same config without it)
  accepted with the YaRN fields, the frequencies and attention factor equal to transformers' own
  `_compute_yarn_parameters`, and the softmax scale to its `yarn_apply_mscale`.
"""

from __future__ import annotations

import copy
import dataclasses
import math
import os
from pathlib import Path

import numpy as np
import pytest

os.environ.setdefault("HF_HUB_OFFLINE", "1")
os.environ.setdefault("TRANSFORMERS_OFFLINE", "1")
pytest.importorskip("transformers")

from tests import hf_fixtures  # noqa: E402
from tests.budgets import SIGMOID_F16_LOGIT_BUDGET, Q8_ARGMAX_AGREEMENT  # noqa: E402
from tests.doctor_configs import DEEPSEEK_V3  # noqa: E402
from tests.hf_fixtures import GREEDY_STEPS, PROMPT_TOKENS  # noqa: E402
from strata.convert import convert  # noqa: E402
from strata.convert.deepseek import deepseek_config  # noqa: E402
from strata.convert.hf_config import HFConfig  # noqa: E402
from strata.errors import ConfigError  # noqa: E402
from strata.formats.quant_types import QuantType  # noqa: E402
from strata.generate import generate  # noqa: E402
from strata.loader import load  # noqa: E402
from strata.model_config import Ffn, Mixer, RopeScaling  # noqa: E402
from strata.reference.mla import softmax_scale  # noqa: E402
from strata.reference.model import ModelState, forward  # noqa: E402
from strata.reference.rope_scaling import rope_frequencies  # noqa: E402

ARCH = "deepseek_v3_yarn"

# moonshotai/Kimi-K2-Instruct's config.json (the DeepSeek-V3 layout; its auto_map dropped)
KIMI_K2 = {
    "architectures": ["DeepseekV3ForCausalLM"], "attention_bias": False, "attention_dropout": 0.0,
    "aux_loss_alpha": 0.001, "bos_token_id": 163584, "eos_token_id": 163585, "first_k_dense_replace": 1,
    "hidden_act": "silu", "hidden_size": 7168, "initializer_range": 0.02, "intermediate_size": 18432,
    "kv_lora_rank": 512, "max_position_embeddings": 131072, "model_type": "kimi_k2", "moe_intermediate_size": 2048,
    "moe_layer_freq": 1, "n_group": 1, "n_routed_experts": 384, "n_shared_experts": 1, "norm_topk_prob": True,
    "num_attention_heads": 64, "num_experts_per_tok": 8, "num_hidden_layers": 61, "num_key_value_heads": 64,
    "num_nextn_predict_layers": 0, "pretraining_tp": 1, "q_lora_rank": 1536, "qk_nope_head_dim": 128,
    "qk_rope_head_dim": 64,
    "quantization_config": {"activation_scheme": "dynamic", "fmt": "e4m3", "quant_method": "fp8",
                            "weight_block_size": [128, 128]},
    "rms_norm_eps": 1e-06,
    "rope_scaling": {"beta_fast": 1.0, "beta_slow": 1.0, "factor": 32.0, "mscale": 1.0, "mscale_all_dim": 1.0,
                     "original_max_position_embeddings": 4096, "type": "yarn"},
    "rope_theta": 50000.0, "routed_scaling_factor": 2.827, "scoring_func": "sigmoid", "seq_aux": True,
    "tie_word_embeddings": False, "topk_group": 1, "topk_method": "noaux_tc", "torch_dtype": "bfloat16",
    "transformers_version": "4.48.3", "use_cache": True, "v_head_dim": 128, "vocab_size": 163840,
}
PUBLISHED = {"deepseek_v3": DEEPSEEK_V3, "kimi_k2": KIMI_K2}


def _config(raw: dict):
    """ModelConfig of a config.json alone (no checkpoint: no tensor is consulted for these keys)."""
    return deepseek_config(HFConfig(Path("config.json"), raw), frozenset())


def _bf16(raw: dict) -> dict:
    out = copy.deepcopy(raw)
    del out["quantization_config"]
    return out


@pytest.mark.parametrize("name", list(PUBLISHED))
def test_the_published_fp8_config_is_refused_in_one_line(name):
    with pytest.raises(ConfigError) as e:
        _config(PUBLISHED[name])
    msg = str(e.value)
    assert "\n" not in msg and "quantization_config: fp8" in msg


@pytest.mark.parametrize("name", list(PUBLISHED))
def test_the_published_config_in_bf16_is_accepted_with_transformers_yarn(name):
    pytest.importorskip("torch")  # transformers' rope helpers build torch tensors
    import transformers
    from transformers.modeling_rope_utils import ROPE_INIT_FUNCTIONS
    from transformers.models.deepseek_v3.modeling_deepseek_v3 import yarn_apply_mscale

    raw = _bf16(PUBLISHED[name])
    cfg = _config(raw)
    rs = raw["rope_scaling"]
    assert cfg.yarn.rope_scaling is RopeScaling.YARN and cfg.yarn.yarn_factor == rs["factor"]
    assert cfg.yarn.yarn_original_context == rs["original_max_position_embeddings"] == 4096
    yarn = cfg.yarn
    assert (yarn.yarn_beta_fast, yarn.yarn_beta_slow, yarn.yarn_truncate) == (rs["beta_fast"], rs["beta_slow"], True)
    assert cfg.yarn.yarn_mscale_all_dim == 1.0 and cfg.rope_theta == raw["rope_theta"]
    assert all(k.mixer is Mixer.MLA for k in cfg.kinds)
    assert [k.ffn for k in cfg.kinds[:raw["first_k_dense_replace"] + 1]] == [Ffn.DENSE] * raw["first_k_dense_replace"] + [Ffn.MOE]
    assert (cfg.n_experts, cfg.sigmoid.n_group, cfg.sigmoid.topk_group, cfg.n_heads) == (
        raw["n_routed_experts"], raw["n_group"], raw["topk_group"], raw["num_attention_heads"])
    assert (cfg.mla.kv_lora_rank, cfg.mla.q_lora_rank, cfg.mla.qk_rope_head_dim) == (512, 1536, 64)
    # transformers' own numbers for this config (its DeepseekV3Config reads the v4 spelling)
    hf = transformers.DeepseekV3Config(**{k: v for k, v in raw.items() if k != "model_type"})
    inv_freq, attention_factor = ROPE_INIT_FUNCTIONS["yarn"](hf)
    ours, factor = rope_frequencies(cfg, cfg.mla.qk_rope_head_dim)
    np.testing.assert_allclose(ours, inv_freq.double().numpy(), rtol=1e-6)  # theirs in float32
    assert factor == pytest.approx(attention_factor) == 1.0  # mscale = mscale_all_dim
    want = yarn_apply_mscale(hf.rope_parameters, (128 + 64) ** -0.5)
    assert softmax_scale(cfg) == pytest.approx(want, rel=1e-12)
    assert softmax_scale(cfg) == pytest.approx(192 ** -0.5 * (0.1 * math.log(rs["factor"]) + 1) ** 2)


def test_other_rope_scaling_is_refused_in_one_line():
    raw = _bf16(DEEPSEEK_V3)
    raw["rope_scaling"] = dict(raw["rope_scaling"], type="longrope")
    with pytest.raises(ConfigError, match="rope_type = 'longrope'") as e:
        _config(raw)
    assert "\n" not in str(e.value)
    raw["rope_scaling"] = dict(DEEPSEEK_V3["rope_scaling"], partial_rotary_factor=0.5)
    with pytest.raises(ConfigError, match="partial_rotary_factor"):
        _config(raw)


# ---------------------------------------------------------------- parity on the tiny yarn checkpoint


@pytest.fixture(scope="module")
def checkpoint(tmp_path_factory):
    return hf_fixtures.cached_checkpoint(ARCH, tmp_path_factory)


@pytest.fixture(scope="module")
def converted(checkpoint, tmp_path_factory):
    out = tmp_path_factory.mktemp("strata_yarn")
    return {qt: load(convert(checkpoint[0], out / qt.name.lower(), expert_type=qt).model_path)
            for qt in (QuantType.F16, QuantType.Q8_0)}


def _logits(model, tokens, cfg=None) -> np.ndarray:
    params = model.resident_params()
    if cfg is not None:
        params = dataclasses.replace(params, cfg=cfg)
    logits, _ = forward(params, ModelState.empty(params.cfg), tokens)
    return logits


def test_the_checkpoint_is_yarn(converted):
    cfg = converted[QuantType.F16].cfg
    yarn = cfg.yarn
    assert yarn.rope_scaling is RopeScaling.YARN and yarn.yarn_factor == 4.0 and yarn.yarn_original_context == 64
    assert cfg.yarn.yarn_mscale_all_dim == 0.8 and cfg.yarn.yarn_attention_factor == pytest.approx(
        (0.1 * math.log(4) + 1) / (0.08 * math.log(4) + 1))


def test_f16_logits_match_transformers(checkpoint, converted):
    model, want = converted[QuantType.F16], checkpoint[1]
    assert len(want.tokens) >= 128
    got = _logits(model, want.tokens)
    err = float(np.abs(got - want.logits).max()) / float(np.abs(want.logits).max())
    print(f"\n{ARCH} f16: max |dlogit| / scale {err:.2e} over {len(want.tokens)} positions")
    assert err <= SIGMOID_F16_LOGIT_BUDGET


def test_yarn_frequencies_and_mscale_each_matter(checkpoint, converted):
    model, want = converted[QuantType.F16], checkpoint[1]
    scale = float(np.abs(want.logits).max())
    cfg = model.cfg
    for what, other in (("no YaRN", cfg.with_fields(rope_scaling=RopeScaling.NONE)),
                        ("no softmax mscale", cfg.with_fields(yarn_mscale_all_dim=0.0))):
        err = float(np.abs(_logits(model, want.tokens, other) - want.logits).max()) / scale
        assert err > 10 * SIGMOID_F16_LOGIT_BUDGET, what


def test_f16_greedy_matches_transformers(checkpoint, converted):
    model, want = converted[QuantType.F16], checkpoint[1]
    prompt = [int(t) for t in want.tokens[:PROMPT_TOKENS]]
    assert want.prompt == prompt and want.eos_ids == sorted(model.tokenizer.eos_ids)
    ours = generate(model, prompt, max_tokens=GREEDY_STEPS).tokens
    assert ours == want.greedy and len(ours) == GREEDY_STEPS


def test_q8_0_argmax_agrees(checkpoint, converted):
    want = checkpoint[1]
    got = _logits(converted[QuantType.Q8_0], want.tokens)
    assert float(np.mean(got.argmax(-1) == want.logits.argmax(-1))) >= Q8_ARGMAX_AGREEMENT
