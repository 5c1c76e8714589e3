"""`strata convert` of llama.cpp's GGUFs of the sigmoid-routed families: `glm4moe` (GLM-4.5 /
4.6 / 4.7), `minimax-m2` and `deepseek2` (DeepSeek-V3 / Kimi-K2 / GLM-4.7-Flash), written by
tests/gguf_sigmoid_models.py in llama.cpp's layout from the checked-in tiny checkpoints. Their
metadata (MLA keys of both generations, partial rotary, groups, scales, dense leading layers,
shared experts, the multi-token-prediction layer), deepseek2's split kv_b put back together and
the selection bias land where the Hugging Face converter puts them: with every tensor stored F32
the converted model's logits equal those of the same checkpoint converted from Hugging Face (F32
experts and dense) bit for bit; Q8_0 experts are kept as stored; softmax gating is refused."""

from __future__ import annotations

import dataclasses

import numpy as np
import pytest

from strata.convert import convert
from strata.errors import ConfigError
from strata.formats.quant_types import QuantType
from strata.model_config import RopeScaling
from strata.loader import load
from strata.reference.model import ModelState, forward
from tests import hf_models
from tests.gguf_sigmoid_models import write_deepseek2_gguf, write_glm4moe_gguf, write_minimax_m2_gguf


def _logits(model_path) -> np.ndarray:
    model = load(model_path)
    tokens = np.asarray(model.tokenizer.encode(hf_models.PARITY_TEXT))
    out, _ = forward(model.resident_params(), ModelState.empty(model.cfg), tokens)
    return out


@pytest.mark.parametrize("fixture", ["deepseek_v3", "glm4_moe_lite"])
def test_deepseek2_gguf_logits_equal_the_hugging_face_conversion(fixture, tmp_path, tmp_path_factory):
    hf_dir, _ = hf_models.cached_checkpoint(fixture, tmp_path_factory)
    path = write_deepseek2_gguf(hf_dir, tmp_path / "m.gguf")
    from_gguf = convert(path, tmp_path / "gguf")
    from_hf = convert(hf_dir, tmp_path / "hf", expert_type=QuantType.F32, dense_type=QuantType.F32)
    assert from_gguf.expert_type is QuantType.F32
    # GLM-4.7-Flash is DeepSeek-V3's model under another name: llama.cpp writes both as deepseek2
    assert from_gguf.family == "DeepSeek-V3"
    assert dataclasses.replace(from_gguf.cfg, architecture=from_hf.cfg.architecture) == from_hf.cfg
    np.testing.assert_array_equal(_logits(from_gguf.model_path), _logits(from_hf.model_path))
    # the tokenizer rebuilt from tokenizer.ggml.* encodes as the checkpoint's
    from tokenizers import Tokenizer

    original = Tokenizer.from_file(str(hf_dir / "tokenizer.json"))
    model = load(from_gguf.model_path)
    text = hf_models.PARITY_TEXT + " naïve café 🙂 <|im_start|>user\nhi<|im_end|>"
    assert list(model.tokenizer.encode(text)) == original.encode(text).ids


def test_deepseek2_gguf_q8_0_experts_kept_as_stored(tmp_path, tmp_path_factory):
    import gguf

    from strata.reference.quants import to_blocks

    hf_dir, _ = hf_models.cached_checkpoint("deepseek_v3", tmp_path_factory)
    path = write_deepseek2_gguf(hf_dir, tmp_path / "m.gguf", experts="Q8_0", dense="F16")
    r = convert(path, tmp_path / "out")
    model = load(r.model_path)
    assert model.experts_file.header.qtype is QuantType.Q8_0
    tensors = {t.name: t for t in gguf.GGUFReader(path).tensors}
    for i, layer in enumerate(model.cfg.moe_layers):
        stored = np.asarray(tensors[f"blk.{layer}.ffn_down_exps.weight"].data)[3]
        assert to_blocks(model.experts_file.expert(i, 3).projection("down")).tobytes() == stored.tobytes()


def test_deepseek2_gguf_with_softmax_gating_is_refused_naming_the_key(tmp_path, tmp_path_factory):
    import gguf

    hf_dir, _ = hf_models.cached_checkpoint("deepseek_v3", tmp_path_factory)
    path = write_deepseek2_gguf(hf_dir, tmp_path / "m.gguf")
    # rewrite the one metadata value in place: the u32 after the key's name and type
    data = bytearray(path.read_bytes())
    key = b"deepseek2.expert_gating_func"
    at = data.index(key) + len(key) + 4
    assert int.from_bytes(data[at:at + 4], "little") == int(gguf.ExpertGatingFuncType.SIGMOID)
    data[at:at + 4] = int(gguf.ExpertGatingFuncType.SOFTMAX).to_bytes(4, "little")
    path.write_bytes(bytes(data))
    with pytest.raises(ConfigError, match=r"deepseek2\.expert_gating_func = 1 .*supported: 2"):
        convert(path, tmp_path / "out")


