"""What every endpoint shares: the one model, its worker, the counters, and request checks that
do not depend on the API (model name, prompt rendering, the context limit)."""

from __future__ import annotations

import time
from dataclasses import dataclass, field

from strata.errors import ConfigError
from strata.serve.fields import BODY_TIMEOUT_SECONDS, MAX_BODY_BYTES, Fields, RequestError
from strata.serve.metrics import Metrics
from strata.serve.worker import Worker

KEEPALIVE_SECONDS = 10.0  # SSE comment while a request queues or prefills: proxies drop streams idle ~60 s


@dataclass
class ServerState:
    model: object  # strata.Model
    name: str  # the model id clients name in requests
    worker: Worker
    chat_template: str | None  # the model's own unless the server was given one
    special_tokens: dict[str, str] = field(default_factory=dict)  # bos_token, eos_token, ... for the template
    stops: tuple[str, ...] = ()  # the server's stop strings (`serve --stop`), added to every request's
    metrics: Metrics = field(default_factory=Metrics)
    keepalive_seconds: float = KEEPALIVE_SECONDS
    max_body_bytes: int = MAX_BODY_BYTES
    body_timeout_seconds: float = BODY_TIMEOUT_SECONDS  # a request body's longest wait between bytes
    created: int = field(default_factory=lambda: int(time.time()))

    @property
    def context(self) -> int:
        """The model's context, or what `serve --ctx` (load's max_context) held it to."""
        return self.model.cfg.max_context

    def check_model(self, f: Fields) -> None:
        name = f.str("model")
        if name != self.name:
            raise RequestError(f"model: {name!r} is not served here; this server serves {self.name!r}",
                               param="model", status=404, code="model_not_found")

    def chat_tokens(self, messages: list[dict], tools: list[dict] | None, *, where: str = "messages") -> list[int]:
        """The prompt of a conversation: the chat template's text, tokenized as `generate --chat` does
        (no added special tokens: the template holds any BOS)."""
        from strata.chat_template import render_chat

        if not self.chat_template:
            raise RequestError(f"{where}: the model has no chat template; use /v1/completions, or start the server "
                               "with --chat-template FILE", param=where)
        try:
            text = render_chat(self.chat_template, messages, tools=tools, special_tokens=self.special_tokens)
        except ConfigError as e:  # the template's own raise_exception (roles must alternate, ...)
            raise RequestError(f"{where}: {e}", param=where) from None
        except Exception as e:  # a template that trips over these messages (None + str, ...)
            raise RequestError(f"{where}: the chat template failed on these messages ({type(e).__name__}: {e})",
                               param=where) from None
        return self.model.tokenizer.encode(text)

    def text_tokens(self, text: str) -> list[int]:
        """A plain prompt, tokenized as `strata.generate(model, text)` does (with the tokenizer's BOS)."""
        return self.model.tokenizer.encode(text, add_special_tokens=True)

    def check_prompt(self, tokens: list[int], where: str) -> None:
        if not tokens:
            raise RequestError(f"{where}: the prompt is empty", param=where)
        if len(tokens) >= self.context:
            raise RequestError(f"{where}: the prompt is {len(tokens)} tokens; the model's context is {self.context}",
                               param=where, code="context_length_exceeded")
