"""What `strata doctor SOURCE` looks at, read without touching a weight.

SOURCE is one of:
- a strata model `NAME.gguf` (with `NAME.experts` beside it): its metadata (ModelConfig), the
  dense tensors' stored types from the GGUF tensor index, the `.experts` header's record size;
- a Hugging Face `config.json`, or a directory holding one (a checkpoint, or an MLX one, whose
  config carries a `quantization` block);
- a llama.cpp GGUF: its tensor index gives every tensor's stored bytes (experts are the
  `*_exps` tensors).
A routing trace (`strata trace`) found beside a strata model as `NAME.trace.npz`, or given with
`--trace`, makes the locality figures the model's own.
"""

from __future__ import annotations

import math

import json
from dataclasses import dataclass, field
from pathlib import Path

from strata.doctor.families import PartCounts, count_hf, count_strata
from strata.doctor.byte_budget import STORED_BITS, stored_bytes
from strata.errors import ConfigError, FormatError
from strata.formats.quant_types import QuantType

__all__ = ["Source", "read_source"]

GGUF_MAGIC = b"GGUF"
LLAMA_CPP_PLE_TABLE = "per_layer_token_embd.weight"  # qwen4exp's one n-gram table (the row store's part)


@dataclass(frozen=True)
class Source:
    path: str
    kind: str  # "strata", "hf", "mlx", "gguf"
    counts: PartCounts
    expert_qtype: QuantType
    dense_qtype: QuantType
    slot_bytes: int | None = None  # the real record stride (strata models)
    model_files: tuple[Path, ...] = ()
    trace: Path | None = None
    stored: dict = field(default_factory=dict)  # the checkpoint's own bytes by part
    note: str = ""
    # a llama.cpp GGUF run in place: its experts' reads against the converted records' (expert_pieces.PieceStore)
    in_place: dict = field(default_factory=dict)

    @property
    def runnable(self) -> bool:
        """strata can run this model as it is (a strata model file of a supported family)."""
        return self.kind == "strata"


def read_source(path: str | Path, *, expert_qtype: QuantType = QuantType.Q2_0,
                dense_qtype: QuantType = QuantType.F32, trace: str | Path | None = None) -> Source:
    """Read SOURCE (module docstring). `expert_qtype` / `dense_qtype`: the types a conversion
    would write (strata convert's defaults), for sources that are not strata models yet."""
    p = Path(path)
    if p.is_dir():
        p = p / "config.json"
        if not p.exists():
            raise ConfigError(f"{path}: no config.json in this directory")
    if not p.exists():
        raise ConfigError(f"{path}: no such file")
    with open(p, "rb") as f:
        magic = f.read(4)
    if magic == GGUF_MAGIC:
        src = _read_gguf(p)
    else:
        src = _read_hf(p, expert_qtype, dense_qtype)
    if trace is not None:
        src = _with_trace(src, Path(trace))
    elif src.kind == "strata" and p.with_suffix(".trace.npz").exists():
        src = _with_trace(src, p.with_suffix(".trace.npz"))
    return src


def _with_trace(src: Source, trace: Path) -> Source:
    import dataclasses

    if not trace.exists():
        raise ConfigError(f"{trace}: no such trace file")
    return dataclasses.replace(src, trace=trace)


