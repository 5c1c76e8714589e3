"""What a conversion reads before it writes: the plan of a checkpoint, and its dense tensors.

`plan_checkpoint` checks everything before a byte is written (config, shards, every tensor's name,
shape and dtype, the tokenizer, the expert type) and says where each dense tensor comes from;
`LazyTensor` reads one dense tensor when asked, `kept_dense` a llama.cpp GGUF's matrix as stored.
`strata convert` (strata/convert/driver.py) writes what they give; a llama.cpp GGUF run in place
(strata/convert/gguf_in_place.py) holds it in memory instead, so both read a file alike.
"""

from __future__ import annotations

import dataclasses
from dataclasses import dataclass
from pathlib import Path

import numpy as np

from strata.convert import gguf_checkpoint, mlx_checkpoint
from strata.convert.architectures import family_for
from strata.convert.common import (
    ExpertTensors,
    Family,
    check_unused,
    dense_sources,
    find_moe_block,
    reshape_to,
    same_up_to_unit_axes,
)
from strata.convert.hf_config import HFConfig
from strata.convert.safetensors_reader import Checkpoint
from strata.convert.tensor_plan import Derived, source_names
from strata.convert.tokenizer_files import TokenizerFiles, read_tokenizer_files
from strata.errors import ConfigError, FormatError
from strata.formats.expert_record import RecordLayout
from strata.formats.model_file import StoredBlocks
from strata.formats.quant_types import QuantType
from strata.model_config import ModelConfig, TensorNames, dense_tensor_shapes
from strata.option_names import option

__all__ = ["EXPERT_TYPES", "DEFAULT_EXPERT_TYPE", "Plan", "plan_checkpoint", "LazyTensor", "kept_dense",
           "check_finite", "check_stored_finite"]

EXPERT_TYPES = (QuantType.Q2_0, QuantType.Q4_0, QuantType.Q8_0, QuantType.F16, QuantType.F32)
DEFAULT_EXPERT_TYPE = QuantType.Q2_0  # design §4: routed experts are Q2_0


def _check_expert_type(cfg: ModelConfig, qtype: QuantType) -> None:
    if qtype not in EXPERT_TYPES:
        raise ConfigError(f"expert type {qtype.name.lower()} not supported; use one of "
                          f"{', '.join(q.name.lower() for q in EXPERT_TYPES)} (or no --experts: a llama.cpp "
                          "GGUF's or an MLX checkpoint's experts keep their own types)")
    try:
        RecordLayout(qtype, cfg.hidden_size, cfg.expert_ffn_size)
    except ValueError as e:
        raise ConfigError(f"cannot store experts as {qtype.name.lower()}: {str(e).removeprefix('record layout: ')} "
                          f"(hidden_size and the expert ffn size; use {option('experts', 'f16', python='expert_type')})") \
            from None


def _check_tokenizer(tok: TokenizerFiles, cfg: ModelConfig, where: Path) -> None:
    if tok.vocab_size > cfg.vocab_size:
        raise ConfigError(f"{where}: the tokenizer has {tok.vocab_size} tokens but the model's vocab_size is "
                          f"{cfg.vocab_size}")


class LazyTensor:
    """A dense tensor that is read from the checkpoint only when numpy asks for its values.

    `write_model` takes a dict of arrays; it checks shapes with `np.shape` (this `.shape`) and
    converts each tensor with `np.ascontiguousarray(x, dtype=float32)` (this `__array__`), then
    keeps only what it stores. Handing it these instead of arrays means the float32 copies are
    never all held at once: with --dense f16 or q8_0 the dense weights cost their stored size,
    not their float32 size (measured in docs/convert.md).

    Shapes: shape = dense_tensor_shapes(cfg)[name]; the checkpoint's [1, D] gate becomes [D]
    """

    def __init__(self, ckpt: Checkpoint, source: str | Derived, shape: tuple[int, ...], bar=None) -> None:
        self._ckpt, self._source, self._bar = ckpt, source, bar
        self.shape = tuple(shape)
        self.ndim = len(self.shape)

    def __array__(self, dtype=None, copy=None) -> np.ndarray:
        x = self._source.read(self._ckpt) if isinstance(self._source, Derived) else self._ckpt.read(self._source)
        x = reshape_to(x, self.shape, f"{self._ckpt.directory}: tensor {self._source}")
        check_finite(x, f"{self._ckpt.directory}: tensor {self._source}")
        if self._bar is not None:
            self._bar.update(1)
        return x if dtype is None else x.astype(dtype, copy=False)


