"""What the serve tests share: a made model, a Qwen-style chat template with tools, an app on it,
a scripted generator (a model that says exactly what a test needs: a tool call, a stop
sequence), and a live uvicorn server on a free loopback port."""

from __future__ import annotations

import contextlib
import socket
import threading
import time

import pytest

import strata
from strata.generate import GenerationResponse
from strata.serve import build_app
from strata.testing.models import make_model

CONTEXT = 2048  # the tiny shape's 256 is too short for a templated conversation in byte tokens
NAME = "tiny"

# The shape of Qwen2.5's template: ChatML turns, tools listed in the system turn, calls and results
# in <tool_call> / <tool_response> blocks.
CHAT_TEMPLATE = """\
{%- if tools %}<|im_start|>system
{% if messages[0].role == 'system' %}{{ messages[0].content }}{% else %}You are a helpful assistant.{% endif %}

# Tools
<tools>
{% for tool in tools %}{{ tool | tojson }}
{% endfor %}</tools>
For each function call, return a json object within <tool_call></tool_call> XML tags.<|im_end|>
{% elif messages[0].role == 'system' %}<|im_start|>system
{{ messages[0].content }}<|im_end|>
{% endif %}
{%- for message in messages if message.role != 'system' %}
{%- if message.role == 'tool' %}<|im_start|>user
<tool_response>
{{ message.content }}
</tool_response><|im_end|>
{% elif message.role == 'assistant' %}<|im_start|>assistant
{{ message.content }}{% for call in message.tool_calls or [] %}
<tool_call>
{"name": "{{ call.function.name }}", "arguments": {{ call.function.arguments | tojson }}}
</tool_call>{% endfor %}<|im_end|>
{% else %}<|im_start|>{{ message.role }}
{{ message.content }}<|im_end|>
{% endif %}
{%- endfor %}
{%- if add_generation_prompt %}<|im_start|>assistant
{% endif %}"""


def model_fixture():
    """A module's `model` fixture (`model = model_fixture()`): the tiny shape, a 2048 context."""

    @pytest.fixture(scope="module")
    def model(tmp_path_factory):
        made = make_model(tmp_path_factory.mktemp("serve") / NAME, "tiny", seed=3, max_context=CONTEXT)
        return strata.load(made.model_path)

    return model


def make_app(model, **kwargs):
    kwargs.setdefault("chat_template", CHAT_TEMPLATE)
    kwargs.setdefault("keepalive_seconds", 0.05)
    return build_app(model, strata.Config(backend="numpy"), **kwargs)


def scripted(pieces: list[str], *, finish: str = "stop", delay: float = 0.0, log: list | None = None):
    """A `stream_generate` stand-in that yields `pieces` as tokens (`log` collects each call's
    prompt tokens, in the order the worker ran them)."""

    def generate(model, tokens, *, max_tokens, config, **sampling):
        if log is not None:
            log.append(list(tokens))
        n = min(len(pieces), max_tokens)
        for i, piece in enumerate(pieces[:n]):
            time.sleep(delay)
            last = i + 1 == n
            yield GenerationResponse(
                text=piece, token=ord(piece[0]) if piece else 0, logprob=-0.5, prompt_tokens=len(tokens),
                prompt_tps=1.0, generation_tokens=i + 1, generation_tps=1.0, token_seconds=delay,
                finish_reason=(finish if n == len(pieces) else "length") if last else None)

    return generate


def sse_events(text: str) -> list[tuple[str | None, str]]:
    """(event name, data) of each event in an SSE body; comments are dropped."""
    out = []
    for block in text.split("\n\n"):
        name, data = None, []
        for line in block.splitlines():
            if line.startswith("event: "):
                name = line[7:]
            elif line.startswith("data: "):
                data.append(line[6:])
        if data:
            out.append((name, "\n".join(data)))
    return out


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


@contextlib.contextmanager
def live_server(app):
    """The app under uvicorn on 127.0.0.1:<free port>, in a thread; yields the base URL."""
    import uvicorn

    port = free_port()
    from strata.serve.protocol import json_errors

    server = uvicorn.Server(uvicorn.Config(app, host="127.0.0.1", port=port, log_level="warning",
                                           http=json_errors()))  # as `strata serve` runs it
    thread = threading.Thread(target=server.run, daemon=True)
    thread.start()
    deadline = time.monotonic() + 10
    while not server.started:
        if time.monotonic() > deadline or not thread.is_alive():
            raise RuntimeError("uvicorn did not start")
        time.sleep(0.02)
    try:
        yield f"http://127.0.0.1:{port}"
    finally:
        server.should_exit = True
        thread.join(10)
