"""Anthropic's `POST /v1/messages` (plain and streamed) and `POST /v1/messages/count_tokens`.

Messages become the chat template's conversation: `system` first, `tool_use` blocks become
assistant `tool_calls`, `tool_result` blocks become `tool` turns. Usage follows Anthropic's
split: `input_tokens` are the prompt tokens prefilled, `cache_read_input_tokens` those served
from the session. `seed` is accepted as a strata extension (Anthropic's API has none).
"""

from __future__ import annotations

import secrets

from starlette.responses import JSONResponse, Response

from strata.serve import generation as gen
from strata.serve.fields import Fields, RequestError
from strata.serve.sse import KEEPALIVE_COMMENT, EventStream, event, until_disconnect
from strata.serve.state import ServerState

STOP_REASON = {gen.Finish.STOP: "end_turn", gen.Finish.STOP_SEQUENCE: "stop_sequence",
               gen.Finish.LENGTH: "max_tokens", gen.Finish.TOOL_CALLS: "tool_use"}
TEMPERATURE_MAX = 1.0  # Anthropic's range is [0, 1]


def _text_blocks(f: Fields, key: str) -> str:
    """A string or an array of text blocks."""
    value = f.raw(key, "")
    if isinstance(value, str):
        return value
    if not isinstance(value, list):
        raise f.error(key, "must be a string or an array of text blocks")
    texts = []
    for i, item in enumerate(value):
        b = Fields(item, f"{f.name(key)}[{i}]")
        if b.str("type") != "text":
            raise b.error("type", "only text blocks are supported here")
        texts.append(b.str("text"))
        b.ignore("cache_control", "citations")
        b.finish()
    return "".join(texts)


def _turn(item, i: int) -> list[dict]:
    """One Anthropic message as template messages (a user turn with tool results is several)."""
    m = Fields(item, f"messages[{i}]")
    role = m.str("role")
    if role not in ("user", "assistant"):
        raise m.error("role", f"must be 'user' or 'assistant', got {role!r}")
    content = m.raw("content")
    m.finish()
    if isinstance(content, str):
        return [{"role": role, "content": content}]
    if not isinstance(content, list):
        raise m.error("content", "must be a string or an array of content blocks")
    texts, calls, results = [], [], []
    for j, block in enumerate(content):
        b = Fields(block, f"messages[{i}].content[{j}]")
        kind = b.str("type")
        if kind == "text":
            texts.append(b.str("text"))
        elif kind == "tool_use" and role == "assistant":
            b.object("input")
            calls.append({"id": b.str("id"), "type": "function",
                          "function": {"name": b.str("name"), "arguments": b.raw("input")}})
        elif kind == "tool_result" and role == "user":
            b.ignore("is_error")
            results.append({"role": "tool", "tool_call_id": b.str("tool_use_id"),
                            "content": _text_blocks(b, "content")})
        else:
            raise b.error("type", f"{kind!r} blocks are not supported in {role} messages")
        b.ignore("cache_control", "citations")
        b.finish()
    turn = {"role": role, "content": "".join(texts)}
    if calls:
        turn["tool_calls"] = calls
    return results + ([turn] if texts or calls or not results else [])


def _tools(f: Fields) -> list[dict] | None:
    choice = Fields(f.raw("tool_choice", {"type": "auto"}), "tool_choice")
    kind = choice.str("type")
    if kind not in ("auto", "none"):
        raise RequestError("tool_choice: only {'type': 'auto'} and {'type': 'none'} are supported",
                           param="tool_choice", code="unsupported_parameter")
    choice.neutral("disable_parallel_tool_use", True, False)
    choice.finish()
    out = []
    for i, item in enumerate(f.list("tools", [])):
        t = Fields(item, f"tools[{i}]")
        if t.str("type", "custom") != "custom":
            raise t.error("type", "only custom (client) tools are supported")
        spec = {"name": t.str("name")}
        if t.has("description"):
            spec["description"] = t.str("description")
        t.object("input_schema")
        spec["parameters"] = t.raw("input_schema")
        t.ignore("cache_control")
        t.finish()
        out.append({"type": "function", "function": spec})
    return out if out and kind != "none" else None


def _prompt(state: ServerState, f: Fields) -> tuple[list[int], list[dict] | None]:
    messages = []
    system = _text_blocks(f, "system")
    if system:
        messages.append({"role": "system", "content": system})
    for i, item in enumerate(f.list("messages", nonempty=True)):
        messages += _turn(item, i)
    tools = _tools(f)
    thinking = Fields(f.raw("thinking", {"type": "disabled"}), "thinking")
    if thinking.str("type") != "disabled":
        raise RequestError("thinking: not supported by strata", param="thinking", code="unsupported_parameter")
    thinking.finish()
    return state.chat_tokens(messages, tools), tools


