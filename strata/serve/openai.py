"""OpenAI's `POST /v1/chat/completions` and `POST /v1/completions`, plain and streamed.

Usage counts cached prompt tokens as OpenAI does (`prompt_tokens_details.cached_tokens`);
the `strata` field carries the per-request extension (reuse, seed, timings, stream report).
A stream ends with a usage chunk (`choices: []`) when `stream_options.include_usage` is set,
otherwise usage rides on the chunk that carries `finish_reason`; then `data: [DONE]`.
"""

from __future__ import annotations

import secrets
import time

from starlette.responses import JSONResponse, Response

from strata import __version__
from strata.serve import generation as gen
from strata.serve.fields import Fields, RequestError
from strata.serve.openai_messages import read_messages, read_tools
from strata.serve.sse import KEEPALIVE_COMMENT, EventStream, event, until_disconnect
from strata.serve.state import ServerState
from strata.serve.tool_calls import ToolCall

COMPLETIONS_DEFAULT_MAX_TOKENS = 16  # OpenAI's documented default for /v1/completions
FINISH = {gen.Finish.STOP: "stop", gen.Finish.STOP_SEQUENCE: "stop", gen.Finish.LENGTH: "length",
          gen.Finish.TOOL_CALLS: "tool_calls"}
FINGERPRINT = f"strata-{__version__}"


def _unsupported(f: Fields) -> None:
    """OpenAI fields strata does not implement: refused unless neutral. Fields that do not change
    the output (user ids, storage flags) are dropped."""
    f.neutral("n", 1)
    f.neutral("logit_bias", {})
    f.ignore("user", "metadata", "store", "service_tier")


def _common(state: ServerState, f: Fields, tokens: list[int], *, where: str, max_tokens_default: int) -> tuple:
    """(sampling, stops, stream, include_usage) read the same way by both endpoints."""
    state.check_prompt(tokens, where)
    limit = state.context
    max_tokens = f.int("max_tokens", None, lo=1, hi=limit)
    if f.has("max_completion_tokens"):
        max_tokens = f.int("max_completion_tokens", lo=1, hi=limit)
    sampling = gen.read_sampling(f, max_tokens=max_tokens or max_tokens_default, temperature_hi=2.0,
                                 openai_penalties=True)
    stops = gen.read_stops(f, "stop")
    stream = f.bool("stream", False)
    include_usage = False
    if f.has("stream_options"):
        o = f.object("stream_options")
        include_usage = o.bool("include_usage", False)
        o.ignore("include_obfuscation")
        o.finish()
    return sampling, stops, stream, include_usage


def _usage(o: gen.Outcome) -> dict:
    return {"prompt_tokens": o.prompt_tokens, "completion_tokens": o.completion_tokens,
            "total_tokens": o.prompt_tokens + o.completion_tokens,
            "prompt_tokens_details": {"cached_tokens": o.prompt_reused}}


def _tool_calls(calls: list[ToolCall]) -> list[dict]:
    return [{"id": c.id, "type": "function", "function": {"name": c.name, "arguments": c.arguments_json}}
            for c in calls]


def _chat_logprobs(items) -> dict:
    return {"content": [{"token": t.token, "logprob": t.logprob, "bytes": list(t.token.encode()),
                         "top_logprobs": []} for t in items]}


def _completion_logprobs(items, offset: int = 0) -> dict:
    offsets, at = [], offset
    for t in items:
        offsets.append(at)
        at += len(t.token)
    return {"tokens": [t.token for t in items], "token_logprobs": [t.logprob for t in items],
            "top_logprobs": None, "text_offset": offsets}


async def _collect(state: ServerState, plan: gen.Plan, request) -> gen.Outcome | None:
    async def work():
        async for item in gen.run(state, plan):
            if isinstance(item, gen.Outcome):
                return item
        raise gen.GenerationFailed("generation ended without a result")

    finished, outcome = await until_disconnect(request.receive, work())
    return outcome if finished else None


async def chat_completions(state: ServerState, request, body: dict) -> Response:
    f = Fields(body)
    state.check_model(f)
    messages = read_messages(f)
    tools = read_tools(f)
    logprobs = f.bool("logprobs", False)
    f.neutral("top_logprobs", 0)  # strata reports the chosen token's logprob only
    if f.has("response_format") and Fields(f.raw("response_format"), "response_format").str("type") != "text":
        raise RequestError("response_format: only {'type': 'text'} is supported", param="response_format",
                           code="unsupported_parameter")
    _unsupported(f)
    tokens = state.chat_tokens(messages, tools)
    sampling, stops, stream, include_usage = _common(state, f, tokens, where="messages",
                                                     max_tokens_default=state.context)
    f.finish()
    plan = gen.Plan(tokens, sampling, stops, tools=bool(tools), logprobs=logprobs)
    ident, created = f"chatcmpl-{secrets.token_hex(12)}", int(time.time())
    head = {"id": ident, "created": created, "model": state.name, "system_fingerprint": FINGERPRINT}
    if stream:
        return EventStream(_chat_events(state, plan, head, include_usage))
    o = await _collect(state, plan, request)
    if o is None:
        return Response(status_code=499)  # the client has gone; nobody reads this
    message = {"role": "assistant", "content": o.text if o.text or not o.tool_calls else None}
    if o.tool_calls:
        message["tool_calls"] = _tool_calls(o.tool_calls)
    choice = {"index": 0, "message": message, "finish_reason": FINISH[o.finish],
              "logprobs": _chat_logprobs(o.logprobs) if logprobs else None}
    return JSONResponse({**head, "object": "chat.completion", "choices": [choice], "usage": _usage(o),
                         "strata": o.strata})


