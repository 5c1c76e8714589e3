"""Reading a request: the body as one JSON object, then each field once, with its type and range.

Every problem is a `RequestError` whose message names the field, so a client sees
`max_tokens: must be an integer >= 1, got -5` instead of a traceback. `Fields.finish()` turns
whatever was not read into an error: an unknown or misspelt field is refused, not ignored,
and a known API field strata does not implement is refused unless it has its neutral value.
"""

from __future__ import annotations

import asyncio
import json
from typing import Any

from starlette.requests import ClientDisconnect

MAX_BODY_BYTES = 4 * 1024 * 1024  # a 200k-token conversation is ~1 MB of JSON; larger is refused (413)
# Seconds a request body may go without a byte before it is refused (408, the connection closed):
# a Content-Length larger than what was sent, or a chunk declared and never finished, otherwise
# holds its connection forever (nginx's client_body_timeout is 60 s between reads; a client on
# loopback sends a 4 MB body in milliseconds).
BODY_TIMEOUT_SECONDS = 30.0


class RequestError(Exception):
    """A request strata will not serve: HTTP `status`, a one-line message, the field at fault."""

    def __init__(self, message: str, *, param: str | None = None, status: int = 400,
                 code: str | None = None, close: bool = False) -> None:
        super().__init__(message)
        self.message = message
        self.param = param
        self.status = status
        self.code = code
        self.close = close  # the connection cannot carry another request (a body left unread)


class ClientLeft(Exception):
    """The client closed its connection before its request body was complete: a client event
    (logged as such), not a failure of the server."""


async def read_body(request, limit: int = MAX_BODY_BYTES, timeout: float = BODY_TIMEOUT_SECONDS) -> bytes:
    """The request body: 413 past `limit` bytes (checked while reading), 408 when no byte comes
    for `timeout` seconds; ClientLeft when the client goes away before the end."""
    declared = request.headers.get("content-length")
    if declared is not None and declared.isdigit() and int(declared) > limit:
        raise RequestError(f"body: {int(declared)} bytes is over the limit of {limit}", status=413, close=True)
    chunks, size = [], 0
    stream = request.stream().__aiter__()
    while True:
        try:
            chunk = await asyncio.wait_for(stream.__anext__(), timeout)
        except StopAsyncIteration:
            return b"".join(chunks)
        except asyncio.TimeoutError:
            raise RequestError(f"body: no byte for {timeout:g} s after {size} bytes, before the body was complete "
                               "(a Content-Length larger than the body sent, or a chunk never finished); "
                               "the connection is closed", status=408, code="body_timeout", close=True) from None
        except ClientDisconnect:
            raise ClientLeft(f"after {size} bytes") from None
        size += len(chunk)
        if size > limit:
            raise RequestError(f"body: over the limit of {limit} bytes", status=413, close=True)
        chunks.append(chunk)


async def read_json(request, limit: int = MAX_BODY_BYTES, timeout: float = BODY_TIMEOUT_SECONDS) -> dict:
    """The request body as a JSON object (read_body's limits)."""
    raw = await read_body(request, limit, timeout)
    if not raw.strip():
        raise RequestError("body: empty; expected a JSON object")
    try:
        text = raw.decode("utf-8")
    except UnicodeDecodeError as e:
        raise RequestError(f"body: not valid UTF-8 (byte {e.start})") from None
    try:
        obj = json.loads(text, parse_constant=_reject_constant)
    except json.JSONDecodeError as e:
        raise RequestError(f"body: malformed JSON ({e.msg} at line {e.lineno} column {e.colno})") from None
    except ValueError as e:
        raise RequestError(f"body: {e}") from None
    except RecursionError:
        raise RequestError("body: nested too deeply") from None
    try:  # JSON escapes can spell lone UTF-16 surrogates ("\ud800"), which no tokenizer takes
        json.dumps(obj, ensure_ascii=False).encode("utf-8")
    except UnicodeEncodeError:
        raise RequestError("body: a string holds a lone surrogate escape (\\ud800-\\udfff); not valid Unicode") \
            from None
    if not isinstance(obj, dict):
        raise RequestError(f"body: expected a JSON object, got {_kind(obj)}")
    return obj


def _reject_constant(name: str):
    raise ValueError(f"{name} is not JSON")


def _kind(value: Any) -> str:
    if value is None:
        return "null"
    if isinstance(value, bool):
        return "a boolean"
    if isinstance(value, (int, float)):
        return "a number"
    if isinstance(value, str):
        return "a string"
    return "an array" if isinstance(value, list) else "an object"


_MISSING = object()


