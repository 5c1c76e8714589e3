"""The connection level, over a raw socket to a live uvicorn server on 127.0.0.1: a body that
never completes is refused within the body timeout and its connection closed (408, the API's
JSON error), a client that leaves mid-body is a logged client event (no traceback), and a
request that is not HTTP gets an error JSON both APIs read. Every socket wait is bounded."""

from __future__ import annotations

import json
import logging
import socket
import time

import pytest
from serve_support import NAME, live_server, make_app, model_fixture

model = model_fixture()

BODY_TIMEOUT = 0.5  # the server's wait between body bytes in these tests
SOCKET_TIMEOUT = 10.0  # a hang fails the test instead of holding it


@pytest.fixture(scope="module")
def server(model):
    with live_server(make_app(model, body_timeout_seconds=BODY_TIMEOUT)) as url:
        yield int(url.rsplit(":", 1)[1])


def exchange(port: int, data: bytes, *, close_after: bool = False) -> tuple[bytes, float]:
    """Send `data`, then read until the server closes the connection: (all it sent, seconds)."""
    start = time.monotonic()
    with socket.create_connection(("127.0.0.1", port), timeout=SOCKET_TIMEOUT) as s:
        s.sendall(data)
        if close_after:
            return b"", 0.0
        got = b""
        while chunk := s.recv(65536):  # b"": the server closed it
            got += chunk
    return got, time.monotonic() - start


def response(raw: bytes) -> tuple[int, dict[str, str], dict]:
    head, _, body = raw.partition(b"\r\n\r\n")
    lines = head.decode("latin-1").split("\r\n")
    headers = dict(line.split(": ", 1) for line in lines[1:])
    return int(lines[0].split()[1]), {k.lower(): v for k, v in headers.items()}, json.loads(body)


def post_head(path: str, extra: str) -> bytes:
    return f"POST {path} HTTP/1.1\r\nhost: 127.0.0.1\r\ncontent-type: application/json\r\n{extra}\r\n".encode()


BODY = json.dumps({"model": NAME, "messages": [{"role": "user", "content": "hi"}], "max_tokens": 2}).encode()


@pytest.mark.parametrize("path", ["/v1/chat/completions", "/v1/messages"])
def test_a_content_length_larger_than_the_body_is_refused_within_the_timeout(server, path):
    raw, seconds = exchange(server, post_head(path, f"content-length: {len(BODY) + 100}\r\n") + BODY)
    status, headers, body = response(raw)
    assert status == 408 and headers["connection"] == "close"
    assert "no byte for 0.5 s" in (body["error"]["message"])
    assert seconds < BODY_TIMEOUT + 5
    if path == "/v1/messages":
        assert body["type"] == "error" and body["error"]["type"] == "timeout_error"


def test_a_huge_chunk_declared_and_never_sent_is_refused_within_the_timeout(server):
    head = post_head("/v1/chat/completions", "transfer-encoding: chunked\r\n")
    raw, seconds = exchange(server, head + b"80000000\r\n" + BODY[:10])  # a 2 GiB chunk, 10 bytes of it
    status, headers, body = response(raw)
    assert status == 408 and headers["connection"] == "close" and "before the body was complete" in \
        body["error"]["message"]
    assert seconds < BODY_TIMEOUT + 5


def test_a_client_leaving_mid_body_is_a_client_event_not_a_traceback(server, caplog):
    caplog.set_level(logging.INFO, logger="strata.serve")
    exchange(server, post_head("/v1/chat/completions", "content-length: 1000\r\n") + BODY[:20], close_after=True)
    deadline = time.monotonic() + SOCKET_TIMEOUT
    while not any("mid-body" in r.getMessage() for r in caplog.records) and time.monotonic() < deadline:
        time.sleep(0.02)
    events = [r for r in caplog.records if r.name == "strata.serve"]
    assert any(r.levelno == logging.INFO and "client closed the connection mid-body (after 20 bytes)" in
               r.getMessage() for r in events), [r.getMessage() for r in events]
    assert not any(r.levelno >= logging.ERROR or r.exc_info for r in events)


@pytest.mark.parametrize("data", [b"GARBAGE\r\n\r\n", b"POST /v1/messages HTTP/1.1\r\nhost: x\r\ncontent-length: nope\r\n\r\n",
                                  post_head("/v1/chat/completions", "transfer-encoding: chunked\r\n") + b"zz\r\n"])
def test_a_request_that_is_not_http_gets_an_error_json_both_apis_read(server, data):
    raw, _ = exchange(server, data)
    status, headers, body = response(raw)
    assert status == 400 and headers["content-type"] == "application/json" and headers["connection"] == "close"
    assert body["type"] == "error" and body["error"]["type"] == "invalid_request_error"  # Anthropic's shape
    assert body["error"]["message"].startswith("request: not valid HTTP/1.1")  # OpenAI reads error.message


def test_the_server_goes_on_serving(server):
    raw, _ = exchange(server, post_head("/v1/chat/completions", f"content-length: {len(BODY)}\r\nconnection: close\r\n")
                      + BODY)
    status, _, body = response(raw)
    assert status == 200 and body["object"] == "chat.completion"
