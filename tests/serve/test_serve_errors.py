"""Malformed and hostile requests: each gets a 4xx with its API's one-line JSON error naming the
problem, and the server goes on serving."""

import json

import pytest
from serve_support import CONTEXT, NAME, make_app, model_fixture, scripted
from starlette.testclient import TestClient

model = model_fixture()

CHAT = "/v1/chat/completions"
COMPLETIONS = "/v1/completions"
MESSAGES = "/v1/messages"
USER = [{"role": "user", "content": "hi"}]
OK_CHAT = {"model": NAME, "messages": USER, "max_tokens": 2}
OK_COMPLETION = {"model": NAME, "prompt": "hi", "max_tokens": 2}
OK_MESSAGE = {"model": NAME, "messages": USER, "max_tokens": 2}


def chat(**changes):
    return {k: v for k, v in {**OK_CHAT, **changes}.items() if v is not ...}


def completion(**changes):
    return {k: v for k, v in {**OK_COMPLETION, **changes}.items() if v is not ...}


def message(**changes):
    return {k: v for k, v in {**OK_MESSAGE, **changes}.items() if v is not ...}


# (path, body: bytes sent as is or an object sent as JSON, expected status, text the message must hold)
CASES = [
    (CHAT, b'{"model":', 400, "malformed JSON"),
    (CHAT, b'{"model": "\xff\xfe"}', 400, "not valid UTF-8"),
    (CHAT, b'{"model": "tiny", "messages": [], "pad": "' + b"x" * (10 * 1024 * 1024) + b'"}', 413, "over the limit"),
    (CHAT, b"[1, 2]", 400, "expected a JSON object"),
    (CHAT, b"", 400, "body: empty"),
    (CHAT, b'{"model": "tiny", "messages": [{"role": "user", "content": "hi"}], "temperature": NaN}', 400, "NaN"),
    (CHAT, b'{"model": "tiny", "messages": [{"role": "user", "content": "\\ud800"}]}', 400, "lone surrogate"),
    (COMPLETIONS, b'{"model": "tiny", "prompt": ' + b"[" * 100000 + b"]" * 100000 + b"}", 400, "nested too deeply"),
    (COMPLETIONS, b'{"model": "tiny", "prompt": "hi", "max_tokens": 1e400}', 400, "max_tokens"),
    (CHAT, chat(messages=...), 400, "messages: required"),
    (CHAT, chat(messages=[]), 400, "messages: must not be empty"),
    (CHAT, chat(messages="hi"), 400, "messages: must be an array"),
    (CHAT, chat(messages=[42]), 400, "messages[0]: expected an object"),
    (CHAT, chat(messages=[{"content": "hi"}]), 400, "messages[0].role: required"),
    (CHAT, chat(messages=[{"role": "wizard", "content": "hi"}]), 400, "messages[0].role: must be one of"),
    (CHAT, chat(messages=[{"role": "user", "content": 7}]), 400, "messages[0].content"),
    (CHAT, chat(messages=[{"role": "user", "content": [{"type": "image_url", "image_url": {}}]}]), 400, "text only"),
    (CHAT, chat(messages=[{"role": "user", "content": "hi", "mood": "sad"}]), 400, "messages[0].mood: unknown field"),
    (CHAT, chat(foo=1), 400, "foo: unknown field"),
    (CHAT, chat(model="gpt-4o"), 404, "is not served here"),
    (CHAT, chat(model=...), 400, "model: required"),
    (CHAT, chat(model=5), 400, "model: must be a string"),
    (CHAT, chat(max_tokens=-5), 400, "max_tokens: must be an integer in [1, 2048]"),
    (CHAT, chat(max_tokens=10**9), 400, "max_tokens: must be an integer in [1, 2048]"),
    (CHAT, chat(max_tokens="10"), 400, "max_tokens"),
    (CHAT, chat(max_tokens=1.5), 400, "max_tokens"),
    (CHAT, chat(max_tokens=True), 400, "max_tokens"),
    (CHAT, chat(max_completion_tokens=0), 400, "max_completion_tokens"),
    (CHAT, chat(temperature=-1), 400, "temperature: must be a number in [0.0, 2.0]"),
    (CHAT, chat(temperature=5), 400, "temperature"),
    (CHAT, chat(temperature="hot"), 400, "temperature"),
    (CHAT, chat(top_p=2), 400, "top_p"),
    (CHAT, chat(top_p=0), 400, "top_p: must be in (0, 1]"),
    (CHAT, chat(seed=-1), 400, "seed"),
    (CHAT, chat(seed=2**70), 400, "seed"),
    (CHAT, chat(stop=123), 400, "stop"),
    (CHAT, chat(stop=["s"] * 20), 400, "stop: at most 16"),
    (CHAT, chat(stop=[""]), 400, "stop"),
    (CHAT, chat(stream="yes"), 400, "stream: must be true or false"),
    (CHAT, chat(stream_options=3), 400, "stream_options"),
    (CHAT, chat(n=2), 400, "n: not supported"),
    (CHAT, chat(presence_penalty=2.5), 400, "presence_penalty: must be a number in [-2.0, 2.0], got 2.5"),
    (CHAT, chat(frequency_penalty=-3), 400, "frequency_penalty: must be a number in [-2.0, 2.0]"),
    (CHAT, chat(frequency_penalty="lots"), 400, "frequency_penalty: must be a number"),
    (CHAT, chat(top_k=-1), 400, "top_k: must be an integer >= 0"),
    (CHAT, chat(top_k=2.5), 400, "top_k: must be an integer"),
    (CHAT, chat(min_p=1), 400, "min_p: must be in [0, 1)"),
    (CHAT, chat(min_p=-0.1), 400, "min_p: must be a number in [0.0, 1.0]"),
    (CHAT, chat(repeat_penalty=0), 400, "repeat_penalty: must be a number > 0"),
    (CHAT, chat(repeat_penalty=-1), 400, "repeat_penalty: must be a number >= 0.0"),
    (COMPLETIONS, completion(presence_penalty=7), 400, "presence_penalty: must be a number in [-2.0, 2.0]"),
    (CHAT, chat(logprobs="yes"), 400, "logprobs"),
    (CHAT, chat(top_logprobs=3), 400, "top_logprobs: not supported"),
    (CHAT, chat(tool_choice="required"), 400, "tool_choice"),
    (CHAT, chat(tools={"name": "f"}), 400, "tools: must be an array"),
    (CHAT, chat(tools=[{"type": "function"}]), 400, "tools[0].function: required"),
    (CHAT, chat(response_format={"type": "json_object"}), 400, "response_format"),
    (CHAT, chat(messages=[{"role": "user", "content": "x" * CONTEXT}]), 400, "the model's context is 2048"),
    (CHAT, chat(messages=[{"role": "assistant", "content": None, "tool_calls": [
        {"type": "function", "function": {"name": "f", "arguments": "{oops"}}]}]), 400, "arguments"),
    (COMPLETIONS, completion(prompt=...), 400, "prompt: required"),
    (COMPLETIONS, completion(prompt=["a", "b"]), 400, "one prompt per request"),
    (COMPLETIONS, completion(prompt=[1, 99999]), 400, "token ids must be in"),
    (COMPLETIONS, completion(prompt=""), 400, "empty"),
    (COMPLETIONS, completion(prompt={"text": "hi"}), 400, "prompt"),
    (COMPLETIONS, completion(logprobs=5), 400, "logprobs: only 0"),
    (COMPLETIONS, completion(echo=True), 400, "echo: not supported"),
    (COMPLETIONS, completion(prompt="y" * CONTEXT), 400, "context"),
    (MESSAGES, message(max_tokens=...), 400, "max_tokens: required"),
    (MESSAGES, message(temperature=1.5), 400, "temperature: must be a number in [0.0, 1.0]"),
    (MESSAGES, message(messages=[{"role": "system", "content": "hi"}]), 400, "messages[0].role"),
    (MESSAGES, message(messages=[{"role": "user", "content": [{"type": "image", "source": {}}]}]), 400,
     "'image' blocks are not supported"),
    (MESSAGES, message(top_k=-5), 400, "top_k: must be an integer >= 0"),
    (MESSAGES, message(frequency_penalty=0.5), 400, "frequency_penalty: unknown field"),  # OpenAI's only
    (MESSAGES, message(thinking={"type": "enabled", "budget_tokens": 100}), 400, "thinking"),
    (MESSAGES, message(messages=[{"role": "assistant", "content": [
        {"type": "tool_result", "tool_use_id": "x", "content": "1"}]}]), 400, "not supported in assistant messages"),
    (MESSAGES, message(system=5), 400, "system"),
    (MESSAGES, message(stop_sequences={"a": 1}), 400, "stop_sequences"),
    (MESSAGES, message(stop_sequences="END"), 400, "stop_sequences: must be an array of non-empty strings, got a string"),
    (MESSAGES, message(stop_sequences=["END", 3]), 400, "stop_sequences: must be an array of non-empty strings"),
    (MESSAGES, message(tools=[{"name": "f"}]), 400, "tools[0].input_schema: required"),
    (MESSAGES, b"{", 400, "malformed JSON"),
]


