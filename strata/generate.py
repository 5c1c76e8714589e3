"""`stream_generate` (one typed response per token) and `generate` (loops over it)."""

from __future__ import annotations

import time
from dataclasses import dataclass, field
from pathlib import Path
from typing import Iterator, Mapping, Protocol, Sequence

import numpy as np

from strata.api_args import as_config, check_count, check_prompt, check_token_ids, sampler_from
from strata.cache.types import CacheStats
from strata.config import Config, load_config
from strata.engines import Engine, common_prefix, session_engine
from strata.device_greedy import PipelinedGreedySteps, non_finite_logits, takes_pipeline
from strata.errors import ContextLimitError, ParameterError, StrataError
from strata.loader import Model, load
from strata.tier2.model import Tier2Model
from strata.reference.sampling import SamplerConfig, log_softmax, sample
from strata.runtime.report import StreamReport
from strata.session import SessionEngine
from strata.sharing import Call
from strata.stop_strings import StopMatcher
from strata.speculative import Drafter, Gate, SpeculationReport, SpeculativeSteps, drafter_for
from strata.tokenizer import StreamingDetokenizer


@dataclass(frozen=True)
class GenerationResponse:
    """One generated token.

    text: the new text this token completes (may be "" while a multi-byte character is partial)
    token: its id; logprob: its log-probability under the model (before temperature)
    prompt_tokens / prompt_tps: prompt length and prefill speed (tokens/s)
    generation_tokens / generation_tps: tokens generated so far and decode speed (tokens/s)
    token_seconds: wall time of this token's step
    finish_reason: None while generating; "stop" (end-of-text, or a stop string: then
        `stop_string` names it), "length" (max_tokens) or "context" (the model's context is
        full) on the last response
    prompt_reused: prompt positions the session already held (not processed again)
    cache: the expert cache's cumulative counts (prompt and decode) when streaming, else None
    report: this call's stream report (design §8), on the last response only, when streaming
    speculation: this call's speculation report, on the last response only, when speculating
    stop_string: the stop string that ended the generation (its text is not shown), else None
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
    prompt_reused: int = 0
    cache: CacheStats | None = field(default=None, repr=False)
    report: StreamReport | None = field(default=None, repr=False)
    speculation: SpeculationReport | None = field(default=None, repr=False)
    stop_string: str | None = None


@dataclass(frozen=True)
class GenerationResult:
    """What `generate` returns: the text and the run's summary."""

    text: str
    tokens: list[int] = field(repr=False)
    prompt_tokens: int
    prompt_tps: float
    generation_tps: float
    finish_reason: str | None
    prompt_reused: int = 0
    report: StreamReport | None = field(default=None, repr=False)  # when streaming (design §8)
    speculation: SpeculationReport | None = field(default=None, repr=False)  # when speculating
    stop_string: str | None = None  # the stop string that ended it (not in `text`)

    def __str__(self) -> str:
        return self.text


def _is_engine(obj) -> bool:
    return isinstance(obj, SessionEngine)


