"""OpenAI chat messages and tools as a chat template expects them (transformers' conventions):
`{"role", "content": str}`, assistant `tool_calls` with their arguments as a JSON object (the
API sends a JSON string), `{"role": "tool", "content", "tool_call_id"}` for results."""

from __future__ import annotations

import json

from strata.serve.fields import Fields, RequestError

ROLES = {"system": "system", "developer": "system", "user": "user", "assistant": "assistant", "tool": "tool"}


def content_text(f: Fields, key: str, *, required: bool) -> str:
    """A content field: a string, or an array of text parts (other part types are refused)."""
    value = f.raw(key, None)
    if value is None:
        if required:
            raise f.error(key, "required")
        return ""
    if isinstance(value, str):
        return value
    if not isinstance(value, list):
        raise f.error(key, "must be a string or an array of text parts")
    texts = []
    for i, part in enumerate(value):
        p = Fields(part, f"{f.name(key)}[{i}]")
        kind = p.str("type")
        if kind != "text":
            raise p.error("type", f"{kind!r} parts are not supported (text only)")
        texts.append(p.str("text"))
        p.ignore("cache_control")
        p.finish()
    return "".join(texts)


def _tool_call(item, where: str) -> dict:
    c = Fields(item, where)
    if c.str("type", "function") != "function":
        raise c.error("type", "must be 'function'")
    fn = c.object("function")
    name = fn.str("name")
    raw = fn.str("arguments", "{}")
    try:
        arguments = json.loads(raw) if raw.strip() else {}
    except json.JSONDecodeError:
        raise fn.error("arguments", "must be a JSON object encoded as a string") from None
    if not isinstance(arguments, dict):
        raise fn.error("arguments", "must encode a JSON object")
    fn.finish()
    call_id = c.str("id", "")
    c.finish()
    return {"id": call_id, "type": "function", "function": {"name": name, "arguments": arguments}}


def read_messages(f: Fields) -> list[dict]:
    out = []
    for i, item in enumerate(f.list("messages", nonempty=True)):
        m = Fields(item, f"messages[{i}]")
        role = m.str("role")
        if role not in ROLES:
            raise m.error("role", f"must be one of {', '.join(ROLES)}, got {role!r}")
        message = {"role": ROLES[role]}
        has_calls = role == "assistant" and m.has("tool_calls")
        message["content"] = content_text(m, "content", required=not has_calls)
        if has_calls:
            calls = m.list("tool_calls")
            message["tool_calls"] = [_tool_call(c, f"messages[{i}].tool_calls[{j}]") for j, c in enumerate(calls)]
        if role == "tool":
            message["tool_call_id"] = m.str("tool_call_id")
        if m.has("name"):
            message["name"] = m.str("name")
        m.ignore("refusal")
        m.finish()
        out.append(message)
    return out


def read_tools(f: Fields) -> list[dict] | None:
    """`tools` (function descriptions), unless absent or `tool_choice` is "none"."""
    choice = f.raw("tool_choice", "auto")
    if choice not in ("auto", "none"):
        raise RequestError("tool_choice: only 'auto' and 'none' are supported", param="tool_choice",
                           code="unsupported_parameter")
    f.neutral("parallel_tool_calls", True, False)
    tools = f.list("tools", [])
    out = []
    for i, item in enumerate(tools):
        t = Fields(item, f"tools[{i}]")
        if t.str("type", "function") != "function":
            raise t.error("type", "must be 'function'")
        fn = t.object("function")
        spec = {"name": fn.str("name")}
        if fn.has("description"):
            spec["description"] = fn.str("description")
        if fn.has("parameters"):
            fn.object("parameters")  # an object; its JSON schema goes to the template as sent
            spec["parameters"] = fn.raw("parameters")
        fn.ignore("strict")
        fn.finish()
        t.finish()
        out.append({"type": "function", "function": spec})
    return out if out and choice != "none" else None
