"""`strata convert` of llama.cpp's `qwen3next` and `qwen35moe` GGUFs (tests/gguf_qwen3next.py writes it from the
checked-in Qwen3-Next checkpoint in llama.cpp's layout): its `ssm.*` keys, the norms it stores as
1 + w, `ssm_a` = -exp(A_log), the regrouped attn_qkv / attn_gate, the grouped ssm_ba and
the [query; gate] attn_q land where the Hugging Face converter puts them: with every tensor F32
the logits equal those of the checkpoint converted from Hugging Face (F32 experts and dense) bit
for bit. llama.cpp's legacy fused `ssm_in` is refused naming the tensor."""

from __future__ import annotations

import numpy as np
import pytest

from strata.convert import convert
from strata.errors import ConfigError
from strata.formats.quant_types import QuantType
from strata.loader import load
from strata.reference.model import ModelState, forward
from tests import hf_models
from tests.gguf_qwen3next import write_qwen35moe_gguf, write_qwen3next_gguf


def _logits(model_path) -> np.ndarray:
    model = load(model_path)
    tokens = np.asarray(model.tokenizer.encode(hf_models.PARITY_TEXT))
    out, _ = forward(model.resident_params(), ModelState.empty(model.cfg), tokens)
    return out


def test_qwen3next_gguf_logits_equal_the_hugging_face_conversion(tmp_path, tmp_path_factory):
    hf_dir, _ = hf_models.cached_checkpoint("qwen3_next", tmp_path_factory)
    path = write_qwen3next_gguf(hf_dir, tmp_path / "m.gguf")
    from_gguf = convert(path, tmp_path / "gguf")
    from_hf = convert(hf_dir, tmp_path / "hf", expert_type=QuantType.F32, dense_type=QuantType.F32)
    assert from_gguf.family == from_hf.family and from_gguf.cfg == from_hf.cfg
    np.testing.assert_array_equal(_logits(from_gguf.model_path), _logits(from_hf.model_path))


def test_qwen3next_gguf_legacy_fused_ssm_in_is_refused(tmp_path, tmp_path_factory):
    hf_dir, _ = hf_models.cached_checkpoint("qwen3_next", tmp_path_factory)
    path = write_qwen3next_gguf(hf_dir, tmp_path / "m.gguf", legacy_ssm_in=True)
    with pytest.raises(ConfigError, match=r"tensor blk\.0\.ssm_in\.weight: llama\.cpp's legacy fused q/k/v/z layout"):
        convert(path, tmp_path / "out")


def test_qwen35moe_gguf_logits_equal_the_hugging_face_conversion(tmp_path, tmp_path_factory):
    hf_dir, _ = hf_models.cached_checkpoint("qwen3_5_moe_text", tmp_path_factory)
    path = write_qwen35moe_gguf(hf_dir, tmp_path / "m.gguf")
    from_gguf = convert(path, tmp_path / "gguf")
    from_hf = convert(hf_dir, tmp_path / "hf", expert_type=QuantType.F32, dense_type=QuantType.F32)
    assert from_gguf.family == from_hf.family and from_gguf.cfg == from_hf.cfg
    assert from_gguf.cfg.deltanet.linear_v_heads == 2 * from_gguf.cfg.deltanet.linear_k_heads  # the reorder moved rows
    np.testing.assert_array_equal(_logits(from_gguf.model_path), _logits(from_hf.model_path))
