"""`strata convert` of MLX-quantized checkpoints made by mlx-lm's own convert (run on MLX's CPU
build): the routed experts pass through bit for bit, strata's logits equal mlx-lm's on the same
quantized model, greedy decoding agrees, per-module overrides are read, mixed expert formats are
refused by name."""

from __future__ import annotations

import os

import numpy as np
import pytest

os.environ.setdefault("HF_HUB_OFFLINE", "1")
pytest.importorskip("mlx_lm")

import mlx.core as mx  # noqa: E402

from tests import hf_models, mlx_lm_models  # noqa: E402
from strata.convert import convert  # noqa: E402
from strata.errors import ConfigError  # noqa: E402
from strata.formats.quant_types import QuantType  # noqa: E402
from strata.generate import generate  # noqa: E402
from strata.loader import load  # noqa: E402
from strata.reference.model import ModelState, forward  # noqa: E402
from tests.budgets import MLX_LM_LOGIT_BUDGET, Q8_ARGMAX_AGREEMENT  # noqa: E402

GREEDY_STEPS = 32
PROMPT_TOKENS = 8
EXPECTED_TYPE = {"qwen3_a4g64_bf16": QuantType.A4G64_BF16, "qwen3_a8g32_f16": QuantType.A8G32_F16,
                 "qwen3_mxfp4": QuantType.MXFP4, "mixtral_a4g32_bf16": QuantType.A4G32_BF16}


@pytest.fixture(scope="module", params=sorted(mlx_lm_models.RECIPES))
def quantized(request, tmp_path_factory):
    """(recipe, mlx-lm checkpoint dir, strata Model converted from it)."""
    recipe = request.param
    arch, _ = mlx_lm_models.RECIPES[recipe]
    hf_dir, _ = hf_models.cached_checkpoint(arch, tmp_path_factory)
    work = tmp_path_factory.mktemp(f"mlx_{recipe}")
    mlx_dir = mlx_lm_models.quantize_with_mlx_lm(hf_dir, work, recipe)
    r = convert(mlx_dir, work / "strata")
    return recipe, mlx_dir, load(r.model_path)


def _tokens(model) -> np.ndarray:
    return np.asarray(model.tokenizer.encode(hf_models.PARITY_TEXT))


def test_experts_keep_their_bits(quantized):
    recipe, mlx_dir, model = quantized
    weights = mx.load(str(next(mlx_dir.glob("model*.safetensors"))))
    moe = "block_sparse_moe" if recipe.startswith("mixtral") else "mlp"
    f = model.experts_file
    assert f.header.qtype is EXPECTED_TYPE[recipe]
    for layer in range(model.cfg.n_layers):
        for e in range(model.cfg.n_experts):
            w = f.expert(layer, e)
            for proj in ("gate", "up", "down"):
                base = f"model.layers.{layer}.{moe}.switch_mlp.{proj}_proj."
                m = w.projection(proj)
                assert m.codes.tobytes() == np.array(weights[base + "weight"][e]).tobytes()
                sc = weights[base + "scales"][e]
                raw = lambda a: np.array(a.view(mx.uint16) if a.dtype == mx.bfloat16 else a).tobytes()  # noqa: E731
                assert m.scales.tobytes() == raw(sc)
                if base + "biases" in weights:
                    assert m.biases.tobytes() == raw(weights[base + "biases"][e])


def test_logits_match_mlx_lm(quantized):
    recipe, mlx_dir, model = quantized
    tokens = _tokens(model)
    ours, _ = forward(model.resident_params(), ModelState.empty(model.cfg), tokens)
    theirs = mlx_lm_models.mlx_lm_logits(mlx_lm_models.load_float32(mlx_dir), tokens)
    scale = float(np.abs(theirs).max())
    rel = float(np.abs(ours - theirs).max()) / scale
    print(f"\n{recipe}: max|dlogit|/scale vs mlx-lm (float32 activations) = {rel:.2e} (scale {scale:.2f})")
    assert rel <= MLX_LM_LOGIT_BUDGET
    # mlx-lm as it runs by default: activations in the checkpoint's 16-bit type
    from mlx_lm import load as mlx_load
    native = mlx_lm_models.mlx_lm_logits(mlx_load(str(mlx_dir))[0], tokens)
    agree = float(np.mean(native.argmax(-1) == ours.argmax(-1)))
    print(f"{recipe}: argmax agreement with mlx-lm's 16-bit forward {agree:.3f}, "
          f"max|dlogit|/scale {np.abs(native - ours).max() / scale:.2e}")
    assert agree >= Q8_ARGMAX_AGREEMENT