@pytest.fixture(scope="module")
def client(model):
    with TestClient(make_app(model)) as c:
        yield c


def test_there_are_at_least_forty_cases():
    assert len(CASES) >= 40


@pytest.mark.parametrize("path, body, status, fragment", CASES, ids=[f"{i}" for i in range(len(CASES))])
def test_bad_requests_get_a_4xx_naming_the_problem(client, path, body, status, fragment):
    if isinstance(body, bytes):
        r = client.post(path, content=body, headers={"content-type": "application/json"})
    else:
        r = client.post(path, json=body)
    assert r.status_code == status, r.text[:300]
    assert "\n" not in r.text and "Traceback" not in r.text
    error = r.json()["error"]
    assert fragment in error["message"]
    if path == MESSAGES:
        assert r.json()["type"] == "error" and error["type"] in ("invalid_request_error", "not_found_error",
                                                                 "request_too_large")
    else:
        assert error["type"] == "invalid_request_error"


def test_the_server_keeps_serving_after_every_bad_request(client):
    for path, body, _, _ in CASES:
        client.post(path, **({"content": body} if isinstance(body, bytes) else {"json": body}))
    for path, body in ((CHAT, OK_CHAT), (COMPLETIONS, OK_COMPLETION), (MESSAGES, OK_MESSAGE)):
        assert client.post(path, json=body).status_code == 200


