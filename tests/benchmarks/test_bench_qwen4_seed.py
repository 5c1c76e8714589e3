"""benchmarks/qwen4_seed.py (`benchmarks/decode.py --shape qwen4-seed`): the reference engine's
model, synthetic. At full size its shape and byte budget are the reference engine's; at tiny
sizes it builds its three files and decodes, all-resident and streaming, here."""

from __future__ import annotations

import json
import sys
from pathlib import Path

import pytest

sys.path.insert(0, str(Path(__file__).resolve().parents[2] / "benchmarks"))

import qwen4_seed  # noqa: E402
from strata.formats.expert_record import RecordLayout  # noqa: E402
from strata.formats.quant_types import QuantType  # noqa: E402
from strata.model_config import Mixer  # noqa: E402
from strata.families.qwen4_exp import ngram_heads, ple_layers  # noqa: E402


def test_the_full_size_shape_is_the_reference_engines():
    cfg = qwen4_seed.seed_shape()
    kinds = [k.mixer for k in cfg.kinds]
    assert kinds.count(Mixer.DELTANET) == 36 and kinds.count(Mixer.INDEXED_ATTENTION) == 12
    assert all(kinds[l] is Mixer.INDEXED_ATTENTION for l in range(3, 48, 4))
    assert (cfg.hidden_size, cfg.n_experts, cfg.n_experts_per_token, cfg.expert_ffn_size, cfg.shared_ffn_size,
            cfg.qwen4.hc_count, cfg.n_heads, cfg.n_kv_heads, cfg.head_dim) == (2560, 256, 10, 576, 512, 4, 16, 4, 128)
    assert len(ple_layers(cfg)) == 36
    assert abs(RecordLayout(QuantType.Q2_0, 2560, 576).record_bytes / 1e6 - 1.38) < 0.01
    budget = qwen4_seed.token_budget(cfg)
    assert abs(budget["experts"] / 1e6 - qwen4_seed.REFERENCE_MB["experts"]) < 10  # 10 x 48 x 1.38 MB
    assert abs(budget["router (F32)"] / 1e6 - qwen4_seed.REFERENCE_MB["router (F32)"]) < 1
    assert budget["PLE rows"] == 36 * ngram_heads(cfg) * 64 * 2  # 8 F16 rows of 64 per PLE layer
    assert 50e9 < qwen4_seed.store_bytes(cfg) < 100e9  # tens of GB at full size
    assert abs(qwen4_seed.store_bytes(qwen4_seed.seed_shape(ple_gb=24)) / 1e9 - 24) < 0.5
    # 48 layers with a 4 GB store: 17 GB of experts + 4 GB of rows + 7.8 GB of F16 dense weights
    assert abs(qwen4_seed.files_bytes(qwen4_seed.seed_shape(ple_gb=4)) / 1e9 - 28.4) < 0.5


def test_it_builds_and_decodes_at_two_tiny_layers(tmp_path, capsys):
    assert qwen4_seed.main(["--tiny", "--layers", "2", "--tokens", "2", "--backend", "numpy",
                            "--dir", str(tmp_path)]) == 0
    line = json.loads(capsys.readouterr().out.strip().splitlines()[-1])
    assert line["layers"] == 2 and set(line["ms_per_token"]) == {"all-resident", "streaming, arena 28slots"}
    assert all(ms > 0 for ms in line["ms_per_token"].values())
    assert line["ple"]["rows_read_per_token"] + line["ple"]["rows_hit_per_token"] == 2 * 8  # 2 PLE layers x 8 heads


@pytest.mark.parametrize("flag", ["--layers=0", "--layers=49"])
def test_layers_out_of_range_are_refused(flag):
    with pytest.raises(SystemExit):
        qwen4_seed.main([flag])


def test_keep_builds_once_and_reuses_the_files(tmp_path, capsys):
    args = ["--tiny", "--layers", "2", "--tokens", "1", "--backend", "numpy", "--skip", "resident",
            "--keep", str(tmp_path)]
    assert qwen4_seed.main(args) == 0
    built = (tmp_path / "qwen4_seed.gguf").stat().st_mtime_ns
    assert qwen4_seed.main(args) == 0
    assert (tmp_path / "qwen4_seed.gguf").stat().st_mtime_ns == built  # reused, not rebuilt
