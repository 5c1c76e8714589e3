"""A llama.cpp GGUF run as it is: no conversion, nothing written (`strata generate model.gguf`).

`strata convert model.gguf OUT` reads the file as the checkpoint it was converted from
(strata/convert/gguf_checkpoint.py) and writes OUT.gguf (dense weights, kept as stored where a
matrix is its own tensor) and OUT.experts (each expert one aligned record, types as stored). This
module does the same reading and keeps the result in memory instead of writing it:

- the plan is the conversion's own (`checkpoint_plan.plan_checkpoint`: the family, the
  ModelConfig, which GGUF tensor each dense weight comes from, the tokenizer), so every check the
  conversion makes before writing a byte is made here too, with its messages;
- each dense weight is what the converted model file holds after a load: a matrix kept as stored
  (`checkpoint_plan.kept_dense`) is held as `read_model` holds those bytes (F16 / BF16 / Q8_0 as
  stored, other types widened to float32 by the same `held_dense`), every other one in float32 as
  the converter writes it (`LazyTensor`). So the dense weights are the converted run's, bit for bit;
- the routed experts stay in the user's file: a `PieceStore` (strata/formats/expert_pieces.py)
  whose records are put together from each expert's slices of the stacked `*_exps` tensors
  (`GgufExpertTensors.slices`, the map the conversion copies by), read by the reader pool
  (strata/runtime/piece_reader.py) into the arena's slots;
- a `qwen4exp` file's n-gram table (`per_layer_token_embd.weight`, tens of GB) stays in the file
  too: the PLE row store is a `GgufNgramTable` over it (strata/convert/ngram_table_in_place.py),
  its rows read into the row cache in their stored type and dequantized per row, so they are the
  rows a conversion with F32 rows stores.

A split GGUF runs from its first part, its pieces read from whichever part holds each tensor. The
file's structure is checked at open (a moved offset, a relabelled type, truncation: one line
each); each record is verified on its reads (strata/formats/expert_pieces.py).
"""

from __future__ import annotations

import sys
from dataclasses import dataclass
from pathlib import Path

import numpy as np

from strata.convert import gguf_checkpoint
from strata.convert.checkpoint_plan import LazyTensor, kept_dense, plan_checkpoint
from strata.convert.ngram_table_in_place import GgufNgramTable
from strata.convert.tokenizer_files import TokenizerFiles
from strata.errors import ConfigError
from strata.formats.dense_weights import DenseWeights
from strata.formats.expert_pieces import PieceStore, files_identity, record_pieces
from strata.formats.expert_record import RecordLayout
from strata.formats.model_file import held_dense
from strata.model_config import ModelConfig, dense_tensor_shapes
from strata.ple_store import table_shapes

__all__ = ["InPlace", "open_in_place", "open_expert_store"]


@dataclass(frozen=True, eq=False)
class InPlace:
    """What a load needs of a llama.cpp GGUF run in place: the config, the dense weights as the
    converted model file would hold them, the tokenizer files, the expert store, and a PLE model's
    row store (None for any other)."""

    cfg: ModelConfig
    dense: DenseWeights
    tokenizer: TokenizerFiles
    experts: PieceStore
    family: str
    ngrams: GgufNgramTable | None = None  # qwen4exp: its n-gram table, the PLE row store read in place


def open_in_place(path: str | Path) -> InPlace:
    """Read `path` (a llama.cpp GGUF, or the first part of a split one) for a run in place (module
    doc). Refused in one line where the conversion would refuse it."""
    path = Path(path)
    with gguf_checkpoint.GgufCheckpoint(path) as ckpt:
        hf = gguf_checkpoint.hf_config_of(ckpt)
        plan = plan_checkpoint(path, ckpt, hf, None)
        cfg = plan.cfg
        dense = _dense(ckpt, plan, cfg)
        experts = _expert_store(ckpt, plan.experts, cfg)
        try:
            ngrams = _ngram_table(ckpt, cfg, experts.identity) if cfg.qwen4.ple_row_store else None
        except BaseException:
            experts.close()
            raise
    return InPlace(cfg, DenseWeights(dense), plan.tokenizer, experts, plan.family.name, ngrams)


