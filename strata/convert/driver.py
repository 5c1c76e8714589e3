"""`convert(hf_dir, out)`: a Hugging Face MoE checkpoint -> `out.gguf` + `out.experts`, streamed.

Order of work, and why:
1. Everything is checked before a byte is written (strata/convert/checkpoint_plan.py): config (architecture, features), every
   shard's header (missing shard, truncation), every tensor's name and shape, the tokenizer,
   and that the expert sizes fit the requested quant type. A bad checkpoint fails in seconds.
2. Routed experts (the bulk: ~95% of a large MoE) are written first, one (layer, expert) at a
   time through `write_experts`'s callback: read gate/up/down from the shards, quantize,
   pack, forget. Nothing else is held while they stream.
3. Dense tensors are then read one at a time, as `write_model` asks for each (`LazyTensor`),
   so only their stored form is held (float32, float16 or Q8_0) until the GGUF is written.

Peak memory is therefore about max(one expert in float32 + its quantized copy, the dense
weights in their stored type + the largest tensor in float32 and in its checkpoint dtype)
plus the interpreter; docs/convert.md gives the measured numbers.

Both files are written under `.partial` names and put in place only at the very end, in an
order that a crash at any point leaves recoverable (`_install`): the old `.gguf` is removed
first, then the experts are renamed, then the `.gguf`. A `.gguf` under the final name is never
beside experts it was not written with; and the `.gguf` records the identity of its expert set
(`strata.experts_identity`), so a mismatched pair made any other way is refused at load.
Every weight is checked finite as it is read (a NaN or inf names its checkpoint tensor).
"""

from __future__ import annotations

import dataclasses
import os
import sys
import time
from dataclasses import dataclass
from pathlib import Path

from strata.chat_template import SPECIAL_TOKEN_KEY_PREFIX
from strata.convert import fp8_checkpoint, gguf_checkpoint, mlx_checkpoint
from strata.convert.checkpoint_plan import (
    DEFAULT_EXPERT_TYPE,
    LazyTensor,
    check_finite,
    check_stored_finite,
    kept_dense,
    plan_checkpoint,
)
from strata.convert.hf_config import HFConfig
from strata.convert.safetensors_reader import Checkpoint
from strata.errors import ConfigError
from strata.formats.expert_record import ExpertWeights
from strata.formats.experts_file import ExpertsFile, write_experts
from strata.formats.model_file import DENSE_TYPES, write_model
from strata.formats.quant_types import QuantType
from strata.model_config import ModelConfig, dense_tensor_shapes
from strata.ple_store import NGRAMS_SUFFIX
from strata.reference.quants import quantize

DEFAULT_DENSE_TYPE = QuantType.F32
DEFAULT_NGRAM_TYPE = QuantType.F16  # a PLE row store's rows: a bfloat16 table's values in its size
PARTIAL_SUFFIX = ".partial"
SOURCE_KEY = "convert.source_model_type"  # extra GGUF metadata: where the model came from


@dataclass(frozen=True)
class ConvertResult:
    model_path: Path
    experts_path: Path
    cfg: ModelConfig
    family: str
    expert_type: QuantType | None  # None: a GGUF's experts kept as stored, types per layer (expert_layer_types)
    dense_type: QuantType  # of the matrices written; a GGUF's own are kept as stored where dense_kept
    seconds: float
    notes: tuple[str, ...] = ()  # what the conversion deliberately left out, for the user
    requant_kld: object = None  # RequantKld of a GGUF's or an FP8 checkpoint's requantized experts, else None
    ngrams_path: Path | None = None  # a PLE model's row store (`out.ngrams`), else None
    expert_layer_types: tuple | None = None  # (gate, up, down) types per MoE layer where they mix
    dense_kept: bool = False  # a GGUF's dense matrices written in their stored types

    @property
    def dense_described(self) -> str:
        return "as stored" if self.dense_kept else self.dense_type.name

    @property
    def experts_described(self) -> str:
        """'Q2_0', or 'Q4_K, Q5_1, IQ4_NL as stored (per layer and projection)'."""
        if self.expert_layer_types is None:
            return self.expert_type.name
        names = sorted({q for t in self.expert_layer_types for q in t}, key=int)
        return ", ".join(q.name for q in names) + " as stored (per layer and projection)"


def output_paths(out: str | os.PathLike) -> tuple[Path, Path]:
    """`out` (with or without `.gguf`) -> (out.gguf, out.experts)."""
    out = Path(out)
    if out.suffix == ".gguf":
        out = out.with_suffix("")
    return out.with_name(out.name + ".gguf"), out.with_name(out.name + ".experts")


