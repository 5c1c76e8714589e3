"""A valid `.experts` file of random Q2_0 experts, for the benchmarks that time reads and
kernels over a model's shape (the values do not matter, the bytes and the layout do)."""

from __future__ import annotations

from pathlib import Path

import numpy as np

from strata.formats.checksum import checksum
from strata.formats.expert_record import ExpertWeights, RecordLayout, pack_record
from strata.formats.experts_file import write_experts
from strata.formats.quant_matrix import QuantMatrix
from strata.formats.quant_types import QuantType
from strata.model_config import ModelConfig


def make_experts_file(path: Path, cfg: ModelConfig, seed: int) -> None:
    """cfg.n_experts random Q2_0 experts (`seed`), reused by every MoE layer."""
    rng = np.random.default_rng(seed)
    d, f = cfg.hidden_size, cfg.expert_ffn_size

    def qm(rows: int, cols: int) -> QuantMatrix:
        return QuantMatrix(QuantType.Q2_0, rows, cols, rng.integers(0, 256, (rows, cols // 4), dtype=np.uint8),
                           rng.uniform(1e-3, 2e-2, (rows, cols // 32)).astype(np.float16))

    pool = [ExpertWeights(qm(f, d), qm(f, d), qm(d, f)) for _ in range(cfg.n_experts)]
    done: dict[int, tuple[bytes, int]] = {}  # id(pool expert) -> (record, checksum): packed once, not per layer

    def packed(w: ExpertWeights, rec: RecordLayout) -> tuple[bytes, int]:
        if id(w) not in done:
            buf = pack_record(w, rec)
            done[id(w)] = buf, checksum(memoryview(buf)[: rec.record_bytes])
        return done[id(w)]

    write_experts(path, qtype=QuantType.Q2_0, n_layers=cfg.n_moe_layers, n_experts=cfg.n_experts, hidden=d,
                  expert_ffn=f, get_expert=lambda l, e: pool[e], packed=packed)
