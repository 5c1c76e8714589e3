"""`stream_generate` (one typed response per token) and `generate` (loops over it)."""

from __future__ import annotations

import time
from dataclasses import dataclass, field
from pathlib import Path
from typing import Iterator

from strata.config import Backend, Config, load_config
from strata.engines import Engine, ReferenceEngine
from strata.errors import ContextLimitError, StrataError
from strata.formats.quant_types import QuantType
from strata.loader import Model, load
from strata.cache.types import CacheStats
from strata.reference.sampling import SamplerConfig, log_softmax, sample
from strata.runtime.report import StreamReport
from strata.tokenizer import StreamingDetokenizer


@dataclass(frozen=True)
class GenerationResponse:
    """One generated token.

    text: the new text this token completes (may be "" while a multi-byte character is partial)
    token: its id; logprob: its log-probability under the model (before temperature)
    prompt_tokens / prompt_tps: prompt length and prefill speed (tokens/s)
    generation_tokens / generation_tps: tokens generated so far and decode speed (tokens/s)
    token_seconds: wall time of this token's step
    finish_reason: None while generating; "stop" (end-of-text), "length" (max_tokens) or
        "context" (the model's context is full) on the last response
    cache: the expert cache's cumulative counts (prompt and decode) when streaming, else None
    report: the stream report (SPEC §8), on the last response only, when streaming
    """

    text: str
    token: int
    logprob: float
    prompt_tokens: int
    prompt_tps: float
    generation_tokens: int
    generation_tps: float
    token_seconds: float
    finish_reason: str | None = None
    cache: CacheStats | None = field(default=None, repr=False)
    report: StreamReport | None = field(default=None, repr=False)


@dataclass(frozen=True)
class GenerationResult:
    """What `generate` returns: the text and the run's summary."""

    text: str
    tokens: list[int] = field(repr=False)
    prompt_tokens: int
    prompt_tps: float
    generation_tps: float
    finish_reason: str | None
    report: StreamReport | None = field(default=None, repr=False)  # when streaming (SPEC §8)

    def __str__(self) -> str:
        return self.text


def _open(model: Model | str | Path) -> Model:
    return model if isinstance(model, Model) else load(model)


def mlx_gpu_available() -> bool:
    """Whether MLX has a GPU here (Metal or CUDA)."""
    try:
        import mlx.core as mx
    except ImportError:
        return False
    cuda = getattr(mx, "cuda", None)
    return bool(mx.metal.is_available() or (cuda is not None and cuda.is_available()))


def resolve_backend(model: Model, config: Config) -> Backend:
    """`Backend.AUTO`: MLX where it has a GPU and its kernels read the model's experts (Q2_0),
    numpy otherwise. On a CPU-only machine MLX's CPU backend measured 0.66-0.90x of numpy's time
    (benchmarks/backends.py, docs/perf.md): a modest gain, so AUTO keeps the numpy path there,
    whose arithmetic is the reference's (bit-exact at λ = 0). An explicit backend is taken as asked."""
    if config.backend is not Backend.AUTO:
        return config.backend
    if mlx_gpu_available() and model.experts_file.header.qtype == QuantType.Q2_0:
        return Backend.MLX
    return Backend.NUMPY


def _engine_for(model: Model, config: Config) -> Engine:
    """The engine a run gets. Streaming whenever the config names an arena or the budget rule
    (SPEC §7) says the experts do not all fit; otherwise the all-resident reference, which is
    what streaming would compute anyway (with every expert resident MoCE's bonus lifts all
    logits alike, so routing is the model's own) without a reader pool or slot bookkeeping."""
    from strata.runtime.decode import arena_plan_for, open_streaming_engine

    if resolve_backend(model, config) is Backend.MLX:  # MlxArena + MlxCompute, or all-resident MlxEngine
        from strata.mlx_backend.engine import open_mlx_engine

        return open_mlx_engine(model, config, arena_plan_for(model, config))
    plan = arena_plan_for(model, config)
    if plan.streaming:
        return open_streaming_engine(model, config, plan=plan)
    return ReferenceEngine(model.resident_params())


