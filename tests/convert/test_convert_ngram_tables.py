"""A checkpoint's PLE n-gram tables (whole or in `shard_{k}` pieces, any dtype) into a row store,
read in row ranges, never whole (strata.convert.ngram_tables)."""

from __future__ import annotations

import json

import numpy as np
import pytest

torch = pytest.importorskip("torch")  # the checkpoints are written in torch's dtypes (bfloat16 among them)
from safetensors.torch import save_file  # noqa: E402

from strata.convert import ngram_tables
from strata.convert.ngram_tables import find_ngram_tables, write_ngram_tables
from strata.convert.safetensors_reader import Checkpoint
from strata.errors import FormatError
from strata.formats.quant_types import QuantType

PREFIX = "model.language_model."
KEY = PREFIX + "layers.{}.ple.ple_embedding.ngram_embedding.{}weight"


def _checkpoint(directory, dtype=torch.bfloat16, drop_shard=None):
    """Layer 1's table in 3 uneven shards across two files, layer 3's whole, and one other tensor."""
    g = torch.Generator().manual_seed(0)
    shards = [torch.randn(n, 32, generator=g).to(dtype) for n in (70, 64, 9)]
    whole = torch.randn(50, 16, generator=g).to(dtype)
    a = {KEY.format(1, f"shard_{k}."): s for k, s in enumerate(shards) if k != drop_shard}
    b = {KEY.format(3, ""): whole, PREFIX + "norm.weight": torch.ones(8)}
    save_file({k: v for k, v in a.items() if "shard_2" not in k}, str(directory / "a.safetensors"))
    save_file({**b, **{k: v for k, v in a.items() if "shard_2" in k}}, str(directory / "b.safetensors"))
    index = {"weight_map": {**{k: "a.safetensors" for k in a if "shard_2" not in k},
                            **{k: "b.safetensors" for k in [*b, *[k for k in a if "shard_2" in k]]}}}
    (directory / "model.safetensors.index.json").write_text(json.dumps(index))
    return {1: torch.cat(shards).float().numpy(), 3: whole.float().numpy()}


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16, torch.float32])
def test_tables_stream_into_a_row_store(tmp_path, monkeypatch, dtype):
    want = _checkpoint(tmp_path, dtype)
    monkeypatch.setattr(ngram_tables, "ROWS_PER_READ", 16)  # several reads per shard, one ending mid-shard
    with Checkpoint(tmp_path) as ckpt:
        tables = find_ngram_tables(ckpt)
        assert [(t.layer, t.rows, t.width, len(t.keys)) for t in tables.values()] == [(1, 143, 32, 3), (3, 50, 16, 1)]
        assert tables[1].keys[2].endswith("shard_2.weight")
        with write_ngram_tables(ckpt, tmp_path / "m.ngrams", tables, qtype=QuantType.F32) as store:
            assert sorted(store.tables) == [0, 1]  # keyed by PLE index: decoder layers 1 and 3
            for i, t in enumerate(want[l] for l in sorted(want)):
                np.testing.assert_array_equal(store.rows(i, np.arange(len(t))), t)  # f32 keeps every dtype exactly


def test_a_missing_shard_is_refused(tmp_path):
    _checkpoint(tmp_path, drop_shard=1)
    with Checkpoint(tmp_path) as ckpt, pytest.raises(FormatError, match=r"layer 1's n-gram table lacks shard\(s\) \[1\]"):
        find_ngram_tables(ckpt)


def test_f16_refuses_values_beyond_its_range(tmp_path):
    save_file({KEY.format(0, ""): torch.full((4, 32), 1e6)}, str(tmp_path / "model.safetensors"))
    with Checkpoint(tmp_path) as ckpt, pytest.raises(ValueError, match="beyond float16's range .* store them as F32"):
        write_ngram_tables(ckpt, tmp_path / "m.ngrams", find_ngram_tables(ckpt), qtype=QuantType.F16)
    assert not (tmp_path / "m.ngrams").exists()