@pytest.mark.parametrize("method, path, status", [("GET", CHAT, 405), ("POST", "/v1/nope", 404),
                                                  ("DELETE", "/health", 405)])
def test_unknown_routes_and_methods_are_json_errors(client, method, path, status):
    r = client.request(method, path)
    assert r.status_code == status and json.loads(r.text)["error"]["message"]


def test_an_engine_failure_is_a_500_line_and_the_server_goes_on(model):
    from strata.errors import ExpertReadError

    calls = []

    def broken(*args, **kwargs):  # the first two generations fail after a token, the third is fine
        calls.append(1)
        steps = scripted(["a", "b", "c"] if len(calls) <= 2 else ["fine"])(*args, **kwargs)
        yield next(steps)
        if len(calls) <= 2:
            raise ExpertReadError("layer 3 expert 7: short read (0 of 4096 bytes)")
        yield from steps

    with TestClient(make_app(model, generate=broken), raise_server_exceptions=False) as c:
        r = c.post(COMPLETIONS, json=OK_COMPLETION)
        assert r.status_code == 500 and "\n" not in r.text
        assert r.json()["error"]["message"] == ("generation failed: ExpertReadError: layer 3 expert 7: short read "
                                                "(0 of 4096 bytes)")
        r = c.post(MESSAGES, json={**OK_MESSAGE, "stream": True})
        assert r.status_code == 200 and "event: error" in r.text and "short read" in r.text
        assert c.post(COMPLETIONS, json=OK_COMPLETION).json()["choices"][0]["text"] == "fine"
        assert "strata_generation_failures_total 2" in c.get("/metrics").text
        assert "strata_requests_cancelled_total 0" in c.get("/metrics").text