def open_expert_store(path: str | Path) -> PieceStore:
    """The expert store a run in place reads, without the dense weights (what `strata doctor`
    looks at): refused in one line where a load would be."""
    path = Path(path)
    with gguf_checkpoint.GgufCheckpoint(path) as ckpt:
        plan = plan_checkpoint(path, ckpt, gguf_checkpoint.hf_config_of(ckpt), None)
        return _expert_store(ckpt, plan.experts, plan.cfg)


def _dense(ckpt: gguf_checkpoint.GgufCheckpoint, plan, cfg: ModelConfig) -> dict:
    """Each dense weight as a load of the converted model file holds it (module doc), with a
    progress bar on a terminal (a large model's dense weights take a while to read and widen)."""
    from tqdm import tqdm

    shapes = dense_tensor_shapes(cfg)
    out = {}
    with tqdm(total=len(plan.sources), desc=f"{ckpt.path.name} (dense weights, in place)", unit="tensor",
              disable=None, file=sys.stderr, dynamic_ncols=True, leave=False) as bar:  # disable=None: only on a tty
        for name, src in plan.sources.items():
            kept = kept_dense(ckpt, name, src, shapes[name], None)
            if kept is None:  # written as float32 by the conversion, read back as it was written
                out[name] = np.ascontiguousarray(LazyTensor(ckpt, src, shapes[name]), dtype=np.float32)
            else:
                out[name] = held_dense(str(ckpt.path), name, kept.ggml_type, kept.read(), shapes[name])
            bar.update(1)
    return out


def _expert_store(ckpt: gguf_checkpoint.GgufCheckpoint, experts: gguf_checkpoint.GgufExpertTensors,
                  cfg: ModelConfig) -> PieceStore:
    """The PieceStore of the GGUF's stacked experts: each layer's record layout (its types as
    stored) and where each of its planes' bytes are, in which file."""
    files = ckpt.reader.files  # (path, header bytes) of each part
    index = {p: i for i, (p, _) in enumerate(files)}
    biases = cfg.gpt_oss.expert_bias

    def sources(slices):
        out = []
        for s in slices:
            file, begin = ckpt.reader.location(ckpt.gguf_tensors[s.name])
            out.append((index[file], begin + s.offset, s.stride, s.nbytes))
        return out

    layouts, pieces = [], []
    for m, (g, u, d) in enumerate(experts.layer_qtypes):
        rec = RecordLayout(g, cfg.hidden_size, cfg.expert_ffn_size, biases, up_qtype=u, down_qtype=d)
        layouts.append(rec)
        pieces.append(record_pieces(rec, sources(experts.slices(m)),
                                    sources(experts.bias_slices(m)) if biases else ()))
    return PieceStore([p for p, _ in files], layouts, cfg.n_experts, pieces, files_identity(files))


def _ngram_table(ckpt: gguf_checkpoint.GgufCheckpoint, cfg: ModelConfig, identity: str) -> GgufNgramTable:
    """A qwen4exp file's one n-gram table as the PLE row store, read in place (its rows must be the
    config's table: the rows its hash addresses, one head's width)."""
    from strata.convert.gguf_checkpoint import PLE_TABLE

    info = ckpt.gguf_tensors.get(PLE_TABLE)
    if info is None:
        raise ConfigError(f"{ckpt.path}: ple.layers names a PLE layer, but the file has no {PLE_TABLE} "
                          "(the n-gram table)")
    (want,) = table_shapes(cfg).values()  # llama.cpp's loader holds one PLE layer (gguf_checkpoint)
    if tuple(info.shape) != want:
        raise ConfigError(f"{ckpt.path}: tensor {PLE_TABLE} is {list(info.shape)}; the config's n-gram hash "
                          f"addresses a table of {list(want)} (rows, width)")
    file, begin = ckpt.reader.location(info)
    return GgufNgramTable.open_table(file, PLE_TABLE, info.ggml_type, begin, *want, layer=0, identity=identity)
