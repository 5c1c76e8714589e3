"""POST /v1/completions and /v1/chat/completions, in-process (starlette's TestClient)."""

import json

import pytest
from serve_support import CHAT_TEMPLATE, NAME, make_app, model_fixture, scripted, sse_events
from starlette.testclient import TestClient

import strata
from strata.chat_template import render_chat

model = model_fixture()


@pytest.fixture(scope="module")
def client(model):
    with TestClient(make_app(model)) as c:
        yield c


def _stream(client, path, body) -> list[dict]:
    r = client.post(path, json={**body, "stream": True})
    assert r.status_code == 200 and r.headers["content-type"].startswith("text/event-stream")
    events = sse_events(r.text)
    assert events[-1][1] == "[DONE]"
    return [json.loads(data) for _, data in events[:-1]]


def test_a_completion_is_strata_generate_with_the_same_settings(client, model):
    for settings in ({"temperature": 0.0}, {"temperature": 0.9, "top_p": 0.8, "seed": 7}):
        body = {"model": NAME, "prompt": "def f(x):", "max_tokens": 12, **settings}
        r = client.post("/v1/completions", json=body)
        assert r.status_code == 200, r.text
        body = r.json()
        expected = strata.generate(model, "def f(x):", max_tokens=12, **settings)
        assert body["choices"][0]["text"] == expected.text
        n = expected.prompt_tokens
        usage = {k: v for k, v in body["usage"].items() if k != "prompt_tokens_details"}
        assert usage == {"prompt_tokens": n, "completion_tokens": 12, "total_tokens": n + 12}
        assert body["choices"][0]["finish_reason"] == "length"
        assert body["strata"]["finish_reason"] == "length" and "report" in body["strata"]


@pytest.mark.parametrize("settings", [
    {"temperature": 0.9, "top_k": 5, "seed": 3},
    {"temperature": 0.9, "min_p": 0.2, "seed": 3},
    {"temperature": 0.0, "repeat_penalty": 1.5},
    {"temperature": 0.0, "frequency_penalty": 1.5},
    {"temperature": 0.0, "presence_penalty": 2.0},
    {"temperature": 0.8, "top_k": 20, "min_p": 0.05, "repeat_penalty": 1.1, "frequency_penalty": 0.5,
     "presence_penalty": -0.5, "seed": 9},
])
def test_every_cli_sampling_field_is_a_request_field(client, model, settings):
    expected = strata.generate(model, "def f(x):", max_tokens=16, **settings)
    for path, body in (("/v1/completions", {"prompt": "def f(x):"}),):
        r = client.post(path, json={"model": NAME, "max_tokens": 16, **body, **settings})
        assert r.status_code == 200, r.text
        assert r.json()["choices"][0]["text"] == expected.text
    plain = strata.generate(model, "def f(x):", max_tokens=16, **{**settings, **_neutral(settings)})
    assert plain.tokens != expected.tokens, "the setting changed nothing: the test cannot tell it was applied"


def _neutral(settings: dict) -> dict:
    """The settings with the field under test switched off (temperature and seed kept)."""
    off = {"top_k": 0, "min_p": 0.0, "repeat_penalty": 1.0, "frequency_penalty": 0.0, "presence_penalty": 0.0}
    return {k: v for k, v in off.items() if k in settings}


def test_the_seed_is_reported_and_reproduces_the_text(client):
    r1 = client.post("/v1/completions", json={"model": NAME, "prompt": "ab", "max_tokens": 10, "temperature": 1.0})
    seed = r1.json()["strata"]["seed"]
    r2 = client.post("/v1/completions", json={"model": NAME, "prompt": "ab", "max_tokens": 10, "temperature": 1.0,
                                              "seed": seed})
    assert r2.json()["choices"][0]["text"] == r1.json()["choices"][0]["text"]


def test_token_id_prompts_are_taken_as_given(client, model):
    ids = model.tokenizer.encode("hello")
    a = client.post("/v1/completions", json={"model": NAME, "prompt": ids, "max_tokens": 6, "temperature": 0})
    b = client.post("/v1/completions", json={"model": NAME, "prompt": "hello", "max_tokens": 6, "temperature": 0})
    assert a.json()["choices"][0]["text"] == b.json()["choices"][0]["text"]


@pytest.mark.parametrize("path, body", [
    ("/v1/completions", {"prompt": "x = [1, 2"}),
    ("/v1/chat/completions", {"messages": [{"role": "user", "content": "hi there"}]}),
])
def test_streamed_text_equals_the_plain_response_at_temperature_0(client, path, body):
    body = {"model": NAME, "max_tokens": 20, "temperature": 0, **body}
    plain = client.post(path, json=body).json()
    chunks = _stream(client, path, body)
    key = "text" if path == "/v1/completions" else "content"
    pick = (lambda c: c["text"]) if key == "text" else (lambda c: c["delta"].get("content") or "")
    streamed = "".join(pick(c["choices"][0]) for c in chunks if c["choices"])
    whole = plain["choices"][0]["text" if key == "text" else "message"]
    assert streamed == (whole if key == "text" else whole["content"])
    assert chunks[-1]["choices"][0]["finish_reason"] == "length" and "strata" in chunks[-1]
    usage = chunks[-1]["usage"]
    assert usage["total_tokens"] == plain["usage"]["total_tokens"]
    assert usage["prompt_tokens_details"]["cached_tokens"] == usage["prompt_tokens"] - 1  # the same prompt again


