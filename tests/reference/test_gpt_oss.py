"""gpt-oss's pieces one at a time, against transformers' own functions where it has them, and
their MLX twins against the reference: YaRN frequencies, the clamped SwiGLU, sinks in the
softmax, the sliding window, expert records with biases (version 2 `.experts`, version 1
unchanged), the GGUF round trip of the new config fields, the fused kernels' refusals."""

from __future__ import annotations

import dataclasses
import os

import numpy as np
import pytest

from strata.errors import FormatError
from strata.formats.expert_record import ExpertBiases, ExpertWeights, RecordLayout, pack_record, unpack_record
from strata.formats.experts_file import HEADER_SIZE, HEADER_SIZE_BIASES, ExpertsFile, write_experts
from strata.formats.quant_types import QuantType
from strata.model_config import ExpertKind, Mixer, RopeScaling
from strata.reference.attention import LayerKV, attention, softmax_with_sinks
from strata.reference.experts import ExpertAct, expert_act, gated_hidden, swiglu_expert
from strata.reference.quants import dequantize, quantize
from strata.reference.rope_scaling import rope_frequencies
from strata.testing.models import SHAPES, make_dense, make_expert, make_model
from tests.budgets import FLOAT32_REORDER, ROPE_F32_RTOL

CFG = SHAPES["gpt-oss"]
RNG = np.random.default_rng(7)


def _hf_yarn(cfg, max_positions: int):
    pytest.importorskip("torch")  # transformers' rope helpers build torch tensors
    transformers = pytest.importorskip("transformers")
    from transformers.modeling_rope_utils import ROPE_INIT_FUNCTIONS

    rope = {"rope_type": "yarn", "rope_theta": cfg.rope_theta, "factor": cfg.yarn.yarn_factor,
            "original_max_position_embeddings": cfg.yarn.yarn_original_context, "beta_fast": cfg.yarn.yarn_beta_fast,
            "beta_slow": cfg.yarn.yarn_beta_slow, "truncate": cfg.yarn.yarn_truncate}
    hf = transformers.GptOssConfig(hidden_size=cfg.n_heads * cfg.head_dim, num_attention_heads=cfg.n_heads,
                                   head_dim=cfg.head_dim, max_position_embeddings=max_positions, rope_parameters=rope)
    inv_freq, factor = ROPE_INIT_FUNCTIONS["yarn"](hf)
    return inv_freq.numpy(), factor


@pytest.mark.parametrize("truncate", [False, True])
@pytest.mark.parametrize("shape", ["made", "gpt-oss-120b"])
def test_yarn_frequencies_match_transformers(truncate, shape):
    cfg = CFG if shape == "made" else CFG.with_fields(  # the released config's rope
        head_dim=64, rope_theta=150000.0, yarn_factor=32.0, yarn_original_context=4096,
        yarn_attention_factor=0.1 * np.log(32.0) + 1.0)
    cfg = cfg.with_fields(yarn_truncate=truncate)
    want_freq, want_factor = _hf_yarn(cfg, int(cfg.yarn.yarn_factor * cfg.yarn.yarn_original_context))
    got_freq, got_factor = rope_frequencies(cfg)
    np.testing.assert_allclose(got_freq, want_freq, rtol=ROPE_F32_RTOL)
    assert got_factor == pytest.approx(want_factor, rel=1e-15)
    plain, _ = rope_frequencies(cfg.with_fields(rope_scaling=RopeScaling.NONE))
    assert not np.allclose(got_freq, plain)  # YaRN changed the slow dims


def test_clamped_swiglu_matches_transformers():
    torch = pytest.importorskip("torch")
    transformers = pytest.importorskip("transformers")
    from transformers.models.gpt_oss.modeling_gpt_oss import GptOssExperts

    experts = GptOssExperts(transformers.GptOssConfig(hidden_size=8, intermediate_size=64, num_local_experts=1,
                                                      swiglu_limit=CFG.gpt_oss.swiglu_limit))
    gate_up = (RNG.standard_normal((5, 128)) * 2).astype(np.float32)  # interleaved: gate, up, gate, ...
    want = experts._apply_gate(torch.from_numpy(gate_up)).numpy()
    g, u = gate_up[:, 0::2], gate_up[:, 1::2]
    assert (g > CFG.gpt_oss.swiglu_limit).any() and (np.abs(u) > CFG.gpt_oss.swiglu_limit).any()  # both clamps bite
    np.testing.assert_allclose(gated_hidden(expert_act(CFG), g, u), want, **FLOAT32_REORDER)


