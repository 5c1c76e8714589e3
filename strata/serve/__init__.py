"""`strata serve`: OpenAI- and Anthropic-compatible HTTP endpoints over one loaded model.

    build_app(model, config) -> a Starlette app (run it with uvicorn; `strata serve` does)

One model, one engine, one arena per process: requests queue FIFO and run one at a time, and
the engine's session is the prompt cache (docs/serve.md).
"""

from strata.serve.app import build_app

__all__ = ["build_app"]