def test_greedy_matches_mlx_lm(quantized):
    recipe, mlx_dir, model = quantized
    prompt = [int(t) for t in _tokens(model)[:PROMPT_TOKENS]]
    ours = generate(model, prompt, max_tokens=GREEDY_STEPS).tokens
    theirs = mlx_lm_models.mlx_lm_greedy(mlx_lm_models.load_float32(mlx_dir), prompt, GREEDY_STEPS)
    stop = next((i + 1 for i, t in enumerate(theirs) if t in model.tokenizer.eos_ids), len(theirs))
    assert ours == theirs[:stop]  # strata stops at an end-of-sequence token, generate_step does not
    assert len(ours) == GREEDY_STEPS  # no early stop on these checkpoints: all 32 steps compared


def test_overrides_and_float_modules_are_read(tmp_path_factory):
    """Per-module overrides: layer 0's q_proj at 8 bits, lm_head left in float (false); the
    dense weights are dequantized, the experts kept."""
    hf_dir, _ = hf_models.cached_checkpoint("qwen3_moe", tmp_path_factory)
    work = tmp_path_factory.mktemp("mlx_overrides")

    def predicate(path, module):
        if path == "lm_head":
            return False
        if path == "model.layers.0.self_attn.q_proj":
            return {"group_size": 32, "bits": 8}
        return True

    mlx_dir = mlx_lm_models.quantize_with_mlx_lm(hf_dir, work, "qwen3_a4g64_bf16", quant_predicate=predicate)
    model = load(convert(mlx_dir, work / "strata").model_path)
    tokens = _tokens(model)
    ours, _ = forward(model.resident_params(), ModelState.empty(model.cfg), tokens)
    theirs = mlx_lm_models.mlx_lm_logits(mlx_lm_models.load_float32(mlx_dir), tokens)
    assert float(np.abs(ours - theirs).max()) <= MLX_LM_LOGIT_BUDGET * float(np.abs(theirs).max())


def test_mixed_expert_formats_are_refused(tmp_path_factory):
    hf_dir, _ = hf_models.cached_checkpoint("qwen3_moe", tmp_path_factory)
    work = tmp_path_factory.mktemp("mlx_mixed")

    def predicate(path, module):
        return {"group_size": 64, "bits": 8} if path == "model.layers.1.mlp.switch_mlp.down_proj" else True

    mlx_dir = mlx_lm_models.quantize_with_mlx_lm(hf_dir, work, "qwen3_a4g64_bf16", quant_predicate=predicate)
    with pytest.raises(ConfigError, match="routed experts in several formats"):
        convert(mlx_dir, work / "strata")
    # an explicit type is quantized to from the dequantized experts
    r = convert(mlx_dir, work / "q8", expert_type=QuantType.Q8_0)
    assert r.expert_type is QuantType.Q8_0


@pytest.mark.parametrize("stream", [False, True], ids=["resident", "streaming"])
def test_mlx_engines_run_the_kept_experts(quantized, stream):
    """The MLX backend's engines (gather_qmm over the records: the fused kernels take Q2_0 only)
    on the converted model, against the reference forward."""
    from strata.config import Backend, Config
    from strata.engines import open_engine
    from tests.mlx_agree import assert_backends_agree

    recipe, _, model = quantized
    tokens = [int(t) for t in _tokens(model)[:24]]
    ref, _ = forward(model.resident_params(), ModelState.empty(model.cfg), np.asarray(tokens))
    # the smallest legal arena of this shape: one window's selections of every layer + read-ahead
    config = Config(backend=Backend.MLX, arena="20slots") if stream else Config(backend=Backend.MLX)
    engine = open_engine(model, config, stream=stream)
    try:
        assert_backends_agree(ref[-1], np.array(engine.prefill(tokens)), "FORWARD", what=f"{recipe} stream={stream}")
    finally:
        engine.close()
