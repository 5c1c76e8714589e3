"""`strata convert` of llama.cpp's `gpt-oss` GGUF (tests/gguf_gpt_oss.py writes it from the checked-in
float checkpoint in llama.cpp's layout): sinks, the router's bias, the experts' biases, sliding
layers and YaRN land where the Hugging Face converter puts them. llama.cpp's file holds neither the
clamped SwiGLU's limit nor YaRN's `truncate`, and its graph fixes them at 7.0 and true: the checkpoint
compared is the fixture with those two values, and with every tensor stored F32 the logits are the
same bit for bit. With MXFP4 experts (ggml's, as gpt-oss GGUFs ship) they are kept as stored."""

from __future__ import annotations

import json
import shutil

import numpy as np

from strata.convert import convert
from strata.formats.quant_types import QuantType
from strata.loader import load
from strata.reference.model import ModelState, forward
from tests import hf_models
from tests.gguf_gpt_oss import write_gpt_oss_gguf


def _logits(model_path) -> np.ndarray:
    model = load(model_path)
    tokens = np.asarray(model.tokenizer.encode(hf_models.PARITY_TEXT))
    out, _ = forward(model.resident_params(), ModelState.empty(model.cfg), tokens)
    return out


def _as_llama_cpp_runs_it(fixture, directory):
    """The fixture with the values llama.cpp's graph fixes (swiglu_limit 7.0, YaRN truncated)."""
    shutil.copytree(fixture, directory)
    cfg = json.loads((directory / "config.json").read_text())
    cfg["swiglu_limit"] = 7.0
    cfg["rope_parameters"]["truncate"] = True
    (directory / "config.json").write_text(json.dumps(cfg))
    return directory


def test_gpt_oss_gguf_logits_equal_the_hugging_face_conversion(tmp_path, tmp_path_factory):
    fixture, _ = hf_models.cached_checkpoint("gpt_oss_bf16", tmp_path_factory)
    hf_dir = _as_llama_cpp_runs_it(fixture, tmp_path / "hf_dir")
    path = write_gpt_oss_gguf(hf_dir, tmp_path / "m.gguf")
    from_gguf = convert(path, tmp_path / "gguf")
    from_hf = convert(hf_dir, tmp_path / "hf", expert_type=QuantType.F32, dense_type=QuantType.F32)
    assert from_gguf.family == from_hf.family == "gpt-oss" and from_gguf.cfg == from_hf.cfg
    np.testing.assert_array_equal(_logits(from_gguf.model_path), _logits(from_hf.model_path))


def test_gpt_oss_gguf_mxfp4_experts_kept_as_stored(tmp_path, tmp_path_factory):
    import gguf

    from strata.reference.quants import to_blocks

    fixture, _ = hf_models.cached_checkpoint("gpt_oss_bf16", tmp_path_factory)
    hf_dir = _as_llama_cpp_runs_it(fixture, tmp_path / "hf_dir")
    path = write_gpt_oss_gguf(hf_dir, tmp_path / "m.gguf", experts="MXFP4")
    r = convert(path, tmp_path / "out")
    model = load(r.model_path)
    assert model.experts_file.header.qtype is QuantType.GGML_MXFP4
    tensors = {t.name: t for t in gguf.GGUFReader(path).tensors}
    for layer in range(model.cfg.n_layers):
        stored = np.asarray(tensors[f"blk.{layer}.ffn_up_exps.weight"].data)[5]
        assert to_blocks(model.experts_file.expert(layer, 5).projection("up")).tobytes() == stored.tobytes()
        bias = np.asarray(tensors[f"blk.{layer}.ffn_down_exps.bias"].data)[5]
        np.testing.assert_array_equal(model.experts_file.expert(layer, 5).biases.down, bias)
    assert np.isfinite(_logits(r.model_path)).all()
