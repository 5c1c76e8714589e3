"""Open a strata model (`<name>.gguf` + `<name>.experts`) for generation."""

from __future__ import annotations

import dataclasses
import threading
from dataclasses import dataclass, field
from pathlib import Path

from strata.errors import FormatError, ParameterError
from strata.formats.dense_weights import DenseWeights
from strata.formats.expert_record import ExpertWeights
from strata.formats.expert_store import ExpertStore
from strata.formats.experts_file import ExpertsFile
from strata.formats.model_file import read_model, read_model_config
from strata.model_config import ModelConfig, dense_tensor_shapes
from strata.model_source import (
    EMBEDDED_NAME,
    check_model_source,
    is_llama_cpp_gguf,
    resolve_model_name,
    strata_model_in,
)
from strata.hub_cache import looks_like_hub_id
from strata.ple_store import open_ngram_store
from strata.reference.model import ModelParams
from strata.tensor_names import drafter_only
from strata.tokenizer import Tokenizer

EOS_TOKEN_KEY = "tokenizer.huggingface.eos_token"  # written by strata convert (strata/chat_template.py)


class ResidentExperts:
    """Every routed expert read into memory once (the all-resident path; no streaming), by
    (MoE layer index, expert) as the `.experts` file holds them."""

    def __init__(self, experts_file: ExpertsFile) -> None:
        h = experts_file.header
        self._experts = {(l, e): experts_file.expert(l, e) for l in range(h.n_layers) for e in range(h.n_experts)}

    def expert(self, layer: int, expert: int) -> ExpertWeights:
        return self._experts[(layer, expert)]


@dataclass(eq=False)
class Model:
    """A loaded model: config, dense weights, tokenizer, and its experts file.

    `session` is the engine the model keeps across `generate` calls (strata.engines.
    session_engine opens and replaces it, holding `session_lock`; `close()` closes it and the
    experts file). Threads and iterators may share a Model: strata/sharing.py says how."""

    cfg: ModelConfig
    dense: DenseWeights  # as the file stores them; dense[name] widens to float32 (formats/dense_weights.py)
    tokenizer: Tokenizer
    experts_file: ExpertStore  # an ExpertsFile, or a PieceStore: a llama.cpp GGUF's experts read in place
    model_path: Path
    session: object = field(default=None, repr=False)
    ngrams_file: object = None  # a PLE model's row store (NgramRowsFile, strata/ple_store.py); None: none
    session_lock: threading.Lock = field(default_factory=threading.Lock, repr=False)
    native_context: int | None = None  # the file's max_context where load(max_context=) lowered cfg's; else None

    def close(self) -> None:
        if self.session is not None:
            self.session.close()
            self.session = None
        self.experts_file.close()
        if self.ngrams_file is not None:
            self.ngrams_file.close()

    def __enter__(self) -> "Model":
        return self

    def __exit__(self, *exc) -> None:
        self.close()

    def resident_params(self) -> ModelParams:
        """Parameters with every expert resident in memory (the reference path). A PLE model's
        rows come from its row store, if it has one, a read per page (never the tables whole)."""
        return ModelParams(self.cfg, self.dense, ResidentExperts(self.experts_file), rows=self.ngrams_file)


def experts_path_for(model_path: Path) -> Path:
    return model_path.with_suffix(".experts")


# strata.load("default") and strata.load(): the embedded model (EMBEDDED_NAME, strata/model_source.py)


