"""POST /v1/messages (Anthropic), plain and streamed, in-process."""

import json

import pytest
from serve_support import NAME, make_app, model_fixture, scripted, sse_events
from starlette.testclient import TestClient

model = model_fixture()

BASE = {"model": NAME, "max_tokens": 16, "messages": [{"role": "user", "content": "Say something."}]}


@pytest.fixture(scope="module")
def client(model):
    with TestClient(make_app(model)) as c:
        yield c


def _streamed(client, body) -> list[tuple[str, dict]]:
    r = client.post("/v1/messages", json={**body, "stream": True})
    assert r.status_code == 200
    return [(name, json.loads(data)) for name, data in sse_events(r.text)]


def test_a_message_and_its_stream_say_the_same(client):
    body = {**BASE, "temperature": 0, "system": "You are terse."}
    plain = client.post("/v1/messages", json=body).json()
    assert plain["type"] == "message" and plain["role"] == "assistant" and plain["stop_reason"] == "max_tokens"
    assert plain["usage"]["output_tokens"] == 16 and plain["usage"]["input_tokens"] > 0
    events = _streamed(client, body)
    names = [n for n, _ in events]
    assert names[0] == "message_start" and names[-2:] == ["message_delta", "message_stop"]
    assert all(n == d["type"] for n, d in events)
    text = "".join(d["delta"]["text"] for n, d in events if n == "content_block_delta")
    assert text == "".join(b["text"] for b in plain["content"] if b["type"] == "text")
    delta = events[-2][1]
    assert delta["delta"]["stop_reason"] == "max_tokens" and delta["usage"]["output_tokens"] == 16
    prompt = lambda u: u["input_tokens"] + u["cache_read_input_tokens"]  # noqa: E731
    assert prompt(delta["usage"]) == prompt(plain["usage"])
    assert delta["usage"]["cache_read_input_tokens"] == prompt(plain["usage"]) - 1  # the same prompt again
    assert "strata" in plain and "strata" in delta


def test_stop_sequences_are_reported(model):
    with TestClient(make_app(model, generate=scripted(["one ", "two ", "three"]))) as c:
        r = c.post("/v1/messages", json={**BASE, "stop_sequences": ["two"]}).json()
        assert r["content"] == [{"type": "text", "text": "one "}]
        assert (r["stop_reason"], r["stop_sequence"]) == ("stop_sequence", "two")


def test_tool_use_round_trip(model):
    log = []
    said = ['<tool_call>\n{"name": "add", "arguments": {"a": 2, "b": 3}}\n</tool_call>']
    tools = [{"name": "add", "description": "a + b", "input_schema": {
        "type": "object", "properties": {"a": {"type": "number"}, "b": {"type": "number"}}}}]
    with TestClient(make_app(model, generate=scripted(said, log=log))) as c:
        body = {**BASE, "messages": [{"role": "user", "content": "2 + 3?"}], "tools": tools}
        r = c.post("/v1/messages", json=body).json()
        assert r["stop_reason"] == "tool_use"
        (use,) = r["content"]
        assert (use["type"], use["name"], use["input"]) == ("tool_use", "add", {"a": 2, "b": 3})
        assert use["id"].startswith("toolu_")
        events = _streamed(c, body)
        starts = [d["content_block"] for n, d in events if n == "content_block_start"]
        assert [b["type"] for b in starts] == ["tool_use"]
        partial = "".join(d["delta"]["partial_json"] for n, d in events if n == "content_block_delta")
        assert json.loads(partial) == {"a": 2, "b": 3}
        body["messages"] += [{"role": "assistant", "content": r["content"]},
                             {"role": "user", "content": [{"type": "tool_result", "tool_use_id": use["id"],
                                                           "content": "5"}]}]
        assert c.post("/v1/messages", json=body).status_code == 200
        prompt = bytes(t for t in log[-1] if t < 256).decode()
        assert '{"name": "add", "arguments": {"a": 2, "b": 3}}' in prompt and "<tool_response>\n5\n" in prompt


def test_count_tokens(client):
    r = client.post("/v1/messages/count_tokens", json={"model": NAME, "messages": BASE["messages"]})
    usage = client.post("/v1/messages", json={**BASE, "max_tokens": 1}).json()["usage"]
    assert r.json()["input_tokens"] == usage["input_tokens"] + usage["cache_read_input_tokens"]


def test_anthropic_errors_have_anthropic_shape(client):
    r = client.post("/v1/messages", json={**BASE, "max_tokens": None})
    assert r.status_code == 400
    assert r.json() == {"type": "error", "error": {"type": "invalid_request_error", "message": "max_tokens: required"}}
    assert client.post("/v1/messages", json={**BASE, "model": "claude"}).json()["error"]["type"] == "not_found_error"
