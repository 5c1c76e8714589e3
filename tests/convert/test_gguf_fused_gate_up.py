"""llama.cpp's fused `ffn_gate_up_exps` [E, 2F, D] (its converter's --fuse-gate-up-exps; per expert
the gate rows, then the up rows) is read as the separate gate and up: each half kept as stored."""

from __future__ import annotations

import numpy as np
import pytest

from strata.convert import convert
from strata.loader import load
from strata.reference.model import ModelState, forward
from tests import gguf_models, hf_models


def _logits(model_path) -> np.ndarray:
    model = load(model_path)
    tokens = np.asarray(model.tokenizer.encode(hf_models.PARITY_TEXT))
    out, _ = forward(model.resident_params(), ModelState.empty(model.cfg), tokens)
    return out


@pytest.mark.parametrize("experts", ["Q8_0", "F16"])
def test_fused_gate_up_experts_convert_as_the_separate_ones(experts, tmp_path, tmp_path_factory):
    """The fused `ffn_gate_up_exps` (--fuse-gate-up-exps) gives the same expert records,
    byte for byte, and the same logits as separate gate / up tensors."""
    hf_dir, _ = hf_models.cached_checkpoint("qwen3_moe", tmp_path_factory)
    (tmp_path / "a").mkdir()
    (tmp_path / "b").mkdir()
    separate = convert(gguf_models.write_gguf(hf_dir, tmp_path / "a" / "m.gguf", experts=experts), tmp_path / "sep")
    fused = convert(gguf_models.write_gguf(hf_dir, tmp_path / "b" / "m.gguf", experts=experts, fuse_gate_up=True),
                    tmp_path / "fused")
    assert separate.experts_path.read_bytes()[4096:] == fused.experts_path.read_bytes()[4096:]
    np.testing.assert_array_equal(_logits(separate.model_path), _logits(fused.model_path))