async def _chat_events(state: ServerState, plan: gen.Plan, head: dict, include_usage: bool):
    def chunk(delta: dict, finish=None, logprobs=None, **extra) -> str:
        choice = {"index": 0, "delta": delta, "logprobs": logprobs, "finish_reason": finish}
        return event({**head, "object": "chat.completion.chunk", "choices": [choice], **extra})

    yield chunk({"role": "assistant", "content": ""})
    try:
        async for item in gen.run(state, plan):
            if item is gen.KEEPALIVE:
                yield KEEPALIVE_COMMENT
            elif isinstance(item, gen.Piece):
                lp = _chat_logprobs(item.logprobs) if plan.logprobs else None
                if item.text or lp:
                    yield chunk({"content": item.text}, logprobs=lp)
            elif isinstance(item, gen.Outcome):
                if item.tool_calls:
                    calls = [{"index": i, **c} for i, c in enumerate(_tool_calls(item.tool_calls))]
                    yield chunk({"tool_calls": calls})
                extra = {} if include_usage else {"usage": _usage(item), "strata": item.strata}
                yield chunk({}, FINISH[item.finish], **extra)
                if include_usage:
                    yield event({**head, "object": "chat.completion.chunk", "choices": [], "usage": _usage(item),
                                 "strata": item.strata})
    except gen.GenerationFailed as e:
        yield event({"error": {"message": str(e), "type": "server_error", "param": None, "code": None}})
    yield event("[DONE]")


def _prompt_tokens(state: ServerState, f: Fields) -> list[int]:
    """`prompt`: a string, one string in an array, or token ids."""
    value = f.raw("prompt")
    if isinstance(value, list) and len(value) == 1 and isinstance(value[0], (str, list)):
        value = value[0]  # the client libraries wrap a single prompt
    if isinstance(value, str):
        return state.text_tokens(value)
    vocab = state.model.tokenizer.vocab_size
    if isinstance(value, list) and value and all(isinstance(t, int) and not isinstance(t, bool) for t in value):
        if not all(0 <= t < vocab for t in value):
            raise f.error("prompt", f"token ids must be in [0, {vocab - 1}]")
        return list(value)
    raise f.error("prompt", "must be a string or an array of token ids (one prompt per request)")


async def completions(state: ServerState, request, body: dict) -> Response:
    f = Fields(body)
    state.check_model(f)
    tokens = _prompt_tokens(state, f)
    logprobs = f.int("logprobs", None, lo=0)
    if logprobs:  # 0: the chosen tokens' logprobs; strata has no alternatives to list
        raise RequestError("logprobs: only 0 is supported (the chosen token's logprob, no alternatives)",
                           param="logprobs", code="unsupported_parameter")
    f.neutral("echo", False)
    f.neutral("best_of", 1)
    f.neutral("suffix", "")
    _unsupported(f)
    sampling, stops, stream, include_usage = _common(state, f, tokens, where="prompt",
                                                     max_tokens_default=COMPLETIONS_DEFAULT_MAX_TOKENS)
    f.finish()
    plan = gen.Plan(tokens, sampling, stops, logprobs=logprobs is not None)
    head = {"id": f"cmpl-{secrets.token_hex(12)}", "created": int(time.time()), "model": state.name,
            "system_fingerprint": FINGERPRINT}
    if stream:
        return EventStream(_completion_events(state, plan, head, include_usage))
    o = await _collect(state, plan, request)
    if o is None:
        return Response(status_code=499)
    choice = {"index": 0, "text": o.text, "finish_reason": FINISH[o.finish],
              "logprobs": _completion_logprobs(o.logprobs) if plan.logprobs else None}
    return JSONResponse({**head, "object": "text_completion", "choices": [choice], "usage": _usage(o),
                         "strata": o.strata})


async def _completion_events(state: ServerState, plan: gen.Plan, head: dict, include_usage: bool):
    def chunk(text: str, finish=None, logprobs=None, **extra) -> str:
        choice = {"index": 0, "text": text, "logprobs": logprobs, "finish_reason": finish}
        return event({**head, "object": "text_completion", "choices": [choice], **extra})

    offset = 0
    try:
        async for item in gen.run(state, plan):
            if item is gen.KEEPALIVE:
                yield KEEPALIVE_COMMENT
            elif isinstance(item, gen.Piece):
                lp = _completion_logprobs(item.logprobs, offset) if plan.logprobs else None
                offset += sum(len(t.token) for t in item.logprobs)
                yield chunk(item.text, logprobs=lp)
            elif isinstance(item, gen.Outcome):
                extra = {} if include_usage else {"usage": _usage(item), "strata": item.strata}
                yield chunk("", FINISH[item.finish], **extra)
                if include_usage:
                    yield event({**head, "object": "text_completion", "choices": [], "usage": _usage(item),
                                 "strata": item.strata})
    except gen.GenerationFailed as e:
        yield event({"error": {"message": str(e), "type": "server_error", "param": None, "code": None}})
    yield event("[DONE]")