def _install(model_partial: Path, experts_partial: Path, model_path: Path, experts_path: Path,
             ngrams: tuple[Path, Path] | None = None) -> None:
    """Put the pair in place (and a PLE model's row store: ngrams = (partial, final)). A crash
    after any step leaves either the old pair, or no `.gguf` at all (run the conversion again),
    never an old `.gguf` beside new experts."""
    try:
        model_path.unlink()  # 1. no model under the final name while its experts change
    except FileNotFoundError:
        pass
    os.replace(experts_partial, experts_path)  # 2. the new experts
    if ngrams is not None:
        os.replace(*ngrams)  # 2b. the new row store (the model records its identity too)
    os.replace(model_partial, model_path)  # 3. the new model, written with these experts' identity
    try:  # the renames survive a power loss only once the directory is on disk
        fd = os.open(model_path.parent, os.O_RDONLY)
        try:
            os.fsync(fd)
        finally:
            os.close(fd)
    except OSError:  # pragma: no cover - some filesystems refuse fsync on a directory
        pass


def _bar(total: int, desc: str, unit: str, enabled: bool):
    from tqdm import tqdm

    return tqdm(total=total, desc=desc, unit=unit, disable=not enabled, file=sys.stderr, dynamic_ncols=True)


def _unlink(*paths: Path) -> None:
    for p in paths:
        for q in (p, Path(str(p) + ".tmp")):  # the writers' own temporary names
            try:
                q.unlink()
            except FileNotFoundError:
                pass