def stream_generate(
    model: Model | Engine | str | Path,
    prompt: str | list[int],
    *,
    max_tokens: int = 128,
    temperature: float = 0.0,
    top_p: float = 1.0,
    seed: int = 0,
    engine: Engine | None = None,
    config: Config | Mapping[str, object] | None = None,
    top_k: int = 0,
    min_p: float = 0.0,
    repeat_penalty: float = 1.0,
    drafter: Drafter | None = None,
    frequency_penalty: float = 0.0,
    presence_penalty: float = 0.0,
    stop: str | Sequence[str] = (),
) -> Iterator[GenerationResponse]:
    """Generate from `prompt`, yielding a GenerationResponse per token.

    `model`: a loaded Model (it keeps its engine across calls, see strata.engines.session_engine:
    experts are read once, and the longest token prefix the session already holds is reused), an
    engine from `strata.open_engine` (the caller owns and closes it; its session is reused the
    same way), or a path (loaded, run and closed). `prompt`: text (tokenized with the
    tokenizer's own special tokens, e.g. a Llama-style BOS) or token ids (used as given). Greedy
    when temperature is 0; top_k (0: off), min_p (0: off), top_p (1: off) filter a sampled step
    and repeat_penalty (1: off) lowers the tokens of the last 64; frequency_penalty and
    presence_penalty (0: off, in [-2, 2]) are OpenAI's, over the tokens this call generated
    (strata.reference.sampling). `stop`: a string or strings that end the generation where one
    starts (finish_reason "stop", `stop_string` naming it); no text from there on is yielded, and
    text that may be the start of one is held back until it is not.
    `config`: the runtime configuration (default: `STRATA_*` variables over the defaults) of the
    engine a Model or path gets, or a mapping of its fields (read as `Config(**mapping)`); an
    engine keeps its own. Bad arguments raise ParameterError naming the parameter, before any work.
    `drafter`: speculate with it (strata.speculative); default: the one the engine's config names
    (`suffix_draft`, `mtp_draft`), none when both are off. Greedy output is the same with or without; sampled
    output has the same distribution (not the same draws).
    Threads and interleaved iterators may share one model or engine: each call gives what it
    gives alone (strata/sharing.py). An engine that cannot keep a suspended call's state apart
    (streaming, MLX) runs one call at a time: a call from another thread waits; one started on
    the thread holding an unfinished iterator raises SessionBusyError naming the fix.
    """
    prompt = check_prompt(prompt)
    max_tokens = check_count("max_tokens", max_tokens)
    sampler = sampler_from(temperature=temperature, top_p=top_p, seed=seed, top_k=top_k, min_p=min_p,
                           repeat_penalty=repeat_penalty, frequency_penalty=frequency_penalty,
                           presence_penalty=presence_penalty)
    stops = check_stop_strings(stop)
    config = as_config(config)
    if engine is not None:  # the older spelling: stream_generate(model, prompt, engine=...)
        model = engine
    owned = None
    if _is_engine(model):
        engine = model
        if engine.model is None:
            raise StrataError("this engine was built from bare parameters; generate needs one from strata.open_engine")
        model = engine.model
    elif isinstance(model, (Model, Tier2Model)):
        engine = None
    else:
        model = owned = load(model)
    tokens = model.tokenizer.encode(prompt, add_special_tokens=True) if isinstance(prompt, str) else list(prompt)
    if not tokens:
        raise StrataError("the prompt is empty")
    check_token_ids(tokens, model.cfg.vocab_size)
    limit = model.cfg.max_context
    if len(tokens) >= limit:
        raise ContextLimitError(f"the prompt has {len(tokens)} tokens; the model's context is {limit}"
                                + (f" (limited to {limit} of {model.native_context} at load: max_context)"
                                   if model.native_context is not None else ""))
    try:
        if engine is None:
            engine = session_engine(model, config if config is not None else load_config())
        yield from _run(model, engine, tokens, sampler, max_tokens, limit, drafter, stops)
    finally:
        if owned is not None:
            owned.close()  # its engine's reader threads and file descriptors too


def _reuse(engine: Engine, tokens: list[int]) -> int:
    """Trim the session to the longest prefix it shares with `tokens` that it can restore,
    keeping at least one prompt position to prefill (its logits start the generation)."""
    keep = engine.kept_position(min(common_prefix(engine.tokens, tokens), len(tokens) - 1))
    engine.trim(keep)
    return keep


class TokenSource(Protocol):
    """Where the loop's tokens come from: `next(n)` gives token n and its log-probability;
    `advance(token, n, room)` says the generation goes on (at most `room` more tokens);
    `finish(n)` that token n was the last; `report()` what the source has to say, or None."""

    def next(self, n: int) -> tuple[int, float]: ...

    def advance(self, token: int, n: int, room: int) -> None: ...

    def finish(self, n: int) -> None: ...

    def report(self) -> SpeculationReport | None: ...


class _PlainSteps:
    """The token source of plain decoding: sample token n from the logits, decode it."""

    def __init__(self, engine: Engine, logits, sampler: SamplerConfig, history: list[int]) -> None:
        self.engine, self.logits, self.sampler = engine, logits, sampler
        self.history = history  # what the repetition penalty sees: prompt and generated
        self.prompt_length = len(history)  # the frequency and presence penalties count only what follows

    def next(self, n: int) -> tuple[int, float]:
        check_finite_logits(self.logits, self.engine.length)
        token = sample(self.logits, self.sampler, n, self.history, self.history[self.prompt_length:])
        self.history.append(token)
        return token, float(log_softmax(self.logits)[token])

    def advance(self, token: int, n: int, room: int) -> None:
        self.logits = self.engine.decode(token)

    def finish(self, n: int) -> None:
        pass

    def report(self) -> None:
        return None


def check_finite_logits(logits: np.ndarray, length: int) -> None:
    """One pass (max propagates NaN): never sample from garbage."""
    if not np.isfinite(logits.max()):
        raise non_finite_logits(length)


