"""strata.testing.llama_cpp_export: a made Qwen3-MoE-kind model written as a llama.cpp GGUF (what
benchmarks/llama_cpp_side_by_side.py hands to both tools). `strata convert` of it gives the made
model back: the same config but its architecture name, every expert block as made, the same
logits bit for bit; a model llama.cpp's qwen3moe graph would compute otherwise is refused."""

from __future__ import annotations

import dataclasses

import gguf
import numpy as np
import pytest

import strata
from strata.convert import convert
from strata.formats.quant_types import QuantType
from strata.reference.model import ModelState, forward
from strata.reference.quants import to_blocks
from strata.testing.llama_cpp_export import export_qwen3moe_gguf
from strata.testing.models import make_model

SHAPE = dict(n_layers=2, hidden_size=64, n_heads=4, n_kv_heads=2, head_dim=16, n_experts=8, n_experts_per_token=2,
             expert_ffn_size=32, shared_ffn_size=0, shared_expert_gated=False, vocab_size=300)


@pytest.mark.parametrize("expert_type", [QuantType.Q8_0, QuantType.Q4_0])
def test_exported_gguf_converts_back_to_the_made_model(tmp_path, expert_type):
    made = make_model(tmp_path / "made", "tiny", 0, expert_type=expert_type, dense_type=QuantType.Q8_0, **SHAPE)
    path = export_qwen3moe_gguf(made.model_path, tmp_path / "llama.gguf")
    reader = gguf.GGUFReader(path)
    assert reader.fields["general.architecture"].contents() == "qwen3moe"
    assert reader.fields["tokenizer.ggml.pre"].contents() == "gpt-2"
    r = convert(path, tmp_path / "back")
    a, b = strata.load(made.model_path), strata.load(r.model_path)
    try:
        assert dataclasses.replace(b.cfg, architecture=a.cfg.architecture, rms_norm_eps=a.cfg.rms_norm_eps) == a.cfg
        for layer in range(a.cfg.n_layers):
            for e in (0, a.cfg.n_experts - 1):
                for proj in ("gate", "up", "down"):
                    want = to_blocks(a.experts_file.expert(layer, e).projection(proj))
                    assert to_blocks(b.experts_file.expert(layer, e).projection(proj)).tobytes() == want.tobytes()
        tokens = np.arange(1, 40)
        ours, _ = forward(b.resident_params(), ModelState.empty(b.cfg), tokens)
        theirs, _ = forward(a.resident_params(), ModelState.empty(a.cfg), tokens)
        np.testing.assert_array_equal(ours, theirs)
    finally:
        a.close()
        b.close()


def test_a_model_of_another_kind_is_refused_naming_what_differs(tmp_path):
    made = make_model(tmp_path / "shared", "tiny", 0, expert_type=QuantType.Q8_0, vocab_size=300)  # a shared expert
    with pytest.raises(ValueError, match="shared expert"):
        export_qwen3moe_gguf(made.model_path, tmp_path / "x.gguf")
