"""Bytes a model takes, in memory and per decoded token, by quant type.

Sizes come from the one definition of each format (`strata.formats.quant_types`,
`strata.formats.expert_record.RecordLayout`), never retyped here:

- experts: one record per (MoE layer, expert) of `RecordLayout(qtype, hidden, expert_ffn)`; a
  slot is its `padded_bytes`; a token reads `top_k` records per MoE layer (`record_bytes`).
- dense: held as the file stores them (`dense_qtype` for matrices; routers and norms F32), so
  resident dense bytes are the stored ones; every matmul widens its weights to float32 first
  (strata/formats/dense_weights.py), so per-token dense bytes are float32's (what the GEMV
  reads) and `widened_per_token` the stored bytes widened per token, by type (the widening's
  cost, priced by the probe's `widen` tables).
- KV cache: float32 K and V per position of every attention layer, at `context` positions.
- PLE rows (Qwen4-Exp): the n-gram tables live in the row store, not in memory (resident 0); a
  token reads one row per n-gram head of every PLE layer (`PLE_ROW_TYPE`, the converter's default);
  the row cache (`ple_reserve`, its default size) is held in memory beside the arena.
"""

from __future__ import annotations

from dataclasses import dataclass

from strata.doctor.families import PartCounts
from strata.formats.expert_record import RECORD_ALIGN, RecordLayout, align_up
from strata.formats.quant_types import QuantType, layout

__all__ = ["ByteBudget", "ByteRow", "byte_budget", "bytes_per_weight", "COMPUTE_TYPE", "STORED_BITS"]

COMPUTE_TYPE = QuantType.F32  # what a dense matmul reads: its weights widened to float32
PLE_PART = "ple rows"  # the row store's part of the budget
PLE_ROW_TYPE = QuantType.F16  # strata convert's default row store type
KV_BYTES = 4  # float32 K/V cache values
# bits per weight of checkpoint formats strata does not store itself (scales included)
STORED_BITS = {"f32": 32.0, "bf16": 16.0, "f16": 16.0, "fp8": 8.0 + 32 / (128 * 128), "mxfp4": 4.25}


def bytes_per_weight(qtype: QuantType) -> float:
    lay = layout(qtype)
    return lay.block_bytes / lay.block_size


@dataclass(frozen=True)
class ByteRow:
    part: str
    qtype: str
    weights: int
    resident_bytes: int  # held in memory all-resident
    per_token_bytes: int  # read for one decoded token


@dataclass(frozen=True)
class ByteBudget:
    rows: tuple[ByteRow, ...]
    expert_qtype: QuantType
    record_bytes: int  # one expert as compute reads it
    slot_bytes: int  # one arena slot (the record padded to RECORD_ALIGN)
    total_experts: int
    dense_resident: int  # dense weights in memory: as stored
    dense_file: int  # dense weights in the model file, as stored (= dense_resident)
    experts_resident: int  # every expert in memory (slots)
    kv_bytes: int  # the KV cache at `context` positions
    context: int
    stored: dict  # the checkpoint as published: part -> bytes (HF sources)
    widened_per_token: dict = None  # stored type name -> stored bytes widened to float32 per token
    ple_reserve: int = 0  # a PLE model's row cache in memory (the default ple_reserve)

    def __post_init__(self) -> None:
        if self.widened_per_token is None:
            object.__setattr__(self, "widened_per_token", {})

    @property
    def per_token(self) -> int:
        return sum(r.per_token_bytes for r in self.rows)

    @property
    def expert_per_token(self) -> int:
        return sum(r.per_token_bytes for r in self.rows if r.part == "experts")

    @property
    def ple_per_token(self) -> int:
        return sum(r.per_token_bytes for r in self.rows if r.part == PLE_PART)

    @property
    def dense_per_token(self) -> int:
        return self.per_token - self.expert_per_token - self.ple_per_token

    @property
    def all_resident(self) -> int:
        return self.dense_resident + self.experts_resident + self.kv_bytes + self.ple_reserve


def _record(counts: PartCounts, qtype: QuantType) -> tuple[int, int]:
    try:
        rec = RecordLayout(qtype, counts.hidden, counts.expert_ffn)
        return rec.record_bytes, rec.padded_bytes
    except ValueError:  # a dimension that is not a whole number of blocks: the formula without planes
        n = int(counts.expert_weights * bytes_per_weight(qtype))
        return n, align_up(n, RECORD_ALIGN)


def byte_budget(counts: PartCounts, *, expert_qtype: QuantType = QuantType.Q2_0,
                dense_qtype: QuantType = QuantType.F32, context: int = 4096,
                slot_bytes: int | None = None, stored: dict | None = None) -> ByteBudget:
    """The byte budget of `counts` with experts as `expert_qtype` and dense matrices stored (and
    held) as `dense_qtype`. `slot_bytes`: the real record stride where an `.experts` file exists."""
    record, padded = _record(counts, expert_qtype)
    padded = slot_bytes or padded
    f32 = bytes_per_weight(COMPUTE_TYPE)
    row = counts.embedding if counts.tie_embeddings else counts.hidden  # tied: the head reads the whole table
    widened: dict[str, int] = {}

    def dense_row(part: str, n: int, per_token: int) -> ByteRow:
        qtype = QuantType.F32 if part in ("router", "norms") else dense_qtype
        if qtype is not QuantType.F32:
            widened[qtype.name] = widened.get(qtype.name, 0) + int(per_token * bytes_per_weight(qtype))
        return ByteRow(part, qtype.name, n, int(n * bytes_per_weight(qtype)), int(per_token * f32))

    rows = [dense_row("embedding", counts.embedding, row)]
    rows += [dense_row(part, n, n) for part, n in counts.dense.items()]
    rows.append(ByteRow("experts", expert_qtype.name, counts.total_experts * counts.expert_weights,
                        counts.total_experts * padded, counts.moe_layers * counts.top_k * record))
    ple_reserve = 0
    if counts.ple_rows_per_token:
        from strata.formats.ngram_rows_file import PAGE_BYTES
        from strata.runtime.ngram_budget import DEFAULT_CACHE_POSITIONS

        row_type = QuantType[counts.ple_row_type] if counts.ple_row_type else PLE_ROW_TYPE
        one = int(counts.ple_row_width * bytes_per_weight(row_type))
        rows.append(ByteRow(PLE_PART, row_type.name, counts.ple_table_values, 0, counts.ple_rows_per_token * one))
        ple_reserve = (DEFAULT_CACHE_POSITIONS * counts.ple_rows_per_token + 1) * PAGE_BYTES  # plan_row_cache's
    dense_resident = sum(r.resident_bytes for r in rows if r.part not in ("experts", PLE_PART))
    dense_file = dense_resident
    context_kv = counts.kv_per_position * context * KV_BYTES + counts.linear_state * KV_BYTES
    return ByteBudget(rows=tuple(rows), expert_qtype=expert_qtype, record_bytes=record, slot_bytes=padded,
                      total_experts=counts.total_experts, dense_resident=dense_resident, dense_file=dense_file,
                      experts_resident=counts.total_experts * padded, kv_bytes=context_kv, context=context,
                      stored=stored or {}, widened_per_token=widened, ple_reserve=ple_reserve)


def stored_bytes(counts: PartCounts, *, dense_bits: float, expert_bits: float) -> dict:
    """The checkpoint's own size by part (bits per weight as published)."""
    return {"dense": int(counts.dense_weights * dense_bits / 8),
            "experts": int(counts.total_experts * counts.expert_weights * expert_bits / 8)}
