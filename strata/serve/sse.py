"""Server-sent events and the client's disconnect.

A generation must stop when its client leaves, within a token, and not only when the next
write fails (during a long prefill there is no write to fail). So both kinds of response
watch `receive()` for `http.disconnect` beside the work and cancel it at once: `EventStream`
for streams, `until_disconnect` for a plain JSON response being computed.
"""

from __future__ import annotations

import json
from contextlib import aclosing
from typing import AsyncIterator, Awaitable

import anyio
from starlette.responses import Response

KEEPALIVE_COMMENT = ": keep-alive\n\n"  # SSE comment: clients ignore it, proxies see traffic


def event(data: dict | str, name: str | None = None) -> str:
    """One SSE event (`data` as compact JSON unless already text)."""
    body = data if isinstance(data, str) else json.dumps(data, ensure_ascii=False, separators=(",", ":"))
    return (f"event: {name}\n" if name else "") + f"data: {body}\n\n"


async def _watch(receive, scope) -> None:
    while True:
        message = await receive()
        if message["type"] == "http.disconnect":
            scope.cancel()
            return


class EventStream(Response):
    """`text/event-stream` over an async iterator of formatted events."""

    media_type = "text/event-stream"

    def __init__(self, events: AsyncIterator[str]) -> None:
        self.events = events
        self.status_code = 200
        self.background = None
        self.init_headers({"cache-control": "no-cache", "x-accel-buffering": "no"})

    async def __call__(self, scope, receive, send) -> None:
        async with aclosing(self.events) as events, anyio.create_task_group() as group:
            group.start_soon(_watch, receive, group.cancel_scope)
            try:
                await send({"type": "http.response.start", "status": self.status_code, "headers": self.raw_headers})
                async for chunk in events:
                    await send({"type": "http.response.body", "body": chunk.encode(), "more_body": True})
                await send({"type": "http.response.body", "body": b"", "more_body": False})
            except OSError:  # the client went away between our writes
                pass
            group.cancel_scope.cancel()


async def until_disconnect(receive, work: Awaitable) -> tuple[bool, object]:
    """(True, result) of `work`, or (False, None) when the client disconnected first (the work is
    cancelled). An exception from `work` is raised as itself."""
    outcome: dict = {}

    async def run(scope) -> None:
        try:
            outcome["result"] = await work
        except Exception as e:  # re-raised below, outside the task group (which would wrap it)
            outcome["error"] = e
        scope.cancel()

    async with anyio.create_task_group() as group:
        group.start_soon(_watch, receive, group.cancel_scope)
        await run(group.cancel_scope)
    if "error" in outcome:
        raise outcome["error"]
    return ("result" in outcome), outcome.get("result")