def load(model: str | Path | None = None, *, experts: str | Path | None = None,
         allow_foreign_experts: bool = False, layers=None, ngrams: str | Path | None = None,
         max_context: int | None = None) -> Model:
    """Load `model` (a `.gguf` path, or a path without the suffix) and its `.experts` file.

    The experts file defaults to the model's name with the `.experts` suffix. No model, or the
    name "default" where no such file is, loads the embedded default model (docs/model-card.md).
    A checkpoint directory (config.json + safetensors) loads as tier 2: a `strata.tier2.model.
    Tier2Model`, mlx-lm's model file with strata's streamed experts (needs the `mlx-lm` extra;
    docs/tier2.md). A llama.cpp GGUF (or the first part of a split one) runs as it is, nothing
    converted or written: its dense weights read as its conversion would hold them, its experts
    read in place from it (strata/convert/gguf_in_place.py; docs/convert.md). Another directory
    or a checkpoint's weights file is refused in one line naming `strata convert`
    (strata/model_source.py). A model written
    with an expert set records that set's identity; loading it with another set (another model's
    experts of the same shape, or a conversion interrupted between its two renames) is refused
    unless `allow_foreign_experts=True`, which is how a deliberately swapped set (for example a
    re-quantized one) is run. Model files without an identity (older ones) skip the check.
    `layers` (a `model_config.LayerRange`, a pipeline stage's): load only the dense tensors it
    computes with. A PLE model whose tables are in a row store (`cfg.qwen4.ple_row_store`) opens it too:
    `ngrams`, default `<name>.ngrams`, refused in one line when missing or not the one the model
    was written with (strata/ple_store.py). `max_context`: hold the model to this many positions
    (prompt and generated) instead of the file's own context: engines size their KV caches by it
    and generation refuses a longer prompt and stops there (finish_reason "context"); at most the
    file's context. A hub id (`Qwen/Qwen3-30B-A3B`) is looked up in the local Hugging Face cache
    (strata/hub_cache.py).
    """
    if max_context is not None:
        from strata.api_args import check_count

        check_count("max_context", max_context, minimum=2)
    if model is None or (str(model) == EMBEDDED_NAME and not Path(model).exists()
                         and not Path(EMBEDDED_NAME + ".gguf").exists()):
        from strata.default_model import default_model_path

        model = default_model_path()
    if not isinstance(model, (str, Path)):
        raise FormatError(f"model: expected a path (str or Path), got {type(model).__name__}")
    if looks_like_hub_id(model):  # a hub id: its local-cache snapshot, a checkpoint (tier 2) or a strata model
        from strata.tier2 import is_tier2_source

        snapshot = resolve_model_name(model)
        model = snapshot if is_tier2_source(snapshot) else strata_model_in(snapshot, str(model))
    model_path = Path(model)
    if not model_path.exists() and model_path.suffix != ".gguf":
        model_path = model_path.with_name(model_path.name + ".gguf")
    if not model_path.exists():
        raise FormatError(f"{model}: no such model file")
    from strata.tier2 import is_tier2_source

    if is_tier2_source(model_path):  # a checkpoint directory: mlx-lm's model file, experts streamed
        from strata.tier2.model import load_tier2

        if max_context is not None:
            from strata.option_names import option

            raise ParameterError(f"{model}: {option('ctx', python='max_context')} is not available on tier 2 (mlx-lm's "
                                 "model file sizes its own cache); leave it out, or convert a native family with "
                                 "`strata convert`")

        return load_tier2(model_path)
    check_model_source(model_path)
    if is_llama_cpp_gguf(model_path):  # run as it is: dense weights read from it, experts streamed in place
        return _load_in_place(model_path, experts=experts, layers=layers, max_context=max_context)
    experts_path = Path(experts) if experts else experts_path_for(model_path)
    if not experts_path.exists():
        raise FormatError(f"{experts_path}: no such experts file (expected beside {model_path.name})")
    file_cfg = read_model_config(model_path)
    names = layers.dense_names(file_cfg) if layers is not None else dense_tensor_shapes(file_cfg)
    # a drafter's MTP / nextn layer stays in the file until drafting asks for it (strata.speculative.mtp)
    mf = read_model(model_path, names=frozenset(n for n in names if not drafter_only(n)))
    cfg, native = _context(mf.cfg, max_context)
    xf = ExpertsFile.open(experts_path)
    try:
        _check_pair(mf, xf, model_path, experts_path, allow_foreign_experts)
        store = open_ngram_store(mf.cfg, model_path, mf.ngrams_identity, path=ngrams)
    except BaseException:
        xf.close()
        raise
    eos = mf.metadata.get(EOS_TOKEN_KEY)
    tok = Tokenizer.from_json(mf.tokenizer_json, chat_template=mf.chat_template, source=str(model_path),
                              eos_tokens=(eos,) if isinstance(eos, str) else ())
    return Model(cfg=cfg, dense=mf.dense, tokenizer=tok, experts_file=xf, model_path=model_path,
                 ngrams_file=store, native_context=native)


def _context(cfg: ModelConfig, max_context: int | None) -> tuple[ModelConfig, int | None]:
    """cfg held to `max_context` positions, and the file's own context where that lowered it."""
    if max_context is not None and max_context < cfg.max_context:
        return dataclasses.replace(cfg, max_context=max_context), cfg.max_context
    if max_context is not None and max_context > cfg.max_context:
        raise ParameterError(f"max_context: {max_context} is more than the model's context of {cfg.max_context}")
    return cfg, None


def _load_in_place(model_path: Path, *, experts, layers, max_context: int | None) -> Model:
    """A llama.cpp GGUF as it is (strata/convert/gguf_in_place.py): the Model a load of its
    conversion gives, its experts a PieceStore over the user's file, a qwen4exp file's n-gram table
    its row store (a GgufNgramTable over the same file)."""
    from strata.convert.gguf_in_place import open_in_place

    if experts is not None:
        raise ParameterError(f"{model_path}: a llama.cpp GGUF holds its own experts (read in place); experts= "
                             "names a strata model's .experts file")
    if layers is not None:
        raise ParameterError(f"{model_path}: pipeline stages run converted models only; run "
                             f"`strata convert {model_path} OUT` first")
    got = open_in_place(model_path)
    cfg, native = _context(got.cfg, max_context)
    eos = got.tokenizer.special_tokens.get("eos_token")
    tok = Tokenizer.from_json(got.tokenizer.tokenizer_json, chat_template=got.tokenizer.chat_template,
                              source=str(model_path), eos_tokens=(eos,) if isinstance(eos, str) else ())
    return Model(cfg=cfg, dense=got.dense, tokenizer=tok, experts_file=got.experts, model_path=model_path,
                 ngrams_file=got.ngrams, native_context=native)


def _check_pair(mf, xf: ExpertsFile, model_path: Path, experts_path: Path, allow_foreign: bool) -> None:
    h, cfg = xf.header, mf.cfg
    found = (h.n_layers, h.n_experts, h.hidden, h.expert_ffn)
    wanted = (cfg.n_moe_layers, cfg.n_experts, cfg.hidden_size, cfg.expert_ffn_size)
    if found != wanted:
        raise FormatError(
            f"{experts_path}: holds (MoE layers, experts, hidden, ffn) = {found}, but {model_path.name} wants {wanted}"
        )
    if h.biases != cfg.gpt_oss.expert_bias:
        has = lambda b: "experts with biases" if b else "experts without biases"  # noqa: E731
        raise FormatError(f"{experts_path}: holds {has(h.biases)}, but {model_path.name} wants "
                          f"{has(cfg.gpt_oss.expert_bias)}")
    if mf.experts_identity is not None and mf.experts_identity != xf.identity and not allow_foreign:
        raise FormatError(
            f"{experts_path}: not the expert set {model_path.name} was written with (identity {xf.identity}, the "
            f"model records {mf.experts_identity}); to run a swapped set on purpose, load it with "
            "strata.load(..., experts=PATH, allow_foreign_experts=True)"
        )