def test_sinks_take_their_share_of_the_softmax():
    scores = RNG.standard_normal((3, 4, 6)).astype(np.float32)
    scores[:, :, 4:] = -np.inf  # masked keys
    sinks = np.array([-1.0, 0.0, 2.0], np.float32)
    with_sink = np.concatenate([scores, np.broadcast_to(sinks[:, None, None], (3, 4, 1))], axis=-1).astype(np.float64)
    want = np.exp(with_sink - with_sink.max(-1, keepdims=True))
    want = (want / want.sum(-1, keepdims=True))[..., :-1]  # transformers' form: append, softmax, drop
    np.testing.assert_allclose(softmax_with_sinks(scores, sinks), want, rtol=1e-6, atol=1e-7)
    np.testing.assert_array_equal(softmax_with_sinks(scores, None).sum(-1) > 0.999, True)


def test_a_sliding_layer_sees_exactly_its_window():
    """Position i's output equals the layer run fresh on positions i - W + 1..i alone: RoPE (and
    YaRN) are relative, so only which keys are visible matters."""
    dense = make_dense(CFG, 0)
    w = CFG.gpt_oss.sliding_window
    assert CFG.kinds[0].mixer is Mixer.SLIDING_ATTENTION and w > 0
    x = RNG.standard_normal((3 * w, CFG.hidden_size)).astype(np.float32)
    full, kv = attention(CFG, dense, 0, LayerKV.empty(CFG), x)
    assert kv.length == 3 * w  # every position kept: trim restores any n
    for i in (w - 1, 2 * w, 3 * w - 1):
        alone, _ = attention(CFG, dense, 0, LayerKV.empty(CFG), x[i - w + 1:i + 1])
        np.testing.assert_allclose(full[i], alone[-1], **FLOAT32_REORDER)
    longer, _ = attention(CFG, dense, 1, LayerKV.empty(CFG), x)  # layer 1 is full attention
    alone, _ = attention(CFG, dense, 1, LayerKV.empty(CFG), x[-w:])
    assert not np.allclose(longer[-1], alone[-1], **FLOAT32_REORDER)


def test_expert_biases_enter_the_expert():
    w = make_expert(CFG, 0, 0, 0, QuantType.F32)
    x = RNG.standard_normal(CFG.hidden_size).astype(np.float32)
    act = expert_act(CFG)
    g = dequantize(w.gate) @ x + w.biases.gate
    u = dequantize(w.up) @ x + w.biases.up
    want = dequantize(w.down) @ gated_hidden(act, g, u) + w.biases.down
    np.testing.assert_allclose(swiglu_expert(w, x, act), want, **FLOAT32_REORDER)
    plain = swiglu_expert(dataclasses.replace(w, biases=None), x, act)
    assert not np.allclose(plain, want, **FLOAT32_REORDER)


# ---------------------------------------------------------------- records and files


@pytest.mark.parametrize("qtype", [QuantType.Q2_0, QuantType.MXFP4, QuantType.F16])
def test_a_record_with_biases_round_trips_and_keeps_the_six_planes_in_place(qtype):
    d, f = CFG.hidden_size, CFG.expert_ffn_size
    w = make_expert(CFG, 0, 1, 2, qtype)
    rec, plain = RecordLayout(qtype, d, f, biases=True), RecordLayout(qtype, d, f)
    assert rec.planes[:6] == plain.planes and len(rec.planes) == 9
    assert [p.nbytes for p in rec.planes[6:]] == [4 * f, 4 * f, 4 * d]
    assert all(p.offset % 16 == 0 for p in rec.planes)
    back = unpack_record(pack_record(w, rec), rec)
    for proj in ("gate", "up", "down"):
        np.testing.assert_array_equal(back.projection(proj).codes, w.projection(proj).codes)
        np.testing.assert_array_equal(back.biases.projection(proj), w.biases.projection(proj))
    with pytest.raises(ValueError, match="with biases"):
        pack_record(dataclasses.replace(w, biases=None), rec)
    with pytest.raises(ValueError, match="float32"):
        ExpertWeights(w.gate, w.up, w.down, ExpertBiases(w.biases.gate[:-1], w.biases.up, w.biases.down))