def _streaming(engine: Engine):
    """The engine as a StreamingEngine (which has a report, cache totals and threads to close), or None."""
    from strata.runtime.decode import StreamingEngine

    return engine if isinstance(engine, StreamingEngine) else None


def stream_generate(
    model: Model | str | Path,
    prompt: str | list[int],
    *,
    max_tokens: int = 128,
    temperature: float = 0.0,
    top_p: float = 1.0,
    seed: int = 0,
    engine: Engine | None = None,
    config: Config | None = None,
) -> Iterator[GenerationResponse]:
    """Generate from `prompt`, yielding a GenerationResponse per token.

    `model` is a loaded Model or a path; `prompt` text (tokenized with the tokenizer's own special
    tokens, e.g. a Llama-style BOS) or token ids (used as given). Greedy when temperature is 0.
    `config` is the runtime configuration (default: `STRATA_*` variables over the defaults); it
    picks the engine unless `engine` is given (then the caller owns and closes it).
    """
    model = _open(model)
    sampler = SamplerConfig(temperature=temperature, top_p=top_p, seed=seed)
    if max_tokens < 0:
        raise StrataError(f"max_tokens must be >= 0, got {max_tokens}")
    tokens = model.tokenizer.encode(prompt, add_special_tokens=True) if isinstance(prompt, str) else list(prompt)
    if not tokens:
        raise StrataError("the prompt is empty")
    limit = model.cfg.max_context
    if len(tokens) >= limit:
        raise ContextLimitError(f"the prompt has {len(tokens)} tokens; the model's context is {limit}")
    owned = engine is None
    engine = engine or _engine_for(model, config if config is not None else load_config())
    try:
        yield from _run(model, engine, tokens, sampler, max_tokens, limit)
    finally:
        if owned and _streaming(engine):  # its reader threads and file descriptors
            engine.close()


def _run(model: Model, engine: Engine, tokens: list[int], sampler: SamplerConfig, max_tokens: int,
         limit: int) -> Iterator[GenerationResponse]:
    detok = StreamingDetokenizer(model.tokenizer)

    start = time.perf_counter()
    logits = engine.prefill(tokens)
    prompt_seconds = time.perf_counter() - start
    prompt_tps = len(tokens) / max(prompt_seconds, 1e-9)
    decode_start = time.perf_counter()
    for n in range(max_tokens):
        step_start = time.perf_counter()
        token = sample(logits, sampler, n)
        logprob = float(log_softmax(logits)[token])
        finish = None
        if token in model.tokenizer.eos_ids:
            finish = "stop"
        elif n + 1 == max_tokens:
            finish = "length"
        elif engine.length >= limit:
            finish = "context"
        if finish is None:
            logits = engine.decode(token)
        text = detok.add(token) if finish != "stop" else ""
        if finish is not None:
            text += detok.flush()
        now = time.perf_counter()
        streaming = _streaming(engine)
        yield GenerationResponse(
            text=text, token=token, logprob=logprob, prompt_tokens=len(tokens), prompt_tps=prompt_tps,
            generation_tokens=n + 1, generation_tps=(n + 1) / max(now - decode_start, 1e-9),
            token_seconds=now - step_start, finish_reason=finish,
            cache=streaming.streamer.totals if streaming else None,
            report=streaming.report() if streaming and finish is not None else None,
        )
        if finish is not None:
            return


def generate(model: Model | str | Path, prompt: str | list[int], **kwargs) -> GenerationResult:
    """Generate and return the whole text with the run's summary. Options as stream_generate."""
    pieces, tokens, last = [], [], None
    for last in stream_generate(model, prompt, **kwargs):
        pieces.append(last.text)
        tokens.append(last.token)
    return GenerationResult(
        text="".join(pieces), tokens=tokens,
        prompt_tokens=last.prompt_tokens if last else 0, prompt_tps=last.prompt_tps if last else 0.0,
        generation_tps=last.generation_tps if last else 0.0, finish_reason=last.finish_reason if last else None,
        report=last.report if last else None,
    )
