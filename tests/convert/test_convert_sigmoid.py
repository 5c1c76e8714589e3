"""The sigmoid-routed converters carry what makes their routing theirs: non-zero selection
biases per MoE layer (and ignoring them moves the logits far past the parity budget, so the
parity in test_convert.py shows they are applied), dense first layers, MLA fields, and MTP
layers are skipped, never loaded."""

from __future__ import annotations

import dataclasses
import os

import numpy as np
import pytest

os.environ.setdefault("HF_HUB_OFFLINE", "1")
os.environ.setdefault("TRANSFORMERS_OFFLINE", "1")
pytest.importorskip("transformers")

from tests import hf_models  # noqa: E402
from strata.convert import convert  # noqa: E402
from strata.convert.sigmoid_common import mtp_layer  # noqa: E402
from strata.formats.quant_types import QuantType  # noqa: E402
from strata.loader import load  # noqa: E402
from strata.model_config import Ffn, Mixer, TensorNames  # noqa: E402
from strata.reference.model import ModelParams, ModelState, forward  # noqa: E402
from tests.budgets import F16_LOGIT_BUDGET, SIGMOID_F16_LOGIT_BUDGET  # noqa: E402


@pytest.mark.parametrize("arch", ["deepseek_v3", "glm4_moe", "minimax_m2"])
def test_biases_are_carried_and_matter(arch, tmp_path_factory):
    directory, _ = hf_models.cached_checkpoint(arch, tmp_path_factory)
    model = load(convert(directory, tmp_path_factory.mktemp(f"sig_{arch}") / "m", expert_type=QuantType.F16).model_path)
    cfg = model.cfg
    assert cfg.sigmoid.router_bias and all(np.abs(model.dense[TensorNames.block(l, TensorNames.exp_probs_b)]).max() > 0
                                   for l in cfg.moe_layers)
    if arch != "minimax_m2":
        assert cfg.kinds[0].ffn is Ffn.DENSE and cfg.sigmoid.n_group == 4 and cfg.sigmoid.routed_scaling_factor == 2.5
    if arch == "deepseek_v3":
        assert all(k.mixer is Mixer.MLA for k in cfg.kinds) and cfg.mla.kv_lora_rank == 32
    params = model.resident_params()
    tokens = np.array(model.tokenizer.encode(hf_models.PARITY_TEXT)[:64])
    want, _ = forward(params, ModelState.empty(cfg), tokens)
    no_bias = {k: (np.zeros_like(v) if k.endswith(TensorNames.exp_probs_b) else v) for k, v in params.dense.items()}
    got, _ = forward(dataclasses.replace(params, dense=no_bias), ModelState.empty(cfg), tokens)
    assert np.abs(got - want).max() / np.abs(want).max() > 10 * F16_LOGIT_BUDGET


@pytest.mark.parametrize("arch", ["deepseek_v3", "glm4_moe", "glm4_moe_lite", "minimax_m2"])
def test_f16_logits_within_the_issue_budget(arch, tmp_path_factory):
    """The families' own bound (SIGMOID_F16_LOGIT_BUDGET, tighter than test_convert.py's
    family-wide one), teacher-forced over every parity position (>= 128)."""
    directory, want = hf_models.cached_checkpoint(arch, tmp_path_factory)
    model = load(convert(directory, tmp_path_factory.mktemp(f"sigb_{arch}") / "m", expert_type=QuantType.F16).model_path)
    assert len(want.tokens) >= 128
    got, _ = forward(model.resident_params(), ModelState.empty(model.cfg), want.tokens)
    err = float(np.abs(got - want.logits).max()) / float(np.abs(want.logits).max())
    print(f"\n{arch} f16: max|dlogit|/scale = {err:.2e} over {len(want.tokens)} positions")
    assert err <= SIGMOID_F16_LOGIT_BUDGET


def test_mtp_layers_are_skipped() -> None:
    assert mtp_layer(61, "model.layers.61.eh_proj.weight") and mtp_layer(61, "model.layers.61.mlp.experts.3.up_proj.weight")
    assert not mtp_layer(61, "model.layers.60.mlp.gate.weight") and not mtp_layer(61, "model.norm.weight")