def test_glm4moe_gguf_logits_equal_the_hugging_face_conversion(tmp_path, tmp_path_factory):
    """llama.cpp writes no expert-group keys for glm4moe (GLM-4.5's configs have one group): the
    checkpoint compared is the fixture with n_group = topk_group = 1. The GGUF's
    multi-token-prediction layer (block_count 4, nextn_predict_layers 1) is skipped with a note."""
    import json
    import shutil

    fixture, _ = hf_models.cached_checkpoint("glm4_moe", tmp_path_factory)
    hf_dir = tmp_path / "hf_one_group"
    shutil.copytree(fixture, hf_dir)
    cfg = json.loads((hf_dir / "config.json").read_text())
    cfg.update(n_group=1, topk_group=1)
    (hf_dir / "config.json").write_text(json.dumps(cfg))
    path = write_glm4moe_gguf(hf_dir, tmp_path / "m.gguf")
    from_gguf = convert(path, tmp_path / "gguf")
    from_hf = convert(hf_dir, tmp_path / "hf", expert_type=QuantType.F32, dense_type=QuantType.F32)
    assert from_gguf.family == from_hf.family == "GLM-4.5" and from_gguf.cfg == from_hf.cfg
    assert any("multi-token-prediction" in note for note in from_gguf.notes)
    assert from_gguf.cfg.n_layers == 3 and from_gguf.cfg.rotary_dim == 8
    np.testing.assert_array_equal(_logits(from_gguf.model_path), _logits(from_hf.model_path))


def test_minimax_m2_gguf_logits_equal_the_hugging_face_conversion(tmp_path, tmp_path_factory):
    hf_dir, _ = hf_models.cached_checkpoint("minimax_m2", tmp_path_factory)
    path = write_minimax_m2_gguf(hf_dir, tmp_path / "m.gguf")
    from_gguf = convert(path, tmp_path / "gguf")
    from_hf = convert(hf_dir, tmp_path / "hf", expert_type=QuantType.F32, dense_type=QuantType.F32)
    assert from_gguf.family == from_hf.family == "MiniMax-M2" and from_gguf.cfg == from_hf.cfg
    np.testing.assert_array_equal(_logits(from_gguf.model_path), _logits(from_hf.model_path))


def test_deepseek2_gguf_first_generation_layout_converts_alike(tmp_path, tmp_path_factory):
    """llama.cpp's first deepseek2 layout (kv_b whole, key_length = nope + rope, no *_mla keys)
    gives the same model as today's split one: the same config, the same logits bit for bit."""
    hf_dir, _ = hf_models.cached_checkpoint("deepseek_v3", tmp_path_factory)
    old = convert(write_deepseek2_gguf(hf_dir, tmp_path / "old.gguf", first_generation=True), tmp_path / "old")
    new = convert(write_deepseek2_gguf(hf_dir, tmp_path / "new.gguf"), tmp_path / "new")
    assert old.cfg == new.cfg
    np.testing.assert_array_equal(_logits(old.model_path), _logits(new.model_path))


def test_deepseek2_gguf_yarn_reads_as_the_released_configs(tmp_path, tmp_path_factory):
    """YaRN from rope.scaling.*: factor, original context and yarn_log_multiplier = 0.1
    mscale_all_dim, read back with mscale = mscale_all_dim (DeepSeek-V3's and Kimi-K2's released
    configs); the checkpoint compared is the YaRN fixture with mscale set equal to mscale_all_dim."""
    import json
    import shutil

    fixture, _ = hf_models.cached_checkpoint("deepseek_v3_yarn", tmp_path_factory)
    hf_dir = tmp_path / "hf_dir"
    shutil.copytree(fixture, hf_dir)
    cfg = json.loads((hf_dir / "config.json").read_text())
    cfg["rope_parameters"]["mscale"] = cfg["rope_parameters"]["mscale_all_dim"]
    (hf_dir / "config.json").write_text(json.dumps(cfg))
    from_gguf = convert(write_deepseek2_gguf(hf_dir, tmp_path / "m.gguf"), tmp_path / "gguf")
    from_hf = convert(hf_dir, tmp_path / "hf", expert_type=QuantType.F32, dense_type=QuantType.F32)
    ours, theirs_yarn = from_gguf.cfg.yarn, from_hf.cfg.yarn
    assert ours.rope_scaling is theirs_yarn.rope_scaling is RopeScaling.YARN
    for field in ("yarn_factor", "yarn_original_context", "yarn_attention_factor", "yarn_mscale_all_dim",
                  "yarn_beta_fast", "yarn_beta_slow", "yarn_truncate"):
        assert getattr(ours, field) == pytest.approx(getattr(theirs_yarn, field), rel=1e-6), field
    assert dataclasses.replace(from_gguf.cfg, yarn=theirs_yarn) == from_hf.cfg
    theirs = _logits(from_hf.model_path)
    rel = float(np.abs(_logits(from_gguf.model_path) - theirs).max()) / float(np.abs(theirs).max())
    assert rel <= 1e-5  # mscale_all_dim through float32 and back: 0.8 -> 0.08 (f32) -> 0.8000001