def test_include_usage_ends_the_stream_with_a_usage_chunk(client):
    chunks = _stream(client, "/v1/chat/completions", {
        "model": NAME, "messages": [{"role": "user", "content": "hi"}], "max_tokens": 5, "temperature": 0,
        "stream_options": {"include_usage": True}})
    assert chunks[-1]["choices"] == [] and chunks[-1]["usage"]["completion_tokens"] == 5
    assert all(c.get("usage") is None for c in chunks[:-1])


def test_chat_prompts_go_through_the_chat_template(client, model):
    messages = [{"role": "system", "content": "Be brief."}, {"role": "user", "content": "hello"}]
    r = client.post("/v1/chat/completions", json={"model": NAME, "messages": messages, "max_tokens": 8,
                                                  "temperature": 0})
    prompt = model.tokenizer.encode(render_chat(CHAT_TEMPLATE, messages))
    expected = strata.generate(model, prompt, max_tokens=8)
    assert r.json()["choices"][0]["message"] == {"role": "assistant", "content": expected.text}
    assert r.json()["usage"]["prompt_tokens"] == len(prompt)


def test_stop_sequences_cut_the_text(model):
    app = make_app(model, generate=scripted(["alpha ", "be", "ta ", "gamma ", "delta"]))
    with TestClient(app) as c:
        for path, body, key in [("/v1/completions", {"prompt": "x"}, "text"),
                                ("/v1/chat/completions", {"messages": [{"role": "user", "content": "x"}]}, None)]:
            body = {"model": NAME, "max_tokens": 10, "stop": ["ta g", "zzz"], **body}
            choice = c.post(path, json=body).json()["choices"][0]
            text = choice["text"] if key else choice["message"]["content"]
            assert (text, choice["finish_reason"]) == ("alpha be", "stop")
            chunks = _stream(c, path, body)
            pick = (lambda ch: ch["text"]) if key else (lambda ch: ch["delta"].get("content") or "")
            assert "".join(pick(ch["choices"][0]) for ch in chunks if ch["choices"]) == "alpha be"


def test_logprobs_are_the_chosen_tokens(client, model):
    r = client.post("/v1/chat/completions", json={"model": NAME, "messages": [{"role": "user", "content": "a"}],
                                                  "max_tokens": 6, "temperature": 0, "logprobs": True}).json()
    items = r["choices"][0]["logprobs"]["content"]
    assert len(items) == 6 and all(i["logprob"] <= 0 for i in items)
    r = client.post("/v1/completions", json={"model": NAME, "prompt": "abc", "max_tokens": 6, "temperature": 0,
                                             "logprobs": 0}).json()
    lp = r["choices"][0]["logprobs"]
    assert len(lp["token_logprobs"]) == 6 and lp["text_offset"][0] == 0


def test_tool_calls_come_back_as_openai_tool_calls(model):
    said = ['I will look.\n<tool_call>\n{"name": "get_weather", ', '"arguments": {"city": "Paris"}}\n</tool_call>']
    log = []
    schema = {"type": "object", "properties": {"city": {"type": "string"}}}
    tools = [{"type": "function", "function": {"name": "get_weather", "description": "Weather in a city",
                                               "parameters": schema}}]
    with TestClient(make_app(model, generate=scripted(said, log=log))) as c:
        body = {"model": NAME, "messages": [{"role": "user", "content": "Weather in Paris?"}], "tools": tools}
        message = c.post("/v1/chat/completions", json=body).json()["choices"][0]
        assert message["finish_reason"] == "tool_calls"
        call = message["message"]["tool_calls"][0]
        assert call["function"]["name"] == "get_weather"
        assert json.loads(call["function"]["arguments"]) == {"city": "Paris"}
        assert message["message"]["content"] == "I will look."
        assert b"get_weather" in bytes(log[-1][:-1])  # the template listed the tool in the prompt
        chunks = _stream(c, "/v1/chat/completions", body)
        streamed = [tc for ch in chunks if ch["choices"] for tc in ch["choices"][0]["delta"].get("tool_calls", [])]
        assert [tc["function"]["name"] for tc in streamed] == ["get_weather"]
        assert "<tool_call>" not in "".join(ch["choices"][0]["delta"].get("content") or "" for ch in chunks
                                            if ch["choices"])
        # the round trip: the call and its result go back through the template as the next prompt
        body["messages"] += [{"role": "assistant", "content": None, "tool_calls": [call]},
                             {"role": "tool", "tool_call_id": call["id"], "content": "18 C, sunny"}]
        assert c.post("/v1/chat/completions", json=body).status_code == 200
        prompt = bytes(t for t in log[-1] if t < 256).decode()
        assert '"arguments": {"city": "Paris"}' in prompt and "<tool_response>\n18 C, sunny" in prompt


def test_models_and_health(client):
    assert client.get("/v1/models").json()["data"][0]["id"] == NAME
    assert client.get(f"/v1/models/{NAME}").json()["id"] == NAME
    assert client.get("/v1/models/nope").status_code == 404
    assert client.get("/health").json() == {"status": "ok", "model": NAME, "queue": 0}
