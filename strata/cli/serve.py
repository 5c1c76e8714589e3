"""`strata serve [MODEL]`: the OpenAI- and Anthropic-compatible HTTP server (strata.serve)."""

from __future__ import annotations

import argparse
import ipaddress
import sys

from strata.cli.runtime_flags import add_runtime_flags, config_from_args

HELP = """\
Serve a model over HTTP with OpenAI's and Anthropic's APIs: POST /v1/chat/completions,
/v1/completions and /v1/messages (streamed with stream: true), GET /v1/models, /health and
/metrics (Prometheus). Without MODEL the embedded default model is served. One engine per
process: requests queue and run one at a time, and a prompt that extends the previous one
(the next turn of a chat) reuses its cached prefix. Binds to loopback unless --host says
otherwise; there is no authentication. Every generate runtime flag applies to every request.

examples:
  strata serve                                    the embedded model on http://127.0.0.1:8000
  strata serve /data/qwen3.gguf --arena 8GB --prefetch 16
  strata serve model.gguf --port 9000 --name qwen3 --chat-template chat.jinja
  strata serve --ctx 512 --stop '\\n\\n'              a 512-position context; every reply ends at a blank line
  curl -s localhost:8000/v1/completions -H 'content-type: application/json' \\
       -d '{"model": "default", "prompt": "def add(a, b):", "max_tokens": 32, "temperature": 0}'
  OPENAI_BASE_URL=http://127.0.0.1:8000/v1 OPENAI_API_KEY=none python my_client.py
"""


def add_parser(sub, name: str) -> None:
    p = sub.add_parser(name, help="serve a model over OpenAI- and Anthropic-compatible HTTP", description=HELP,
                       formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("model", nargs="?", metavar="MODEL",
                   help="model path, `default` or a hub id (default: the embedded model)")
    p.add_argument("--host", default="127.0.0.1", help="address to bind (default 127.0.0.1: this machine only)")
    p.add_argument("--port", type=int, default=8000, help="port (default 8000)")
    p.add_argument("--name", help="the model id clients send as `model` (default: the file's stem)")
    p.add_argument("--chat-template", metavar="FILE", help="a Jinja chat template to use instead of the model's")
    p.add_argument("--stop", action="append", default=[], metavar="TEXT",
                   help="a stop string every request has besides its own (repeatable; \\n is a newline)")
    p.add_argument("--ctx", type=int, default=None, metavar="N",
                   help="serve the model with a context of N positions (default: the model's); longer prompts "
                        "are refused (context_length_exceeded)")
    p.add_argument("--log-level", default="info", choices=["critical", "error", "warning", "info", "debug"],
                   help="uvicorn's log level (default info)")
    add_runtime_flags(p)
    p.set_defaults(run=run)


def _loopback(host: str) -> bool:
    if host == "localhost":
        return True
    try:
        return ipaddress.ip_address(host).is_loopback
    except ValueError:
        return False


def run(args: argparse.Namespace) -> int:
    from strata.default_model import default_model_path
    from strata.api_args import check_count
    from strata.cli.sampling_flags import flag_error, stop_strings
    from strata.errors import ConfigError, StrataError
    from strata.generate import generate
    from strata.loader import load

    try:
        import uvicorn

        from strata.serve import build_app
    except ImportError as e:
        raise StrataError(f"strata serve needs {e.name}: pip install starlette uvicorn") from None
    if args.report_json:
        raise StrataError("--report-json does not apply to serve: every response carries its stream report "
                          "in its `strata` field")
    if not 0 < args.port < 65536:
        raise StrataError(f"--port must be in 1..65535, got {args.port}")
    config = config_from_args(args)
    stops = stop_strings(args.stop)
    if args.ctx is not None:
        try:
            check_count("max_context", args.ctx, minimum=2)
        except ConfigError as e:
            raise flag_error(e) from None
    template = None
    if args.chat_template:
        try:
            with open(args.chat_template, encoding="utf-8") as f:
                template = f.read()
        except OSError as e:
            raise StrataError(f"--chat-template: {args.chat_template}: {e.strerror}") from None
    try:
        model = load(args.model if args.model else default_model_path(announce=True), max_context=args.ctx)
    except ConfigError as e:
        raise flag_error(e) from None
    # One token before listening: a configuration the engine refuses (an arena too small for a
    # window) fails here, as `error: ...`, not as a 500 on every request.
    generate(model, model.tokenizer.encode("\n") or [0], max_tokens=1, config=config)
    app = build_app(model, config, name=args.name, chat_template=template, stop=stops)
    name = app.state.strata.name
    if not _loopback(args.host):
        print(f"warning: listening on {args.host}, reachable from other machines; strata serve has no "
              "authentication", file=sys.stderr)
    print(f"serving {name!r} on http://{args.host}:{args.port}/v1 (OpenAI and Anthropic APIs; /metrics)",
          file=sys.stderr)
    if not app.state.strata.chat_template:
        print(f"note: {name!r} has no chat template: only /v1/completions is available (chat and messages "
              "answer 400); give one with --chat-template FILE", file=sys.stderr)
    from strata.serve.protocol import json_errors

    uvicorn.run(app, host=args.host, port=args.port, log_level=args.log_level, http=json_errors())
    return 0