def _steps(engine: Engine, logits, sampler: SamplerConfig, drafter: Drafter | None, limit: int,
           history: list[int]) -> TokenSource:
    """Plain decoding (greedy: on the engine's device where it offers that), or speculative
    windows where a drafter is given or the config names one."""
    drafter = drafter if drafter is not None else drafter_for(engine.config, engine.model)
    if drafter is None:
        pipe = engine.greedy_pipeline() if takes_pipeline(sampler) else None
        if pipe is not None:
            return PipelinedGreedySteps(engine, pipe, logits, sampler, limit)
        return _PlainSteps(engine, logits, sampler, history)
    if sampler.penalized:  # the history they read would have to follow every draft and rollback
        name = next(n for n, off in (("repeat_penalty", 1.0), ("frequency_penalty", 0.0), ("presence_penalty", 0.0))
                    if getattr(sampler, n) != off)
        raise ParameterError(f"{name}: not supported with speculation (suffix_draft / drafter) yet; "
                             "use one or the other")
    gate = Gate(enabled=engine.config.spec_gate if engine.config is not None else True)
    return SpeculativeSteps(engine, logits, sampler, drafter, gate=gate, limit=limit)


def check_stop_strings(stop) -> tuple[str, ...]:
    """`stop`: one non-empty string or a sequence of them."""
    items = (stop,) if isinstance(stop, str) else stop
    if not isinstance(items, (list, tuple)) or not all(isinstance(s, str) and s for s in items):
        raise ParameterError(f"stop: expected a non-empty string or a list of them, got {stop!r}")
    return tuple(items)


def _run(model: Model, engine: Engine, tokens: list[int], sampler: SamplerConfig, max_tokens: int,
         limit: int, drafter: Drafter | None = None, stops: tuple[str, ...] = ()) -> Iterator[GenerationResponse]:
    """The generation loop. Each step (the prompt, each token) holds the engine with this call's
    own positions (strata.sharing: other calls on the same session wait, or are kept apart by
    snapshots); the engine is free while the caller holds a response."""
    call, shared = Call(), engine.sharing
    try:
        yield from _steps_of(model, engine, tokens, sampler, max_tokens, limit, drafter, stops, call, shared)
    finally:
        shared.finish(call)


def _steps_of(model: Model, engine: Engine, tokens: list[int], sampler: SamplerConfig, max_tokens: int, limit: int,
              drafter: Drafter | None, stops: tuple[str, ...], call: Call, shared) -> Iterator[GenerationResponse]:
    detok = StreamingDetokenizer(model.tokenizer)
    stopper = StopMatcher(stops)
    with shared.step(call):
        since = engine.ledger()  # None unless the engine streams (then: this call's report)
        start = time.perf_counter()
        reused = _reuse(engine, tokens)
        logits = engine.prefill(tokens[reused:])
        prompt_seconds = time.perf_counter() - start
        prompt_tps = (len(tokens) - reused) / max(prompt_seconds, 1e-9)
        steps = _steps(engine, logits, sampler, drafter, limit, list(tokens))
    decode_start = time.perf_counter()
    for n in range(max_tokens):
        step_start = time.perf_counter()
        with shared.step(call):
            token, logprob = steps.next(n)
            finish = None
            eos = token in model.tokenizer.eos_ids
            text = stopper.feed(detok.add(token)) if not eos else ""
            if eos or stopper.stopped is not None:
                finish = "stop"
            elif n + 1 == max_tokens:
                finish = "length"
            elif len(tokens) + n >= limit:  # the positions held before this token (a window may hold more)
                finish = "context"
            if finish is None:
                steps.advance(token, n, room=max_tokens - n - 1)
            else:
                steps.finish(n)
            cache = engine.stats().cache if since is not None else None
            report = engine.report(since=since) if since is not None and finish is not None else None
        if finish is not None and stopper.stopped is None:
            text += stopper.feed(detok.flush()) + stopper.flush()
            finish = "stop" if stopper.stopped is not None else finish  # the last bytes completed one
        now = time.perf_counter()
        yield GenerationResponse(
            text=text, token=token, logprob=logprob, prompt_tokens=len(tokens), prompt_tps=prompt_tps,
            generation_tokens=n + 1, generation_tps=(n + 1) / max(now - decode_start, 1e-9),
            token_seconds=now - step_start, finish_reason=finish, prompt_reused=reused,
            cache=cache, report=report, speculation=steps.report() if finish is not None else None,
            stop_string=stopper.stopped,
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
        prompt_reused=last.prompt_reused if last else 0,
        report=last.report if last else None, speculation=last.speculation if last else None,
        stop_string=last.stop_string if last else None,
    )
