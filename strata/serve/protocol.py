"""The HTTP protocol `strata serve` runs uvicorn with: uvicorn's own, except that a request that
is not valid HTTP/1.1 (a malformed request line or header, a bad chunk size, an unsupported
upgrade) is answered in the APIs' error JSON instead of uvicorn's plain text.

Such a request is refused before its path is known, so the body fits both APIs at once:
`{"type": "error", "error": {"type": "invalid_request_error", "message": ..., "param": null,
"code": "invalid_http"}}` is Anthropic's error shape and OpenAI's (`error.message`, `error.type`).
uvicorn builds this answer in `send_400_response(msg)` (the h11, httptools and zttp protocols
alike); the subclass replaces that one method and writes the response itself, as the httptools
protocol does, then closes the connection.
"""

from __future__ import annotations

import json

__all__ = ["json_errors", "protocol_error_body"]


def protocol_error_body(message: str) -> bytes:
    """The JSON both APIs read as an error, for a request that is not HTTP."""
    return json.dumps({"type": "error", "error": {"type": "invalid_request_error", "message": message,
                                                  "param": None, "code": "invalid_http"}}).encode("utf-8")


def json_errors(base: type | None = None) -> type:
    """uvicorn's HTTP protocol class (`base`, default the one uvicorn's `http="auto"` picks) with
    the APIs' error JSON for requests that are not HTTP. Pass it as `uvicorn.run(app, http=...)`."""
    if base is None:
        from uvicorn.protocols.http.auto import AutoHTTPProtocol

        base = AutoHTTPProtocol

    class JsonErrorsProtocol(base):
        def send_400_response(self, msg: str) -> None:
            body = protocol_error_body(f"request: not valid HTTP/1.1 ({msg.rstrip('.')}); the connection is closed")
            head = (b"HTTP/1.1 400 Bad Request\r\ncontent-type: application/json\r\n"
                    b"content-length: " + str(len(body)).encode("ascii") + b"\r\nconnection: close\r\n\r\n")
            self.transport.write(head + body)
            self.transport.close()

    JsonErrorsProtocol.__name__ = JsonErrorsProtocol.__qualname__ = f"JsonErrors{base.__name__}"
    return JsonErrorsProtocol
