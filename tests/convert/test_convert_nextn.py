"""The DeepSeek-V3 and GLM-4.5 converters keep the multi-token-prediction ("nextn") layer: the tiny
checked-in checkpoint with a nextn layer added (tests/hf_nextn.py: transformers' own decoder layer, noise on
every parameter) converts with `nextn_layers` = 1 and the layer's tensors as published (rope rows
de-interleaved as the model's), the rest of the model unchanged, and what strata keeps only one of
is refused by name."""

from __future__ import annotations

import shutil

import numpy as np
import pytest

pytest.importorskip("torch")
pytest.importorskip("transformers")

from tests import hf_models  # noqa: E402
from tests.convert_parity import assert_refused_in_one_line, save_as_one_file  # noqa: E402
from tests.hf_nextn import checkpoint_with_nextn  # noqa: E402
from strata.convert import convert  # noqa: E402
from strata.convert.deepseek import deinterleave  # noqa: E402
from strata.convert.safetensors_reader import Checkpoint  # noqa: E402
from strata.families.deepseek import NEXTN_NAMES, nextn_expert_name  # noqa: E402
from strata.formats.quant_types import QuantType  # noqa: E402
from strata.loader import load  # noqa: E402
from strata.speculative.mtp import drafter_dense


@pytest.fixture(scope="module", params=["deepseek_v3", "glm4_moe"])
def with_nextn(request, tmp_path_factory):
    return checkpoint_with_nextn(tmp_path_factory, request.param)


def _convert(src, out):
    return load(convert(src, out, expert_type=QuantType.F16, dense_type=QuantType.F32).model_path)


def test_the_nextn_layer_is_kept_as_published(with_nextn, tmp_path_factory, tmp_path):
    src, nextn, _, config = with_nextn
    model = _convert(src, tmp_path / "with")
    assert not [n for n in model.dense if n.startswith("nextn.")]  # left in the file: not resident without drafting
    dense = drafter_dense(model)
    cfg, pre, arch = model.cfg, f"model.layers.{config.num_hidden_layers}.", config.model_type
    assert cfg.sigmoid.nextn_layers == 1 and cfg.n_layers == config.num_hidden_layers
    own = {"eh_proj": "eh_proj.weight", "enorm": "enorm.weight", "hnorm": "hnorm.weight",
           "shared_head_norm": "shared_head.norm.weight", "shared_head_head": "shared_head.head.weight"}
    for key, published in own.items():
        np.testing.assert_array_equal(dense[NEXTN_NAMES[key]], nextn[pre + published], err_msg=key)
    for e in range(cfg.n_experts):
        for p in ("gate", "up", "down"):
            np.testing.assert_array_equal(dense[nextn_expert_name(p, e)],
                                          nextn[f"{pre}mlp.experts.{e}.{p}_proj.weight"], err_msg=f"{p} {e}")
    layer = {"attn_norm.weight": "input_layernorm.weight", "ffn_norm.weight": "post_attention_layernorm.weight",
             "ffn_gate_inp.weight": "mlp.gate.weight", "exp_probs_b.bias": "mlp.gate.e_score_correction_bias",
             "attn_output.weight": "self_attn.o_proj.weight",
             "ffn_gate_shexp.weight": "mlp.shared_experts.gate_proj.weight"}
    layer.update({"attn_kv_b.weight": "self_attn.kv_b_proj.weight"} if arch == "deepseek_v3" else
                 {"attn_k.weight": "self_attn.k_proj.weight", "attn_q.bias": "self_attn.q_proj.bias"})
    for suffix, published in layer.items():
        name = "nextn.blk.0." + suffix
        assert name in dense, name
        np.testing.assert_array_equal(dense[name], nextn[pre + published], err_msg=suffix)
    if arch == "deepseek_v3":
        kv_a = nextn[pre + "self_attn.kv_a_proj_with_mqa.weight"]  # its rope rows de-interleaved, as the model's
        rank = cfg.mla.kv_lora_rank
        np.testing.assert_array_equal(dense["nextn.blk.0.attn_kv_a_mqa.weight"],
                                      np.concatenate([kv_a[:rank], deinterleave(kv_a[rank:])]))
    plain = hf_models.cached_checkpoint(arch, tmp_path_factory)[0]
    without = _convert(plain, tmp_path / "without")  # the rest of the model: the same tensors
    assert without.cfg.sigmoid.nextn_layers == 0
    assert not [n for n in without.dense if n.startswith("nextn.")]
    for name in without.dense:
        np.testing.assert_array_equal(dense[name], without.dense[name], err_msg=name)


@pytest.mark.parametrize("extra, message", [
    ("model.layers.4.eh_proj.weight", "more than one nextn layer"),
])
def test_what_strata_does_not_keep_is_refused_in_one_line(with_nextn, tmp_path, extra, message):
    src = with_nextn[0]
    bad = tmp_path / "bad"
    shutil.copytree(src, bad)
    with Checkpoint(bad) as ck:
        tensors = {n: ck.read(n) for n in ck.tensors}
    tensors[extra] = np.zeros((4, 4), np.float32)
    save_as_one_file(bad, tensors)
    assert_refused_in_one_line(bad, tmp_path / "out", message)


def test_an_fp8_checkpoint_keeps_its_nextn_layer_dequantized(with_nextn, tmp_path):
    """The published form (FP8 blocks with `weight_scale_inv`, tests/fp8_checkpoints.py): the
    nextn layer's tensors are those of the float checkpoint it stands for, bit for bit."""
    from tests import fp8_checkpoints

    quantized = fp8_checkpoints.write_fp8_checkpoint(with_nextn[0], tmp_path / "fp8")
    pre = f"model.layers.{with_nextn[3].num_hidden_layers}."
    assert any(name.startswith(pre) for name in quantized)  # the nextn layer's projections are FP8 too
    fp8_checkpoints.write_dequantized(with_nextn[0], quantized, tmp_path / "deq")
    a, b = _convert(tmp_path / "fp8", tmp_path / "a"), _convert(tmp_path / "deq", tmp_path / "b")
    assert a.cfg.sigmoid.nextn_layers == 1
    a_dense, b_dense = drafter_dense(a), drafter_dense(b)
    names = [n for n in b_dense if n.startswith("nextn.")]
    assert len(names) > 3 * a.cfg.n_experts
    for name in names:
        np.testing.assert_array_equal(a_dense[name], b_dense[name], err_msg=name)


def test_the_conversion_says_what_it_kept_and_skipped(with_nextn, tmp_path):
    result = convert(with_nextn[0], tmp_path / "m", expert_type=QuantType.F16, dense_type=QuantType.F32)
    n = with_nextn[3].num_hidden_layers
    assert any(f"nextn) layer model.layers.{n}.*" in note for note in result.notes), result.notes
    assert "skipped 1 multi-token-prediction tensors" in result.notes, result.notes  # its copy of the embedding
