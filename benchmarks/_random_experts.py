"""A valid `.experts` file of random Q2_0 experts, for the benchmarks that time reads and
kernels over a model's shape (the values do not matter, the bytes and the layout do).

What is random and what repeats: a pool of POOL_RECORDS distinct records (random codes, float16
scales in [1e-3, 2e-2]: `strata.testing.mlx_params.random_records`, made on MLX's default device),
each packed and checksummed once; record (l, e) of the file is pool[(l E + e) % P]. Every record
still has its own place in the file (a read of it is a real pread of its own pages), and the
CRC table holds each record's true checksum, so the engine reads it as it reads a converted model.
The cost is the bytes written (DeepSeek-V3: 13.8 MB a record, 3.5 GB a MoE layer), no longer
numpy's random draws and a pack per record (~120 ms a record on a 2-core host).
"""

from __future__ import annotations

import time
from pathlib import Path

import mlx.core as mx
import numpy as np

from strata.formats.checksum import checksum
from strata.formats.expert_record import RecordLayout
from strata.formats.experts_file import write_packed_experts
from strata.formats.quant_types import QuantType
from strata.model_config import ModelConfig
from strata.testing.mlx_params import random_records

POOL_RECORDS = 32  # distinct records a file repeats (0.44 GB at DeepSeek-V3's record)


def record_pool(cfg: ModelConfig, seed: int, n: int = POOL_RECORDS) -> tuple[np.ndarray, np.ndarray]:
    """n distinct random records of cfg's Q2_0 layout and their CRC-32s.

    Shapes:
        -> records uint8 [n, padded_bytes], crcs uint32 [n]
    """
    rec = RecordLayout(QuantType.Q2_0, cfg.hidden_size, cfg.expert_ffn_size)
    pool = np.array(random_records(rec, n, mx.random.key(seed)))
    crcs = np.array([checksum(pool[i, :rec.record_bytes]) for i in range(n)], np.uint32)
    return pool, crcs


def make_experts_file(path: Path, cfg: ModelConfig, seed: int, *, pool_records: int = POOL_RECORDS) -> dict:
    """Every MoE layer's cfg.n_experts records from a repeated pool (module doc) -> what it cost:
    {"pool_s", "write_s", "bytes", "write_GBps"}."""
    rec = RecordLayout(QuantType.Q2_0, cfg.hidden_size, cfg.expert_ffn_size)
    t0 = time.perf_counter()
    pool, crcs = record_pool(cfg, seed, min(pool_records, cfg.n_moe_layers * cfg.n_experts))
    t1 = time.perf_counter()
    e = cfg.n_experts

    def record(l: int, x: int) -> tuple[np.ndarray, int]:
        i = (l * e + x) % len(pool)
        return pool[i], int(crcs[i])

    header = write_packed_experts(path, rec, n_layers=cfg.n_moe_layers, n_experts=e, get_record=record)
    t2 = time.perf_counter()
    return {"pool_s": t1 - t0, "write_s": t2 - t1, "bytes": header.file_bytes,
            "write_GBps": header.file_bytes / max(t2 - t1, 1e-9) / 1e9}
