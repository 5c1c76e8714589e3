"""The ASGI app: routes, the error shapes of each API, and the model and worker it serves.

Every failure a client can cause is a 4xx in its API's error JSON on one line, naming the
field; anything else is a 500 with a one-line message (the traceback goes to the server's
log, never to the client), and the server goes on serving.
"""

from __future__ import annotations

import contextlib
import logging
from pathlib import Path

from starlette.applications import Starlette
from starlette.exceptions import HTTPException
from starlette.requests import Request
from starlette.responses import JSONResponse, PlainTextResponse, Response
from starlette.routing import Route

from strata.serve import anthropic, openai
from strata.serve.fields import BODY_TIMEOUT_SECONDS, MAX_BODY_BYTES, ClientLeft, RequestError, read_json
from strata.serve.generation import GenerationFailed
from strata.serve.state import KEEPALIVE_SECONDS, ServerState
from strata.serve.worker import Worker

log = logging.getLogger("strata.serve")

OPENAI, ANTHROPIC = "openai", "anthropic"
ANTHROPIC_TYPES = {400: "invalid_request_error", 401: "authentication_error", 404: "not_found_error",
                   405: "invalid_request_error", 408: "timeout_error", 413: "request_too_large", 500: "api_error"}
CLIENT_CLOSED = 499  # nginx's status for a request its client abandoned (counted; no one reads the response)


def error_response(api: str, status: int, message: str, *, param: str | None = None,
                   code: str | None = None, close: bool = False) -> JSONResponse:
    message = " ".join(message.split())  # one line, always
    if api == ANTHROPIC:
        body = {"type": "error", "error": {"type": ANTHROPIC_TYPES.get(status, "invalid_request_error"),
                                           "message": message}}
    else:
        kind = "server_error" if status >= 500 else "invalid_request_error"
        body = {"error": {"message": message, "type": kind, "param": param, "code": code}}
    # close: the request's body was left unread, so the connection cannot carry another request
    return JSONResponse(body, status_code=status, headers={"connection": "close"} if close else None)


def _api_of(path: str) -> str:
    return ANTHROPIC if path.startswith("/v1/messages") else OPENAI


def _endpoint(state: ServerState, handler, api: str):
    """A POST route: read the JSON body, run `handler`, turn every failure into the API's error."""

    async def route(request: Request) -> Response:
        path = request.url.path
        try:
            body = await read_json(request, state.max_body_bytes, state.body_timeout_seconds)
            response = await handler(state, request, body)
        except RequestError as e:
            response = error_response(api, e.status, e.message, param=e.param, code=e.code, close=e.close)
        except ClientLeft as e:  # the client's doing, not the server's: one line, no traceback
            log.info("client closed the connection mid-body (%s): %s", e, path)
            response = Response(status_code=CLIENT_CLOSED)
        except GenerationFailed as e:
            response = error_response(api, 500, str(e))
        except Exception as e:  # a bug, or the engine failing outside generation: logged, not shown
            log.exception("request failed: %s", path)
            response = error_response(api, 500, f"internal error ({type(e).__name__}); see the server log")
        state.metrics.count_request(path, response.status_code)
        return response

    return route


def build_app(model, config=None, *, name: str | None = None, chat_template: str | None = None,
              keepalive_seconds: float = KEEPALIVE_SECONDS, max_body_bytes: int = MAX_BODY_BYTES,
              body_timeout_seconds: float = BODY_TIMEOUT_SECONDS, generate=None,
              stop: tuple[str, ...] = ()) -> Starlette:
    """The server's app for a loaded `model`, served under `name` (default: the file's stem).

    `config` is the runtime Config every request runs with; `chat_template` replaces the model's
    own; `stop`: stop strings every request has besides its own; `generate` replaces
    `strata.stream_generate` (tests script the model's output with it). A model loaded with
    `max_context` is served with that context.
    A request body over `max_body_bytes` is refused (413), and so is one that goes
    `body_timeout_seconds` without a byte before it is complete (408); both close the connection.
    Run it with uvicorn's `http=strata.serve.protocol.json_errors(...)` (as `strata serve` does) so
    that a request that is not HTTP gets the APIs' error JSON too.
    """
    from strata.config import load_config
    from strata.chat_template import special_tokens_of

    kwargs = {"generate": generate} if generate is not None else {}
    worker = Worker(model, config if config is not None else load_config(), **kwargs)
    state = ServerState(model=model, name=name or Path(model.model_path).stem, worker=worker,
                        chat_template=chat_template or model.tokenizer.chat_template,
                        special_tokens=special_tokens_of(model.model_path), keepalive_seconds=keepalive_seconds,
                        max_body_bytes=max_body_bytes, body_timeout_seconds=body_timeout_seconds,
                        stops=tuple(stop))

    async def health(request: Request) -> Response:
        state.metrics.count_request("/health", 200)
        return JSONResponse({"status": "ok", "model": state.name, "queue": state.worker.depth})

    def model_card(request: Request) -> dict:
        if "anthropic-version" in request.headers:  # the Anthropic client lists models in its own shape
            return {"type": "model", "id": state.name, "display_name": state.name,
                    "created_at": "1970-01-01T00:00:00Z"}
        return {"id": state.name, "object": "model", "created": state.created, "owned_by": "strata",
                "context_length": state.context}

    async def models(request: Request) -> Response:
        state.metrics.count_request("/v1/models", 200)
        card = model_card(request)
        if "anthropic-version" in request.headers:
            return JSONResponse({"data": [card], "has_more": False, "first_id": state.name, "last_id": state.name})
        return JSONResponse({"object": "list", "data": [card]})

    async def one_model(request: Request) -> Response:
        wanted = request.path_params["name"]
        if wanted != state.name:
            return error_response(_api_of("/v1/models"), 404, f"model: {wanted!r} is not served here; this "
                                  f"server serves {state.name!r}", param="model", code="model_not_found")
        return JSONResponse(model_card(request))

    async def metrics(request: Request) -> Response:
        state.metrics.count_request("/metrics", 200)
        return PlainTextResponse(state.metrics.render(queue_depth=state.worker.depth),
                                 media_type="text/plain; version=0.0.4")

    async def http_error(request: Request, exc: HTTPException) -> Response:
        state.metrics.count_request("other", exc.status_code)
        return error_response(_api_of(request.url.path), exc.status_code,
                              f"{request.method} {request.url.path}: {exc.detail}")

    @contextlib.asynccontextmanager
    async def lifespan(app):
        yield
        worker.close()

    routes = [
        Route("/v1/chat/completions", _endpoint(state, openai.chat_completions, OPENAI), methods=["POST"]),
        Route("/v1/completions", _endpoint(state, openai.completions, OPENAI), methods=["POST"]),
        Route("/v1/messages", _endpoint(state, anthropic.messages, ANTHROPIC), methods=["POST"]),
        Route("/v1/messages/count_tokens", _endpoint(state, anthropic.count_tokens, ANTHROPIC), methods=["POST"]),
        Route("/v1/models", models, methods=["GET"]),
        Route("/v1/models/{name:path}", one_model, methods=["GET"]),
        Route("/health", health, methods=["GET"]),
        Route("/metrics", metrics, methods=["GET"]),
    ]
    app = Starlette(routes=routes, exception_handlers={HTTPException: http_error}, lifespan=lifespan)
    app.state.strata = state
    return app
