"""`strata convert` of a Qwen4-Exp checkpoint whose n-gram tables are far larger than the rest:
the tables stream into the row store a row range at a time, never a table (nor a shard) in
memory. The tiny parity checkpoint (tests/fixtures/hf/qwen4_exp_text) with its tables replaced by
two of ~8M rows (its `ngram_vocab_size_base` raised to match; float16 shards of 64 MB, 128 MB each
table in float32), measured as tests/convert/test_convert_streaming.py measures:

    peak - start <= 4 x one read of ROWS_PER_READ rows in float32 + PLE_RSS_SLACK
"""

from __future__ import annotations

import json
import shutil
from pathlib import Path

import numpy as np
import pytest

from strata.convert.ngram_tables import ROWS_PER_READ
from strata.convert.safetensors_reader import Checkpoint
from strata.families.qwen4_exp import primes_from
from tests.budgets import PLE_RSS_SLACK
from tests.convert_memory import convert_rss

REPO = Path(__file__).resolve().parents[2]
FIXTURE = REPO / "tests" / "fixtures" / "hf" / "qwen4_exp_text"
BASE = 2_000_003  # the first prime of the big tables: 4 heads of ~2M rows each per PLE layer


def _big_checkpoint(dst: Path) -> tuple[int, int]:
    """The fixture with big tables; -> (rows per table, width)."""
    from safetensors.numpy import save_file

    config = json.loads((FIXTURE / "config.json").read_text())
    heads = (config["ngram_size"] - 1) * config["heads_per_ngram"]
    width, divisor = config["ple_embed_dim"] // heads, config["make_ngram_vocab_size_divisible_by"]
    config["ngram_vocab_size_base"] = BASE
    shutil.copytree(FIXTURE, dst, ignore=shutil.ignore_patterns("*.safetensors*", "expected.npz"))
    (dst / "config.json").write_text(json.dumps(config))
    with Checkpoint(FIXTURE) as ck:  # the other tensors as float32 (exact for their bf16)
        kept = {n: ck.read(n) for n in ck.tensors if ".ple_embedding." not in n}
    primes = primes_from(BASE, 2 * heads)
    rng = np.random.default_rng(0)
    rows = []
    for i, layer in enumerate(sorted(l - 1 for l in config["ple_layer_ids"])):
        n = -(-sum(primes[i * heads:(i + 1) * heads]) // divisor) * divisor
        rows.append(n)
        base = f"model.layers.{layer}.ple.ple_embedding.ngram_embedding."
        half = n // 2
        for s, (a, b) in enumerate(((0, half), (half, n))):
            kept[f"{base}shard_{s}.weight"] = (rng.standard_normal((b - a, width), dtype=np.float32) * 0.02).astype(
                np.float16)
    save_file({k: np.ascontiguousarray(v) for k, v in kept.items()}, str(dst / "model.safetensors"))
    return rows[0], width


@pytest.mark.skipif(not Path("/proc/self/clear_refs").exists(), reason="needs Linux's VmHWM reset")
def test_big_tables_stream_into_the_row_store(tmp_path):
    rows, width = _big_checkpoint(tmp_path / "hf")
    table_f32 = rows * width * 4
    start, peak = convert_rss(str(tmp_path / "hf"), str(tmp_path / "out"), "--experts", "f16", timeout=600)
    assert (tmp_path / "out.ngrams").stat().st_size > 2 * rows * width * 2  # both tables, F16 rows
    bound = 4 * ROWS_PER_READ * width * 4 + PLE_RSS_SLACK
    assert bound < table_f32 / 2  # the bound could tell a table in memory from a streamed one
    assert peak - start <= bound, ((peak - start) / 2**20, bound / 2**20)

    import strata

    with strata.load(tmp_path / "out.gguf") as model:
        assert model.ngrams_file.tables[0].rows == rows