def kept_dense(ckpt: gguf_checkpoint.GgufCheckpoint, name: str, src, shape: tuple[int, ...], bar):
    """A GGUF's dense matrix as it is stored (its ggml type and bytes), or None where it is not a
    plain matrix of its own (a router and 1-D tensors are F32 by the format's rule; a derived or
    reshaped tensor; an F32 one, which F32 writes as it is). Its values are checked finite."""
    if (not isinstance(src, str) or len(shape) != 2 or name.endswith("." + TensorNames.router)
            or ckpt.shape(src) != tuple(shape) or ckpt.ggml_type(src) == int(QuantType.F32)):
        return None

    def read() -> np.ndarray:
        check_finite(ckpt.read(src), f"{ckpt.directory}: tensor {src}")
        if bar is not None:
            bar.update(1)
        return ckpt.stored(src)[1]

    return StoredBlocks(ckpt.ggml_type(src), tuple(shape), read)


def check_finite(x: np.ndarray, where: str) -> None:
    """A FormatError naming `where` if x holds a NaN or an infinity (a model that cannot run)."""
    finite = np.isfinite(x)
    if not finite.all():
        bad = int(finite.size - np.count_nonzero(finite))
        raise FormatError(f"{where}: {bad} non-finite values (NaN or inf); the checkpoint is damaged")


def check_stored_finite(m, where: str) -> None:
    """check_finite for a matrix copied through in its stored type (a QuantMatrix), read from its
    planes: a block is finite when its scales are (QuantMatrix.non_finite)."""
    bad = m.non_finite()
    if bad:
        raise FormatError(f"{where}: {bad} non-finite values (NaN or inf, {m.qtype.name} blocks copied as stored); "
                          "the checkpoint is damaged")


@dataclass(frozen=True, eq=False)
class Plan:
    """Everything checked before writing: the model, where each tensor comes from, the tokenizer."""

    hf: HFConfig
    family: Family
    cfg: ModelConfig
    experts: ExpertTensors | mlx_checkpoint.MlxExpertTensors
    kept: QuantType | None  # the experts' own type, passed through bit for bit (an MLX checkpoint, a GGUF)
    sources: dict[str, str | Derived]  # strata dense name -> checkpoint tensor name (or tensors derived from)
    tokenizer: TokenizerFiles
    notes: tuple[str, ...] = ()  # what was deliberately left out (a vision tower, an MTP head)
    kept_layers: tuple | None = None  # a GGUF's (gate, up, down) types per layer where they mix, kept as stored


def plan_checkpoint(hf_dir: Path, ckpt: Checkpoint, hf: HFConfig, expert_type: QuantType | None) -> Plan:
    family = family_for(hf)
    hf = dataclasses.replace(hf, family=family.name)
    cfg = family.model_config(hf, ckpt)
    shapes = dense_tensor_shapes(cfg)
    skipped, notes = set(), ()
    if family.tensor_plan is not None:  # a prefix, derived tensors, skipped towers (convert.tensor_plan)
        tplan = family.tensor_plan(cfg, ckpt)
        experts, sources, skipped, notes = tplan.experts, tplan.sources, set(tplan.skipped), tplan.notes
        tplan.check(ckpt, shapes)
    else:
        moe = find_moe_block(family, ckpt)
        if isinstance(ckpt, mlx_checkpoint.MlxCheckpoint):  # mlx-lm's stacked (maybe quantized) experts
            experts = mlx_checkpoint.MlxExpertTensors(ckpt, cfg, moe)
        elif isinstance(ckpt, gguf_checkpoint.GgufCheckpoint):  # llama.cpp's stacked *_exps
            experts = gguf_checkpoint.GgufExpertTensors(ckpt, cfg)
        else:
            experts = ExpertTensors(ckpt, cfg, moe, family.expert_projections)
        sources = dense_sources(cfg, moe)
    kept = getattr(experts, "qtype", None) if expert_type is None else None
    kept_layers = getattr(experts, "layer_qtypes", None) if expert_type is None and kept is None else None
    if kept is None and kept_layers is None:
        _check_expert_type(cfg, DEFAULT_EXPERT_TYPE if expert_type is None else expert_type)
    for name, src in sources.items():  # names, shapes and dtypes now; values after the experts
        if isinstance(src, Derived):
            continue  # checked by tplan.check
        if not same_up_to_unit_axes(ckpt.shape(src), shapes[name]):
            raise FormatError(f"{hf_dir}: tensor {src}: shape {list(ckpt.shape(src))}, expected {list(shapes[name])}")
        ckpt.check_dtype(src)
    check_unused(ckpt, experts.consumed | source_names(sources) | skipped, cfg, family)
    tok = gguf_checkpoint.tokenizer_of(ckpt) if isinstance(ckpt, gguf_checkpoint.GgufCheckpoint) else \
        read_tokenizer_files(hf_dir)
    _check_tokenizer(tok, cfg, hf_dir)
    return Plan(hf, family, cfg, experts, kept, sources, tok, notes, kept_layers)