def convert(
    hf_dir: str | os.PathLike,
    out: str | os.PathLike,
    *,
    expert_type: QuantType | None = None,
    dense_type: QuantType | None = None,
    progress: bool = False,
    ngram_type: QuantType = DEFAULT_NGRAM_TYPE,
) -> ConvertResult:
    """Convert the checkpoint in `hf_dir` to `out.gguf` + `out.experts` (see the module doc).

    expert_type None: an MLX-quantized checkpoint's or a llama.cpp GGUF's experts keep their own
    types (bit for bit; a GGUF's may differ per layer and projection), a float checkpoint's become
    DEFAULT_EXPERT_TYPE; a type given is quantized to (from the dequantized values, for an MLX
    checkpoint or a GGUF). ngram_type: the row type of a PLE model's row
    store (`out.ngrams`: F32, F16, Q8_0 or Q4_0; docs/formats.md §7)."""
    start = time.perf_counter()
    hf_dir = Path(hf_dir)
    from_gguf = gguf_checkpoint.is_gguf(hf_dir)
    if not hf_dir.is_dir() and not from_gguf:
        raise ConfigError(f"{hf_dir}: not a directory (expected a Hugging Face checkpoint directory)")
    keep_dense = from_gguf and dense_type is None
    expert_type = None if expert_type is None else QuantType(expert_type)
    dense_type = DEFAULT_DENSE_TYPE if dense_type is None else QuantType(dense_type)
    ngram_type = QuantType(ngram_type)
    if dense_type not in DENSE_TYPES:
        raise ConfigError(f"dense type {dense_type.name.lower()} not supported; use one of "
                          f"{', '.join(q.name.lower() for q in DENSE_TYPES)}")
    if from_gguf:  # a llama.cpp GGUF: read as the checkpoint it was converted from
        source = gguf_checkpoint.GgufCheckpoint(hf_dir)
        hf = gguf_checkpoint.hf_config_of(source)
    else:
        hf = HFConfig.read(hf_dir)
        mlx_quant, fp8_quant = mlx_checkpoint.quantization_of(hf), fp8_checkpoint.quantization_of(hf)
        if mlx_quant is not None:  # mlx-lm's format: read as the float model it stands for
            hf = mlx_checkpoint.without_quantization(hf)
            source = mlx_checkpoint.MlxCheckpoint(hf_dir, mlx_quant)
        elif fp8_quant is not None:  # block-wise FP8 (DeepSeek's layout): read dequantized, in float32
            hf = fp8_checkpoint.without_quantization(hf)
            source = fp8_checkpoint.Fp8Checkpoint(hf_dir, fp8_quant)
        else:
            source = Checkpoint(hf_dir)
    with source as ckpt:
        plan = plan_checkpoint(hf_dir, ckpt, hf, expert_type)
        # `is None`, not `or`: QuantType.F32 is 0, and `or` turned it into the default q2_0
        kept = plan.kept is not None or plan.kept_layers is not None
        expert_type = plan.kept if kept else (DEFAULT_EXPERT_TYPE if expert_type is None else expert_type)
        cfg, shapes = plan.cfg, dense_tensor_shapes(plan.cfg)
        model_path, experts_path = output_paths(out)
        model_partial = Path(str(model_path) + PARTIAL_SUFFIX)
        experts_partial = Path(str(experts_path) + PARTIAL_SUFFIX)
        ngrams_path = model_path.with_suffix(NGRAMS_SUFFIX) if cfg.qwen4.ple_row_store else None
        ngrams_partial = Path(str(ngrams_path) + PARTIAL_SUFFIX) if ngrams_path else None
        partials = (model_partial, experts_partial) + ((ngrams_partial,) if ngrams_partial else ())
        model_path.parent.mkdir(parents=True, exist_ok=True)
        renamed = False
        try:
            described = expert_type.name if expert_type is not None else "as stored"
            with _bar(cfg.n_moe_layers * cfg.n_experts, f"{experts_path.name} ({described})", "expert",
                      progress) as bar:
                def get_expert(layer: int, e: int) -> ExpertWeights:  # layer: the MoE index
                    if kept:  # copied through as stored: checked as the float path is
                        w = plan.experts.read_quantized(layer, e)
                        for name, m in (("gate", w.gate), ("up", w.up), ("down", w.down)):
                            check_stored_finite(m, f"{hf_dir}: layer {cfg.moe_layers[layer]} expert {e} {name} "
                                                   "projection")
                    else:
                        gate, up, down = plan.experts.read(layer, e)
                        for name, x in (("gate", gate), ("up", up), ("down", down)):
                            check_finite(x, f"{hf_dir}: layer {cfg.moe_layers[layer]} expert {e} {name} projection")
                        w = ExpertWeights(quantize(expert_type, gate), quantize(expert_type, up),
                                          quantize(expert_type, down))
                    if cfg.gpt_oss.expert_bias:  # gpt-oss: the biases travel in the record, in float32
                        w = dataclasses.replace(w, biases=plan.experts.read_biases(layer, e))
                        for name in ("gate", "up", "down"):
                            check_finite(getattr(w.biases, name), f"{hf_dir}: layer {cfg.moe_layers[layer]} "
                                                                  f"expert {e} {name} bias")
                    bar.update(1)
                    return w

                write_experts(experts_partial, qtype=expert_type if expert_type is not None else plan.kept_layers[0][0],
                              n_layers=cfg.n_moe_layers, n_experts=cfg.n_experts,
                              hidden=cfg.hidden_size, expert_ffn=cfg.expert_ffn_size, get_expert=get_expert,
                              biases=cfg.gpt_oss.expert_bias, layer_qtypes=plan.kept_layers)
            with ExpertsFile.open(experts_partial) as xf:
                identity = xf.identity
            ngrams_identity = None
            if ngrams_path is not None:  # the n-gram tables, streamed into their own file (Qwen4-Exp)
                write = plan.family.row_store
                with write(cfg, ckpt, ngrams_partial, qtype=ngram_type, progress=progress) as store:
                    ngrams_identity = store.identity
            extra = {SOURCE_KEY: plan.hf.model_type}
            extra.update({SPECIAL_TOKEN_KEY_PREFIX + k: v for k, v in plan.tokenizer.special_tokens.items()})
            what = "as stored" if keep_dense else dense_type.name
            with _bar(len(plan.sources), f"{model_path.name} (dense {what})", "tensor", progress) as bar:
                dense = {name: LazyTensor(ckpt, src, shapes[name], bar) for name, src in plan.sources.items()}
                if keep_dense:
                    for name, src in plan.sources.items():
                        kept_tensor = kept_dense(ckpt, name, src, shapes[name], bar)
                        dense[name] = dense[name] if kept_tensor is None else kept_tensor
                write_model(model_partial, cfg, dense, tokenizer_json=plan.tokenizer.tokenizer_json,
                            chat_template=plan.tokenizer.chat_template, dense_type=dense_type, extra_metadata=extra,
                            experts_identity=identity, ngrams_identity=ngrams_identity)
            renamed = True  # from here on a failure leaves no pair under the final names
            _install(model_partial, experts_partial, model_path, experts_path,
                     None if ngrams_path is None else (ngrams_partial, ngrams_path))
        except BaseException:
            finals = [experts_path, model_path] + ([ngrams_path] if ngrams_path else [])
            _unlink(*partials, *(finals if renamed else []))
            raise
        kld = None
        if from_gguf and not kept:  # requantized: what that step cost, against gguf's dequantization
            from strata.convert.requant_report import requantization_kld

            kld = requantization_kld(model_path, plan.experts, plan.experts.source_types, "the GGUF's")
        elif isinstance(ckpt, fp8_checkpoint.Fp8Checkpoint) and expert_type is not QuantType.F32:
            from strata.convert.requant_report import requantization_kld  # FP8 values * float32 scales: F32 is exact

            kld = requantization_kld(model_path, plan.experts, (fp8_checkpoint.FP8_DTYPE,), "the FP8 checkpoint's")
    return ConvertResult(model_path, experts_path, cfg, plan.family.name, expert_type, dense_type,
                         time.perf_counter() - start, plan.notes, kld, ngrams_path, plan.kept_layers, keep_dense)