class Fields:
    """The fields of one JSON object, read by name with a type and range; `where` prefixes names
    (`messages[2].content`)."""

    def __init__(self, obj: Any, where: str = "") -> None:
        if not isinstance(obj, dict):
            raise RequestError(f"{where or 'body'}: expected an object, got {_kind(obj)}", param=where or None)
        self._obj = obj
        self._where = where
        self._read: set[str] = set()

    def name(self, key: str) -> str:
        return f"{self._where}.{key}" if self._where else key

    def error(self, key: str, message: str) -> RequestError:
        return RequestError(f"{self.name(key)}: {message}", param=self.name(key))

    def raw(self, key: str, default: Any = _MISSING) -> Any:
        """The value as sent (None when absent and no default); `default=_MISSING` makes it required."""
        self._read.add(key)
        value = self._obj.get(key)
        if value is None:
            if default is _MISSING:
                raise self.error(key, "required")
            return default
        return value

    def has(self, key: str) -> bool:
        return self._obj.get(key) is not None

    def int(self, key: str, default: Any = _MISSING, *, lo: int | None = None, hi: int | None = None) -> int:
        if not self.has(key):
            return self.raw(key, default)
        value = self.raw(key)
        if isinstance(value, float) and value.is_integer():
            value = int(value)
        if isinstance(value, bool) or not isinstance(value, int) or (lo is not None and value < lo) \
                or (hi is not None and value > hi):
            raise self.error(key, f"must be an integer{_range(lo, hi)}, got {json.dumps(value)[:40]}")
        return value

    def number(self, key: str, default: Any = _MISSING, *, lo: float | None = None,
               hi: float | None = None) -> float:
        if not self.has(key):
            return self.raw(key, default)
        value = self.raw(key)
        if isinstance(value, bool) or not isinstance(value, (int, float)) or (lo is not None and value < lo) \
                or (hi is not None and value > hi):
            raise self.error(key, f"must be a number{_range(lo, hi)}, got {json.dumps(value)[:40]}")
        return float(value)

    def bool(self, key: str, default: Any = _MISSING) -> bool:
        if not self.has(key):
            return self.raw(key, default)
        value = self.raw(key)
        if not isinstance(value, bool):
            raise self.error(key, f"must be true or false, got {_kind(value)}")
        return value

    def str(self, key: str, default: Any = _MISSING) -> str:
        if not self.has(key):
            return self.raw(key, default)
        value = self.raw(key)
        if not isinstance(value, str):
            raise self.error(key, f"must be a string, got {_kind(value)}")
        return value

    def list(self, key: str, default: Any = _MISSING, *, nonempty: bool = False) -> list:
        if not self.has(key):
            return self.raw(key, default)
        value = self.raw(key)
        if not isinstance(value, list):
            raise self.error(key, f"must be an array, got {_kind(value)}")
        if nonempty and not value:
            raise self.error(key, "must not be empty")
        return value

    def object(self, key: str, default: Any = _MISSING) -> "Fields":
        value = self.raw(key, default)
        return Fields(value, self.name(key))

    def strings(self, key: str, *, most: int, single: bool = True) -> tuple[str, ...]:
        """A string or an array of at most `most` non-empty strings (stop sequences); single=False:
        an array only (an API whose field is an array: a bare string is a client's mistake)."""
        value = self.raw(key, ())
        items = [value] if isinstance(value, str) and single else value
        if not isinstance(items, (list, tuple)) or not all(isinstance(s, str) and s for s in items):
            wanted = "a non-empty string or an array of them" if single else "an array of non-empty strings"
            raise self.error(key, f"must be {wanted}, got {_kind(value)}" if not isinstance(value, list)
                             else f"must be {wanted}")
        if len(items) > most:
            raise self.error(key, f"at most {most} entries, got {len(items)}")
        return tuple(items)

    def neutral(self, key: str, *allowed: Any) -> None:
        """A known API field strata does not implement: accepted only with a neutral value."""
        value = self.raw(key, None)
        if value is not None and value not in allowed:
            shown = " or ".join(json.dumps(a) for a in allowed) or "absent"
            raise RequestError(f"{self.name(key)}: not supported by strata (send {shown} or leave it out)",
                               param=self.name(key), code="unsupported_parameter")

    def ignore(self, *keys: str) -> None:
        """Fields with no effect on generation (user ids, metadata): accepted and dropped."""
        self._read.update(keys)

    def finish(self) -> None:
        """Refuse the fields not read. A null counts as absent (client libraries send nulls for
        unset optional fields, and echo response blocks back with them)."""
        unknown = sorted(k for k, v in self._obj.items() if k not in self._read and v is not None)
        if unknown:
            raise RequestError(f"{self.name(unknown[0])}: unknown field", param=self.name(unknown[0]),
                               code="unknown_parameter")


def _range(lo, hi) -> str:
    if lo is not None and hi is not None:
        return f" in [{lo}, {hi}]"
    if lo is not None:
        return f" >= {lo}"
    return f" <= {hi}" if hi is not None else ""
