"""The official `openai` and `anthropic` clients against a live uvicorn server on 127.0.0.1."""

import time

import httpx
import pytest
from serve_support import CHAT_TEMPLATE, NAME, live_server, make_app, model_fixture, scripted

import strata
from strata.chat_template import render_chat

model = model_fixture()

openai = pytest.importorskip("openai")
anthropic = pytest.importorskip("anthropic")

USER = [{"role": "user", "content": "Write a function."}]


@pytest.fixture(scope="module")
def server(model):
    app = make_app(model)
    with live_server(app) as url:
        yield url, app.state.strata


def test_openai_chat_plain_streamed_and_seeded(server, model):
    url, _ = server
    client = openai.OpenAI(base_url=f"{url}/v1", api_key="none", max_retries=0)
    for settings in ({"temperature": 0}, {"temperature": 0.7, "top_p": 0.9, "seed": 5}):
        plain = client.chat.completions.create(model=NAME, messages=USER, max_tokens=10, **settings)
        expected = strata.generate(model, model.tokenizer.encode(render_chat(CHAT_TEMPLATE, USER)), max_tokens=10,
                                   **settings)
        assert plain.choices[0].message.content == expected.text
        assert plain.usage.completion_tokens == len(expected.tokens)
        assert plain.model_extra["strata"]["seed"] == settings.get("seed", plain.model_extra["strata"]["seed"])
        stream = client.chat.completions.create(model=NAME, messages=USER, max_tokens=10, stream=True,
                                                stream_options={"include_usage": True}, **settings)
        chunks = list(stream)
        assert "".join(c.choices[0].delta.content or "" for c in chunks if c.choices) == expected.text
        assert chunks[-1].usage.total_tokens == plain.usage.total_tokens


def test_openai_completions_and_stop(server, model):
    url, _ = server
    client = openai.OpenAI(base_url=f"{url}/v1", api_key="none", max_retries=0)
    full = client.completions.create(model=NAME, prompt="def add(a, b):", max_tokens=12, temperature=0)
    assert full.choices[0].text == strata.generate(model, "def add(a, b):", max_tokens=12).text
    text = full.choices[0].text
    stop = text[4:6]  # a stop sequence the greedy text is known to contain
    cut = client.completions.create(model=NAME, prompt="def add(a, b):", max_tokens=12, temperature=0, stop=[stop])
    assert cut.choices[0].text == text[:text.find(stop)] and cut.choices[0].finish_reason == "stop"
    assert [m.id for m in client.models.list()] == [NAME]
    with pytest.raises(openai.BadRequestError, match="temperature"):
        client.completions.create(model=NAME, prompt="x", max_tokens=2, temperature=9)
    with pytest.raises(openai.NotFoundError):
        client.completions.create(model="gpt-4o", prompt="x", max_tokens=2)


def test_anthropic_messages_plain_and_streamed(server, model):
    url, _ = server
    client = anthropic.Anthropic(base_url=url, api_key="none", max_retries=0)
    greedy = {"temperature": 0}  # this client's signature has no sampling parameters; the API has them
    msg = client.messages.create(model=NAME, max_tokens=10, messages=USER, extra_body=greedy)
    expected = strata.generate(model, model.tokenizer.encode(render_chat(CHAT_TEMPLATE, USER)), max_tokens=10)
    assert msg.content[0].text == expected.text and msg.usage.output_tokens == len(expected.tokens)
    with client.messages.stream(model=NAME, max_tokens=10, messages=USER, extra_body=greedy) as stream:
        streamed = "".join(stream.text_stream)
        final = stream.get_final_message()
    assert streamed == expected.text and final.usage.output_tokens == len(expected.tokens)
    assert final.stop_reason == msg.stop_reason
    with pytest.raises(anthropic.BadRequestError, match="top_k"):
        client.messages.create(model=NAME, max_tokens=10, messages=USER, extra_body={"top_k": -3})


def test_tool_call_round_trip_through_both_clients(model):
    said = ['<tool_call>\n{"name": "add", "arguments": {"a": 2, "b": 3}}\n</tool_call>']
    with live_server(make_app(model, generate=scripted(said))) as url:
        oa = openai.OpenAI(base_url=f"{url}/v1", api_key="none", max_retries=0)
        tools = [{"type": "function", "function": {"name": "add", "parameters": {"type": "object"}}}]
        r = oa.chat.completions.create(model=NAME, messages=USER, tools=tools)
        call = r.choices[0].message.tool_calls[0]
        assert (call.function.name, call.function.arguments, r.choices[0].finish_reason) == \
            ("add", '{"a": 2, "b": 3}', "tool_calls")
        follow = USER + [r.choices[0].message.model_dump(exclude_none=True),
                         {"role": "tool", "tool_call_id": call.id, "content": "5"}]
        assert oa.chat.completions.create(model=NAME, messages=follow, tools=tools).choices
        an = anthropic.Anthropic(base_url=url, api_key="none", max_retries=0)
        msg = an.messages.create(model=NAME, max_tokens=20, messages=USER,
                                 tools=[{"name": "add", "input_schema": {"type": "object"}}])
        use = msg.content[0]
        assert (use.type, use.name, use.input, msg.stop_reason) == ("tool_use", "add", {"a": 2, "b": 3}, "tool_use")
        follow = USER + [{"role": "assistant", "content": [use.model_dump()]},
                         {"role": "user", "content": [{"type": "tool_result", "tool_use_id": use.id, "content": "5"}]}]
        assert an.messages.create(model=NAME, max_tokens=20, messages=follow,
                                  tools=[{"name": "add", "input_schema": {"type": "object"}}]).content


def test_a_client_that_leaves_mid_stream_stops_its_generation(model):
    pulled = []
    slow = scripted(["y"] * 300, delay=0.01)

    def counting(*args, **kwargs):
        for r in slow(*args, **kwargs):
            pulled.append(1)
            yield r

    app = make_app(model, generate=counting)
    with live_server(app) as url:
        client = openai.OpenAI(base_url=f"{url}/v1", api_key="none", max_retries=0)
        stream = client.completions.create(model=NAME, prompt="p", max_tokens=300, stream=True)
        for i, _ in enumerate(stream):
            if i == 3:
                break
        stream.close()
        deadline = time.monotonic() + 5
        while app.state.strata.worker.depth and time.monotonic() < deadline:
            time.sleep(0.01)
        assert app.state.strata.worker.depth == 0 and len(pulled) < 30  # stopped, not run to 300
        r = client.completions.create(model=NAME, prompt="q", max_tokens=2)
        assert r.choices[0].text == "yy"
        metrics = httpx.get(f"{url}/metrics").text
        assert "strata_requests_cancelled_total 1" in metrics
