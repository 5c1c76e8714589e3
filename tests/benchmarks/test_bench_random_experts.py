"""The synthetic benchmarks' fast builds: `formats.experts_file.write_packed_experts` (records
packed once, written many times), benchmarks/_random_experts.py's pooled `.experts` file (a real
file the engine reads: every record's own checksum, pool[(l E + e) % P] at (l, e)), the bounded
record chunks of `testing.mlx_params.random_records`, and decode.py's DeepSeek byte budget and
61-layer extrapolation."""

from __future__ import annotations

import dataclasses
import sys
from pathlib import Path

import numpy as np
import pytest

mx = pytest.importorskip("mlx.core")

sys.path.insert(0, str(Path(__file__).resolve().parents[2] / "benchmarks"))

import _random_experts  # noqa: E402
from strata.formats.expert_record import RecordLayout, unpack_record  # noqa: E402
from strata.formats.experts_file import ExpertsFile, write_packed_experts  # noqa: E402
from strata.formats.quant_types import QuantType  # noqa: E402
from strata.model_config import Ffn  # noqa: E402
from strata.testing import mlx_params  # noqa: E402
from strata.testing.models import SHAPES  # noqa: E402

CFG = dataclasses.replace(SHAPES["mla"], max_context=64)


def test_a_pooled_file_is_a_valid_experts_file(tmp_path):
    path = tmp_path / "pooled.experts"
    made = _random_experts.make_experts_file(path, CFG, 3, pool_records=5)
    pool, crcs = _random_experts.record_pool(CFG, 3, 5)
    rec = RecordLayout(QuantType.Q2_0, CFG.hidden_size, CFG.expert_ffn_size)
    e = CFG.n_experts
    with ExpertsFile.open(path) as xf:
        assert (xf.header.n_layers, xf.header.n_experts) == (CFG.n_moe_layers, e)
        assert made["bytes"] == xf.header.file_bytes == path.stat().st_size
        for l in range(CFG.n_moe_layers):
            for x in range(e):
                got = xf.read_record(l, x, verify=True)  # its stored CRC is its own bytes'
                np.testing.assert_array_equal(got, pool[(l * e + x) % 5])
                assert xf.checksum(l, x) == crcs[(l * e + x) % 5]
        scales = unpack_record(xf.read_record(0, 1), rec).gate.scales
    assert len({bytes(r) for r in pool}) == 5  # distinct records
    assert 1e-3 <= scales.min() and scales.max() <= 2e-2  # valid Q2_0 scales


def test_a_packed_record_of_the_wrong_size_is_refused(tmp_path):
    rec = RecordLayout(QuantType.Q2_0, CFG.hidden_size, CFG.expert_ffn_size)
    with pytest.raises(ValueError, match="layer 0 expert 0: a packed record"):
        write_packed_experts(tmp_path / "bad.experts", rec, n_layers=1, n_experts=2,
                             get_record=lambda l, e: (bytes(rec.padded_bytes - 1), 0))
    assert not (tmp_path / "bad.experts").exists()  # the atomic write left nothing


def test_record_chunks_are_bounded_in_bytes(monkeypatch):
    """Records generated in steps of at most CHUNK_BYTES: the same valid records in more steps."""
    rec = RecordLayout(QuantType.Q2_0, CFG.hidden_size, CFG.expert_ffn_size)
    monkeypatch.setattr(mlx_params, "CHUNK_BYTES", 2 * rec.padded_bytes)
    many = np.array(mlx_params.random_records(rec, 5, mx.random.key(1)))  # steps of 2, 2, 1
    assert many.shape == (5, rec.padded_bytes) and len({bytes(r) for r in many}) == 5
    for r in many:
        assert 1e-3 <= unpack_record(r, rec).down.scales.min()
    monkeypatch.setattr(mlx_params, "CHUNK_BYTES", 1 << 30)
    one_step = np.array(mlx_params.random_records(rec, 5, mx.random.key(1)))
    assert not np.array_equal(many, one_step)  # the step count is part of the key schedule


def test_deepseek_byte_budget_and_extrapolation():
    import decode_deepseek

    full = mlx_params.DEEPSEEK_V3_SHAPE
    cfg = dataclasses.replace(full, n_layers=8, layer_types=full.layer_types[:8])
    assert [t.ffn for t in cfg.kinds].count(Ffn.DENSE) == 3 and cfg.n_moe_layers == 5
    rec = RecordLayout(QuantType.Q2_0, 7168, 2048)
    assert abs(rec.padded_bytes / 1e6 - 13.76) < 0.01
    res = {"resident_engine_ms_per_token": 4.0, "read_GBps": 3000.0}
    rows = decode_deepseek.deepseek_extrapolation(full, cfg, res)
    per_moe = 8 * rec.padded_bytes
    assert decode_deepseek.token_bytes(full) - decode_deepseek.token_bytes(cfg) > 53 * per_moe  # 53 more MoE layers
    ratio = res["deepseek_full_bytes_per_token"] / res["deepseek_measured_bytes_per_token"]
    assert 3 < ratio < 10
    assert res["deepseek_resident_full_ms_by_bytes"] == pytest.approx(4.0 * ratio)
    assert res["deepseek_resident_full_ms_by_layers"] == pytest.approx(4.0 / 8 * 61)
    assert len(rows) == 4 and "61 layers" in rows[3][0]
    assert decode_deepseek.deepseek_extrapolation(full, cfg, res) == rows  # idempotent: printed after every part


def test_a_large_resident_arena_repeats_one_moe_layers_records():
    import decode_memory

    full = mlx_params.DEEPSEEK_V3_SHAPE
    cfg = dataclasses.replace(full, n_layers=8, layer_types=full.layer_types[:8])  # 5 MoE layers: 17.6 GB
    rec = RecordLayout(QuantType.Q2_0, 7168, 2048)
    assert decode_memory.resident_distinct(cfg) == 256
    assert decode_memory.resident_bytes(cfg) > (5 + 1) * 256 * rec.padded_bytes  # the arena and its pool
    small = RecordLayout(QuantType.Q2_0, CFG.hidden_size, CFG.expert_ffn_size)
    tiled = np.array(mlx_params.random_records(small, 6, mx.random.key(2), distinct=3))
    np.testing.assert_array_equal(tiled[:3], tiled[3:])
    assert len({bytes(r) for r in tiled}) == 3
