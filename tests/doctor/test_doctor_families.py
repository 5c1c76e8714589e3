"""Weights by part: published configs of four families, strata's own definitions for the ones it runs."""

from __future__ import annotations

import math

import pytest

from doctor_configs import PUBLISHED, PUBLISHED_SIZES, QWEN3_30B_A3B
from strata.doctor.byte_budget import byte_budget
from strata.doctor.families import count_hf, count_strata, text_config
from strata.formats.expert_record import RecordLayout
from strata.formats.quant_types import QuantType
from strata.model_config import dense_tensor_shapes
from strata.testing.models import SHAPES

TOTAL_TOLERANCE = 0.02  # published totals are rounded to three digits
ACTIVE_TOLERANCE = 0.12  # published "active" counts differ in whether the embedding table counts


@pytest.mark.parametrize("name", sorted(PUBLISHED))
def test_published_totals(name):
    counts = count_hf(PUBLISHED[name])
    total, active = PUBLISHED_SIZES[name]
    assert counts.total_weights / 1e9 == pytest.approx(total, rel=TOTAL_TOLERANCE)
    assert counts.active_weights / 1e9 == pytest.approx(active, rel=ACTIVE_TOLERANCE)


def test_supported_and_not():
    assert count_hf(QWEN3_30B_A3B).supported and count_hf(QWEN3_30B_A3B).model_config is not None
    for name in ("Qwen3.5-397B-A17B", "gpt-oss-120b"):  # families this version converts
        assert count_hf(PUBLISHED[name]).supported
    for name in ("DeepSeek-V3",):  # its published checkpoint is FP8
        c = count_hf(PUBLISHED[name])
        assert not c.supported and c.why_not


def test_family_shapes():
    ds = count_hf(PUBLISHED["DeepSeek-V3"])
    assert (ds.n_layers, ds.moe_layers, ds.n_experts, ds.top_k) == (61, 58, 256, 8)
    assert ds.dense["dense_ffn"] == 3 * 3 * 7168 * 18432
    q35 = count_hf(PUBLISHED["Qwen3.5-397B-A17B"])
    assert (q35.hidden, q35.n_experts, q35.top_k, q35.moe_layers) == (4096, 512, 10, 60)
    assert q35.kv_per_position == 2 * 15 * 2 * 256  # 15 full-attention layers of 60
    oss = count_hf(PUBLISHED["gpt-oss-120b"])
    assert (oss.n_experts, oss.top_k, oss.expert_ffn) == (128, 4, 2880)


def test_nested_text_config():
    c = text_config(PUBLISHED["Qwen3.5-397B-A17B"])
    assert c["model_type"] == "qwen3_5_moe" and c["hidden_size"] == 4096


@pytest.mark.parametrize("shape", sorted(SHAPES))
def test_made_shapes_use_strata_definitions(shape):
    cfg = SHAPES[shape]
    counts = count_strata(cfg)
    shapes = dense_tensor_shapes(cfg)
    tables = {k for k in shapes if k.endswith(".ple_ngram.weight")}  # PLE: the row store's, not dense
    dense = sum(math.prod(s) for k, s in shapes.items() if k not in tables)
    assert counts.dense_weights == dense
    assert counts.ple_table_values == sum(math.prod(shapes[k]) for k in tables)
    assert counts.total_experts == cfg.n_moe_layers * cfg.n_experts
    b = byte_budget(counts, expert_qtype=QuantType.Q2_0)
    rec = RecordLayout(QuantType.Q2_0, cfg.hidden_size, cfg.expert_ffn_size)
    assert (b.record_bytes, b.slot_bytes) == (rec.record_bytes, rec.padded_bytes)
    assert b.expert_per_token == cfg.n_moe_layers * cfg.n_experts_per_token * rec.record_bytes
    assert b.dense_resident == 4 * dense  # F32 dense (the default): held as stored, 4 bytes a weight
    q8 = byte_budget(counts, expert_qtype=QuantType.Q2_0, dense_qtype=QuantType.Q8_0)
    assert q8.dense_resident < 0.5 * b.dense_resident  # Q8_0 matrices held as stored, routers and norms F32
    assert q8.dense_per_token == b.dense_per_token  # every matmul reads its weights widened to float32
    assert q8.widened_per_token["Q8_0"] > 0 and not b.widened_per_token


def test_qwen3_byte_budget():
    b = byte_budget(count_hf(QWEN3_30B_A3B), expert_qtype=QuantType.Q4_0)
    rec = RecordLayout(QuantType.Q4_0, 2048, 768)
    assert b.expert_per_token == 48 * 8 * rec.record_bytes
    assert b.experts_resident == 48 * 128 * rec.padded_bytes
    assert b.all_resident > b.dense_resident + b.experts_resident  # + the KV cache


def test_not_moe_is_an_error():
    from strata.errors import ConfigError

    with pytest.raises(ConfigError, match="not a Mixture-of-Experts"):
        count_hf({"model_type": "llama", "hidden_size": 64, "vocab_size": 10, "num_hidden_layers": 2,
                  "num_attention_heads": 4, "intermediate_size": 128})


def test_dense_held_counts_mlxs_own_copy():
    """numpy holds the loader's copy; MLX its own as well (as stored; an F32 file's matrices as
    float16 on a GPU)."""
    from strata.doctor.predict import dense_held

    counts = count_strata(SHAPES["small"])
    f32 = byte_budget(counts)
    f16 = byte_budget(counts, dense_qtype=QuantType.F16)
    assert dense_held(f32, "numpy") == f32.dense_resident
    assert dense_held(f32, "mlx", gpu=False) == 2 * f32.dense_resident
    assert dense_held(f32, "mlx", gpu=True) == f32.dense_resident + f32.dense_resident // 2
    assert dense_held(f16, "mlx", gpu=True) == 2 * f16.dense_resident
