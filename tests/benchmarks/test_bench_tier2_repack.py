"""benchmarks/tier2_repack.py on a tiny checkpoint: both forms read the same experts and bytes,
in place in one call per piece and repacked in one per expert; the records file it wrote is
gone after, and a directory already holding one is refused in one line."""

from __future__ import annotations

import json
import sys
from pathlib import Path

import pytest

pytest.importorskip("mlx_lm")
sys.path.insert(0, str(Path(__file__).resolve().parents[2] / "benchmarks"))

import tier2_repack  # noqa: E402
from strata.tier2.records import RECORDS_NAME  # noqa: E402
from tests import tier2_models  # noqa: E402


def test_the_forms_read_the_same_experts_in_fewer_calls(tmp_path, capsys):
    d = tier2_models.make_checkpoint("qwen3_moe_a4g32", tmp_path / "q")
    before = sorted(p.name for p in d.iterdir())
    assert tier2_repack.main([str(d), "--tokens", "3", "--prompt-tokens", "6", "--repeat", "1", "--prefetch", "2"]) == 0
    out = json.loads(capsys.readouterr().out.strip().splitlines()[-1])
    place, packed = out["rows"]["in place"], out["rows"]["repacked"]
    assert place["expert_reads_per_token"] == packed["expert_reads_per_token"] > 0  # the same decisions
    assert place["mb_per_token"] == packed["mb_per_token"]
    assert place["read_calls_per_token"] == 9 * place["expert_reads_per_token"]  # codes, scales, biases x 3
    assert packed["read_calls_per_token"] == packed["expert_reads_per_token"]
    assert "in place" in place["io"] and "aligned records" in packed["io"]
    assert sorted(p.name for p in d.iterdir()) == before  # its records file deleted

    (d / RECORDS_NAME).write_bytes(b"")
    assert tier2_repack.main([str(d)]) == 2
    err = capsys.readouterr().err.strip()
    assert len(err.splitlines()) == 1 and "exists" in err