def _read_hf(p: Path, expert_qtype: QuantType, dense_qtype: QuantType) -> Source:
    try:
        raw = json.loads(p.read_text())
    except (OSError, UnicodeDecodeError, json.JSONDecodeError) as e:
        raise ConfigError(f"{p}: not a config.json ({type(e).__name__}: {' '.join(str(e).split())})") from None
    if not isinstance(raw, dict):
        raise ConfigError(f"{p}: not a JSON object")
    counts = count_hf(raw, str(p))
    kind, note = "hf", ""
    mlx_q = raw.get("quantization")  # MLX writes {"group_size": 64, "bits": 4}; transformers a quantization_config
    q = raw.get("quantization_config")
    if mlx_q and isinstance(mlx_q, dict) and "bits" in mlx_q:
        kind = "mlx"
        bits = float(mlx_q["bits"]) + 2 * 16 / float(mlx_q.get("group_size", 64))  # bf16 scale + bias per group
        stored = stored_bytes(counts, dense_bits=bits, expert_bits=bits)
        note = (f"an MLX {mlx_q['bits']}-bit checkpoint: strata converts from the float checkpoint, "
                f"not from this one")
    elif isinstance(q, dict) and q.get("quant_method") in ("fp8", "mxfp4"):
        method = q["quant_method"]
        dense_bits = STORED_BITS["bf16"]
        expert_bits = STORED_BITS[method]
        if method == "fp8":
            dense_bits = STORED_BITS["fp8"]
        stored = stored_bytes(counts, dense_bits=dense_bits, expert_bits=expert_bits)
        note = f"stored as {method}"
    else:
        dtype = str(raw.get("torch_dtype") or raw.get("dtype") or (raw.get("text_config") or {}).get("dtype") or "bf16")
        bits = STORED_BITS.get({"bfloat16": "bf16", "float16": "f16", "float32": "f32"}.get(dtype, "bf16"), 16.0)
        stored = stored_bytes(counts, dense_bits=bits, expert_bits=bits)
    return Source(str(p), kind, counts, expert_qtype, dense_qtype, stored=stored, note=note)


def _read_gguf(p: Path) -> Source:
    from strata.formats.gguf_file import open_gguf
    from strata.formats.model_file import ARCHITECTURE, KEY_ARCHITECTURE, _field, read_model_config

    reader = open_gguf(p)
    arch = _field(reader, KEY_ARCHITECTURE, required=False)
    if arch == ARCHITECTURE:
        return _read_strata(p, reader, read_model_config(p))
    return _read_llama_cpp(p, reader, str(arch))


def _read_strata(p: Path, reader, cfg) -> Source:
    from strata.formats.experts_file import ExpertsFile
    from strata.loader import experts_path_for

    xp = experts_path_for(p)
    if not xp.exists():
        raise FormatError(f"{xp}: no such experts file (expected beside {p.name})")
    with ExpertsFile.open(xp) as xf:
        h = xf.header
        # a file mixing types per layer (a GGUF's, kept as stored): its first layer's gate type
        # stands for it (never Q2_0, so the backend rule picks numpy); the slot is the largest record
        qtype, slot = (h.layer_qtypes[0][0] if h.mixed else QuantType(h.qtype)), h.padded_bytes
    dense_types = {int(t.ggml_type) for t in reader.tensors.values() if len(t.shape) > 1}
    dense_types.discard(int(QuantType.F32))
    dense_qtype = QuantType(min(dense_types)) if dense_types else QuantType.F32
    counts = count_strata(cfg, cfg.architecture)
    return Source(str(p), "strata", counts, qtype, dense_qtype, slot_bytes=slot, model_files=(p, xp),
                  stored={"dense": int(sum(int(t.nbytes) for t in reader.tensors.values())), "experts": xp.stat().st_size})


def _read_llama_cpp(p: Path, reader, arch: str) -> Source:
    """A llama.cpp GGUF: shapes from its metadata, stored bytes exactly from its tensor index."""
    from strata.formats.model_file import _field

    def meta(key, default=None):
        v = _field(reader, f"{arch}.{key}", required=False)
        return default if v is None else int(v)

    n_layers, n_exp, top_k = meta("block_count"), meta("expert_count"), meta("expert_used_count")
    hidden, ffn = meta("embedding_length"), meta("expert_feed_forward_length")
    if not (n_layers and n_exp and top_k and hidden):
        raise ConfigError(f"{p}: a {arch} GGUF without expert metadata: not a Mixture-of-Experts model strata knows")
    experts = dense = embedding = 0
    expert_weights = 0
    ple: dict = {}  # qwen4exp's n-gram table: the row store's after conversion, not a dense weight
    table = 0
    for t in reader.tensors.values():
        if "_exps" in t.name:
            experts += int(t.nbytes)
            expert_weights += math.prod(t.shape)
        elif t.name == LLAMA_CPP_PLE_TABLE:
            ple = dict(ple_table_values=math.prod(t.shape), ple_row_width=int(t.shape[-1]),
                       ple_rows_per_token=(meta("ple.ngram_size", 1) - 1) * meta("ple.heads_per_ngram", 0),
                       ple_row_type=QuantType(int(t.ggml_type)).name)  # a run in place reads rows as stored
            table += int(t.nbytes)
        elif t.name.startswith("token_embd"):
            embedding += math.prod(t.shape)
        else:
            dense += math.prod(t.shape)
    moe_layers = max(1, sum(1 for t in reader.tensors.values() if t.name.endswith("ffn_down_exps.weight")))
    per_expert = expert_weights // (moe_layers * n_exp) if expert_weights else 3 * hidden * (ffn or 0)
    vocab = embedding // hidden if hidden else 0
    in_place, refusal = _in_place_reads(p)
    why_not = f"a llama.cpp GGUF neither a run in place nor `strata convert` reads: {refusal}" if refusal else ""
    counts = PartCounts(family=f"llama.cpp {arch}", model_type=arch, supported=bool(in_place), why_not=why_not,
                        hidden=hidden, vocab=vocab, n_layers=n_layers, moe_layers=moe_layers, n_experts=n_exp,
                        top_k=top_k, expert_ffn=ffn or per_expert // (3 * hidden), expert_weights=per_expert,
                        embedding=embedding, dense={"dense": dense},
                        **ple)
    qtype, slot = _kept_expert_types(reader, hidden, counts.expert_ffn)
    stored = {"dense": int(sum(int(t.nbytes) for t in reader.tensors.values())) - experts - table,
              "experts": experts}
    if table:
        stored["ple rows"] = table
    return Source(str(p), "gguf", counts, qtype, _held_dense_type(reader), slot_bytes=slot, model_files=(p,),
                  stored=stored, in_place=in_place)