def _write(path, biases: bool):
    cfg = CFG.with_fields(expert_bias=biases)
    return write_experts(path, qtype=QuantType.Q2_0, n_layers=2, n_experts=3, hidden=cfg.hidden_size,
                         expert_ffn=cfg.expert_ffn_size, biases=biases,
                         get_expert=lambda l, e: make_expert(cfg, 0, l, e, QuantType.Q2_0))


def test_experts_with_biases_are_version_2_and_without_stay_version_1(tmp_path):
    h1, h2 = _write(tmp_path / "v1.experts", False), _write(tmp_path / "v2.experts", True)
    assert (h1.version, h1.table_offset, h1.biases) == (1, HEADER_SIZE, False)
    assert (h2.version, h2.table_offset, h2.biases) == (2, HEADER_SIZE_BIASES, True)
    with ExpertsFile.open(tmp_path / "v2.experts") as xf:
        assert xf.layout.biases
        w = xf.expert(1, 2)
        np.testing.assert_array_equal(w.biases.down, make_expert(CFG, 0, 1, 2, QuantType.Q2_0).biases.down)
        offset = xf.record_offset(1, 2) + xf.layout.bias("down").offset
    with open(tmp_path / "v2.experts", "r+b") as f:  # a bias byte is covered by the record's CRC
        f.seek(offset)
        f.write(b"\x7f")
    with ExpertsFile.open(tmp_path / "v2.experts") as xf, pytest.raises(FormatError, match="layer 1 expert 2"):
        xf.read_record(1, 2)


def test_the_made_model_round_trips_its_config_and_refuses_a_foreign_bias_flag(tmp_path):
    import strata

    made = make_model(tmp_path / "m", "gpt-oss")
    with strata.load(made.model_path) as m:
        assert m.cfg == CFG and m.experts_file.header.biases
    other = make_model(tmp_path / "plain", CFG.with_fields(expert_bias=False))
    os.replace(other.experts_path, made.experts_path)
    with pytest.raises(FormatError, match="experts without biases"):
        strata.load(made.model_path, allow_foreign_experts=True)


# ---------------------------------------------------------------- MLX twins


def test_mlx_twins_of_the_new_pieces():
    mx = pytest.importorskip("mlx.core")
    from mlx_agree import assert_backends_agree
    from strata.mlx_backend import attention as mlx_attention
    from strata.mlx_backend import experts as mlx_experts

    act = expert_act(CFG)
    g, u = (RNG.standard_normal((2, 4, 32)) * 2).astype(np.float32)
    assert_backends_agree(gated_hidden(act, g, u), mlx_experts.gated_hidden(act, mx.array(g), mx.array(u)), "FAST",
                          what="clamped SwiGLU")
    scores = RNG.standard_normal((3, 4, 6)).astype(np.float32)
    sinks = RNG.standard_normal(3).astype(np.float32)
    assert_backends_agree(softmax_with_sinks(scores, sinks),
                          mlx_attention.softmax_with_sinks(mx.array(scores), mx.array(sinks)), "FAST", what="sinks")
    x = RNG.standard_normal((3, CFG.hidden_size)).astype(np.float32)
    for qtype in (QuantType.Q2_0, QuantType.MXFP4):
        w = make_expert(CFG, 0, 0, 1, qtype)
        assert_backends_agree(swiglu_expert(w, x, act), mlx_experts.swiglu_expert(w, x, act), "FAST",
                              what=f"{qtype.name} expert with biases")


def test_the_fused_kernels_refuse_gpt_oss_layers():
    pytest.importorskip("mlx.core")
    from strata.mlx_backend.attention import kernel_applies
    from strata.mlx_backend.experts import _routed_kernel_ok
    from strata.mlx_backend.kernels.launch import KernelPath, using_path
    from strata.mlx_backend.model import to_mlx_params

    rec = RecordLayout(QuantType.Q2_0, CFG.hidden_size, CFG.expert_ffn_size)
    with using_path(KernelPath.EMULATED):
        assert _routed_kernel_ok(rec)  # the plain kind runs fused here
        assert not _routed_kernel_ok(RecordLayout(rec.qtype, rec.hidden, rec.expert_ffn, biases=True))
        assert not _routed_kernel_ok(rec, ExpertAct(ExpertKind.CLAMPED_SWIGLU))
        p = to_mlx_params(CFG, make_dense(CFG, 0))
        assert not any(kernel_applies(CFG, lw.attn) for lw in p.layers)