def _usage(o: gen.Outcome) -> dict:
    return {"input_tokens": o.prompt_tokens - o.prompt_reused, "output_tokens": o.completion_tokens,
            "cache_read_input_tokens": o.prompt_reused, "cache_creation_input_tokens": 0}


def _content(o: gen.Outcome) -> list[dict]:
    blocks = [{"type": "text", "text": o.text}] if o.text or not o.tool_calls else []
    return blocks + [{"type": "tool_use", "id": c.id, "name": c.name, "input": c.arguments} for c in o.tool_calls]


async def messages(state: ServerState, request, body: dict) -> Response:
    f = Fields(body)
    state.check_model(f)
    tokens, tools = _prompt(state, f)
    state.check_prompt(tokens, "messages")
    sampling = gen.read_sampling(f, max_tokens=f.int("max_tokens", lo=1, hi=state.context),
                                 temperature_hi=TEMPERATURE_MAX)
    stops = gen.read_stops(f, "stop_sequences", single=False)  # Anthropic's field is an array
    stream = f.bool("stream", False)
    # no effect on a local model's output: accounting, routing and caching hints of Anthropic's service
    f.ignore("metadata", "service_tier", "container", "cache_control", "inference_geo", "speed", "user_profile_id",
             "workspace_id", "diagnostics")
    f.finish()
    plan = gen.Plan(tokens, sampling, stops, tools=bool(tools), call_id_prefix="toolu_")
    head = {"id": f"msg_{secrets.token_hex(12)}", "type": "message", "role": "assistant", "model": state.name}
    if stream:
        return EventStream(_events(state, plan, head))

    async def work():
        async for item in gen.run(state, plan):
            if isinstance(item, gen.Outcome):
                return item
        raise gen.GenerationFailed("generation ended without a result")

    finished, o = await until_disconnect(request.receive, work())
    if not finished:
        return Response(status_code=499)
    return JSONResponse({**head, "content": _content(o), "stop_reason": STOP_REASON[o.finish],
                         "stop_sequence": o.stop_sequence, "usage": _usage(o), "strata": o.strata})


async def _events(state: ServerState, plan: gen.Plan, head: dict):
    usage = {"input_tokens": len(plan.tokens), "output_tokens": 0}
    yield event({"type": "message_start", "message": {**head, "content": [], "stop_reason": None,
                                                       "stop_sequence": None, "usage": usage}}, "message_start")
    index, text_open = 0, False
    try:
        async for item in gen.run(state, plan):
            if item is gen.KEEPALIVE:
                yield KEEPALIVE_COMMENT
            elif isinstance(item, gen.Piece) and item.text:
                if not text_open:
                    yield event({"type": "content_block_start", "index": index,
                                 "content_block": {"type": "text", "text": ""}}, "content_block_start")
                    text_open = True
                yield event({"type": "content_block_delta", "index": index,
                             "delta": {"type": "text_delta", "text": item.text}}, "content_block_delta")
            elif isinstance(item, gen.Outcome):
                if text_open:
                    yield event({"type": "content_block_stop", "index": index}, "content_block_stop")
                    index += 1
                for c in item.tool_calls:
                    yield event({"type": "content_block_start", "index": index, "content_block": {
                        "type": "tool_use", "id": c.id, "name": c.name, "input": {}}}, "content_block_start")
                    yield event({"type": "content_block_delta", "index": index, "delta": {
                        "type": "input_json_delta", "partial_json": c.arguments_json}}, "content_block_delta")
                    yield event({"type": "content_block_stop", "index": index}, "content_block_stop")
                    index += 1
                yield event({"type": "message_delta", "delta": {"stop_reason": STOP_REASON[item.finish],
                                                                 "stop_sequence": item.stop_sequence},
                             "usage": _usage(item), "strata": item.strata}, "message_delta")
    except gen.GenerationFailed as e:
        yield event({"type": "error", "error": {"type": "api_error", "message": str(e)}}, "error")
        return
    yield event({"type": "message_stop"}, "message_stop")


async def count_tokens(state: ServerState, request, body: dict) -> Response:
    f = Fields(body)
    state.check_model(f)
    tokens, _ = _prompt(state, f)
    f.finish()
    return JSONResponse({"input_tokens": len(tokens)})