def _in_place_reads(p: Path) -> tuple[dict, str]:
    """How a run in place reads the GGUF's experts, against the records `strata convert` writes
    (one read of `converted_bytes_per_record` each), and ""; ({}, the one-line refusal) where
    strata reads the file neither way."""
    from strata.convert.gguf_in_place import open_expert_store

    try:
        with open_expert_store(p) as store:
            return {"reads_per_record": store.reads_per_record, "multi_read_share": store.multi_read_share,
                    "read_bytes_per_record": store.read_bytes_per_record,
                    "converted_bytes_per_record": store.header.padded_bytes}, ""
    except (ConfigError, FormatError) as e:
        return {}, str(e)


def _kept_expert_types(reader, hidden: int, ffn: int) -> tuple[QuantType, int | None]:
    """What `strata convert` writes for a GGUF's experts, which it keeps as stored: (the first MoE
    layer's gate type, standing for them, and the arena slot: the largest layer's padded record).
    (Q2_0, None) where the GGUF's expert tensors are not the stacked ones a conversion reads."""
    from strata.formats.expert_record import RecordLayout

    layers = {}
    for t in reader.tensors.values():
        parts = t.name.split(".")
        if len(parts) == 4 and parts[0] == "blk" and parts[2] in ("ffn_gate_exps", "ffn_up_exps", "ffn_down_exps"):
            layers.setdefault(int(parts[1]), {})[parts[2]] = t.ggml_type
    try:
        types = [tuple(QuantType(layer[k]) for k in ("ffn_gate_exps", "ffn_up_exps", "ffn_down_exps"))
                 for _, layer in sorted(layers.items())]
        slot = max(RecordLayout(g, hidden, ffn, up_qtype=u, down_qtype=d).padded_bytes for g, u, d in types)
    except (KeyError, ValueError):  # a missing projection, a type strata does not read, a partial block
        return QuantType.Q2_0, None
    return types[0][0], slot


def _held_dense_type(reader) -> QuantType:
    """The type a llama.cpp GGUF's dense matrices are held in, standing for all of them: the type of
    most of their weights (not the experts' or the n-gram table's), where a load keeps it as
    stored (strata.formats.dense_weights.StoredType: F16, BF16, Q8_0 and the block types with a
    compiled CPU kernel); F32 where it widens it."""
    from strata.formats.dense_weights import StoredType

    weights: dict[int, int] = {}
    for t in reader.tensors.values():
        if len(t.shape) > 1 and "_exps" not in t.name and t.name != LLAMA_CPP_PLE_TABLE:
            weights[int(t.ggml_type)] = weights.get(int(t.ggml_type), 0) + math.prod(t.shape)
    most = max(weights, key=weights.get, default=int(QuantType.F32))
    return QuantType(most) if StoredType.of(most) is not None else QuantType.F32
