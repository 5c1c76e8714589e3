"""Tool calls in generated text, in the form Qwen's and Hermes-style templates teach the model:

    <tool_call>
    {"name": "get_weather", "arguments": {"city": "Paris"}}
    </tool_call>

`ToolCallSplitter` passes ordinary text through as it streams and holds everything from the
first `<tool_call>` on; at the end `finish` parses the held blocks. If any block is not a JSON
object with a string `name`, nothing is parsed and the whole text is returned as text: a call
the client cannot execute is worse than the model's words shown as they were.
"""

from __future__ import annotations

import json
import re
import secrets
from dataclasses import dataclass

from strata.stop_strings import held_back

OPEN, CLOSE = "<tool_call>", "</tool_call>"
_BLOCK = re.compile(re.escape(OPEN) + r"(.*?)(?:" + re.escape(CLOSE) + r"|\Z)", re.DOTALL)


@dataclass(frozen=True)
class ToolCall:
    id: str
    name: str
    arguments: dict  # the JSON object the model wrote

    @property
    def arguments_json(self) -> str:
        return json.dumps(self.arguments, ensure_ascii=False)


def new_call_id(prefix: str) -> str:
    return f"{prefix}{secrets.token_hex(12)}"


def parse_tool_calls(text: str, *, id_prefix: str = "call_") -> tuple[str, list[ToolCall]]:
    """(text before the first call, calls) — or (text, []) when `text` holds no well-formed call."""
    start = text.find(OPEN)
    if start < 0:
        return text, []
    calls = []
    for block in _BLOCK.findall(text[start:]):
        try:
            obj = json.loads(block.strip())
        except json.JSONDecodeError:
            return text, []
        if not isinstance(obj, dict) or not isinstance(obj.get("name"), str):
            return text, []
        arguments = obj.get("arguments", obj.get("parameters", {}))
        if isinstance(arguments, str):  # some models write the arguments as a JSON string
            try:
                arguments = json.loads(arguments)
            except json.JSONDecodeError:
                return text, []
        if not isinstance(arguments, dict):
            return text, []
        calls.append(ToolCall(new_call_id(id_prefix), obj["name"], arguments))
    return text[:start].rstrip(), calls


class ToolCallSplitter:
    """Streams the text before any `<tool_call>`, holds the rest, parses it at the end.
    Whitespace is held until text follows it, so the text before a call ends as its words do."""

    def __init__(self, *, id_prefix: str = "call_") -> None:
        self._id_prefix = id_prefix
        self._held = ""
        self._calling = False

    def feed(self, piece: str) -> str:
        if self._calling:
            self._held += piece
            return ""
        text = self._held + piece
        at = text.find(OPEN)
        if at >= 0:
            self._calling = True
            cut = len(text[:at].rstrip())  # the whitespace before a call separates it: held with the call
            self._held = text[cut:]
            return text[:cut]
        cut = len(text) - held_back(text, (OPEN,))
        cut = len(text[:cut].rstrip())  # trailing whitespace waits: it may precede a call
        self._held = text[cut:]
        return text[:cut]

    def finish(self) -> tuple[str, list[ToolCall]]:
        """(text still to show, tool calls). With no well-formed call the held text is shown."""
        held, self._held = self._held, ""
        if not self._calling:
            return held, []
        _, calls = parse_tool_calls(held, id_prefix=self._id_prefix)
        return ("", calls) if calls else (held, [])
