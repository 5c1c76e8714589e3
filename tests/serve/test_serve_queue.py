"""One engine, one request at a time: FIFO order, concurrent clients get the sequential run's
outputs, a disconnect stops its generation within a token, keep-alives while a request waits,
and a next turn that extends the session reuses its prompt."""

import asyncio
import json

import httpx
from serve_support import NAME, make_app, model_fixture, scripted, sse_events
from starlette.testclient import TestClient

import strata

model = model_fixture()


def _client(app) -> httpx.AsyncClient:
    return httpx.AsyncClient(transport=httpx.ASGITransport(app=app), base_url="http://test", timeout=60)


def test_requests_are_served_in_arrival_order(model):
    log = []
    app = make_app(model, generate=scripted(["a", "b", "c"], delay=0.01, log=log))

    async def main():
        async with _client(app) as c:
            tasks = []
            for i in range(8):
                body = {"model": NAME, "prompt": f"request {i}", "max_tokens": 3}
                tasks.append(asyncio.create_task(c.post("/v1/completions", json=body)))
                await asyncio.sleep(0.005)  # each arrives (and is queued) before the next
            return await asyncio.gather(*tasks)

    responses = asyncio.run(main())
    assert all(r.status_code == 200 for r in responses)
    assert [bytes(t).decode() for t in log] == [f"request {i}" for i in range(8)]
    waits = [r.json()["strata"]["queue_ms"] for r in responses]
    assert waits[-1] > waits[0]  # the last waited behind the others; none jumped the queue


def test_concurrent_clients_get_the_sequential_outputs(model):
    """8 clients x 5 requests at once equal the same requests run one by one through strata.generate."""
    requests = [{"model": NAME, "prompt": f"client {c} asks {k}:", "max_tokens": 6,
                 "temperature": 0.0 if k % 2 else 0.8, "seed": 10 * c + k} for c in range(8) for k in range(5)]
    app = make_app(model)

    async def client(c: httpx.AsyncClient, mine: list[dict]) -> list[str]:
        out = []
        for body in mine:  # each client waits for its answer before asking again
            r = await c.post("/v1/completions", json=body)
            assert r.status_code == 200, r.text
            out.append(r.json()["choices"][0]["text"])
        return out

    async def main():
        async with _client(app) as c:
            return await asyncio.gather(*(client(c, requests[5 * i:5 * i + 5]) for i in range(8)))

    got = [text for texts in asyncio.run(main()) for text in texts]
    expected = [strata.generate(model, b["prompt"], max_tokens=6, temperature=b["temperature"], seed=b["seed"]).text
                for b in requests]
    assert got == expected


def test_a_disconnect_stops_the_generation_within_a_token(model):
    pulled = []
    slow = scripted(["x"] * 200, delay=0.01)

    def counting(*args, **kwargs):
        for r in slow(*args, **kwargs):
            pulled.append(r.generation_tokens)
            yield r

    app = make_app(model, generate=counting)
    state = app.state.strata
    body = json.dumps({"model": NAME, "prompt": "p", "max_tokens": 200, "stream": True}).encode()

    async def main():
        gone = asyncio.Event()
        chunks = []

        async def receive():
            if not chunks:
                chunks.append(b"")  # the body once, then wait for the client to leave
                return {"type": "http.request", "body": body, "more_body": False}
            await gone.wait()
            return {"type": "http.disconnect"}

        async def send(message):
            if message["type"] == "http.response.body" and message.get("body"):
                chunks.append(message["body"])
                if len(chunks) == 6:  # the role chunk and 4 tokens
                    gone.set()

        scope = {"type": "http", "asgi": {"version": "3.0", "spec_version": "2.4"}, "http_version": "1.1",
                 "method": "POST", "scheme": "http", "path": "/v1/completions", "raw_path": b"/v1/completions",
                 "query_string": b"", "headers": [(b"content-type", b"application/json")],
                 "client": ("127.0.0.1", 1), "server": ("127.0.0.1", 8000), "root_path": ""}
        await app(scope, receive, send)
        seen = len(chunks) - 1
        for _ in range(100):  # the worker finishes the token in flight, then drops the job
            if state.worker.depth == 0:
                break
            await asyncio.sleep(0.01)
        return seen

    seen = asyncio.run(main())
    assert state.worker.depth == 0 and state.metrics.cancelled == 1
    assert len(pulled) <= seen + 2, (len(pulled), seen)
    with TestClient(app) as c:  # the next request is served normally
        r = c.post("/v1/completions", json={"model": NAME, "prompt": "q", "max_tokens": 3})
        assert r.json()["choices"][0]["text"] == "xxx"


def test_keepalive_comments_while_waiting_for_the_first_token(model):
    with TestClient(make_app(model, generate=scripted(["slow"], delay=0.3), keepalive_seconds=0.05)) as c:
        r = c.post("/v1/completions", json={"model": NAME, "prompt": "p", "max_tokens": 1, "stream": True})
        assert r.text.count(": keep-alive\n\n") >= 2
        texts = [json.loads(d)["choices"][0]["text"] for _, d in sse_events(r.text)[:-1]]
        assert "".join(texts) == "slow"


def test_a_next_turn_reuses_the_session_and_says_so(model, tmp_path):
    turn = [{"role": "user", "content": "Write a loop."}]
    with TestClient(make_app(model)) as c:
        first = c.post("/v1/chat/completions", json={"model": NAME, "messages": turn, "max_tokens": 8,
                                                     "temperature": 0}).json()
        reply = first["choices"][0]["message"]["content"]
        turn2 = turn + [{"role": "assistant", "content": reply}, {"role": "user", "content": "Shorter."}]
        second = c.post("/v1/chat/completions", json={"model": NAME, "messages": turn2, "max_tokens": 8,
                                                      "temperature": 0}).json()
    cached = second["usage"]["prompt_tokens_details"]["cached_tokens"]
    assert cached >= first["usage"]["prompt_tokens"] and second["strata"]["prompt_reused"] == cached
    fresh = strata.load(model.model_path)  # a new model: an empty session, nothing to reuse
    with TestClient(make_app(fresh)) as c:
        again = c.post("/v1/chat/completions", json={"model": NAME, "messages": turn2, "max_tokens": 8,
                                                     "temperature": 0}).json()
    assert again["usage"]["prompt_tokens_details"]["cached_tokens"] == 0
    assert again["choices"][0]["message"]["content"] == second["choices"][0]["message"]["content"]
