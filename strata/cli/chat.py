"""`strata chat [MODEL]`: an interactive conversation in the terminal, streamed token by token.

The conversation is a list of messages rendered by the model's chat template on every turn; the
model keeps its session across turns, so each turn prefills only what the template added since
the last one (the reply and the new user text). When the conversation no longer fits the context
(`--ctx`, or the model's), the oldest turns are dropped, the system prompt kept, and the chat
says so; a single message too long for the context is refused and the conversation goes on.
"""

from __future__ import annotations

import argparse
import sys

from strata.cli.runtime_flags import add_runtime_flags, config_from_args
from strata.cli.sampling_flags import add_sampling_flags, check_sampling, flag_error, sampling_options, stop_strings

HELP = """\
Chat with a model in the terminal: type a message, the reply streams back; the conversation
(and --system, the system prompt) goes through the model's chat template on every turn. The
embedded model's template frames turns as Python comments (docs/model-card.md); a model without
a template needs --chat-template FILE. Sampling flags as `strata generate` (the embedded model
samples by default, other models are greedy).

commands: /reset forgets the conversation (the system prompt stays), /history shows it,
/system TEXT sets the system prompt (and resets), /quit or Ctrl-D ends; Ctrl-C stops a reply.
When the conversation outgrows the context (--ctx or the model's), the oldest turns are dropped.

examples:
  strata chat                                      the embedded model
  strata chat /data/qwen3.gguf --system "Be brief." --temp 0.7 --top-p 0.9
  strata chat model.gguf --chat-template chat.jinja --arena 8GB"""

PROMPT = ">>> "
DEFAULT_REPLY_TOKENS = 256
COMMANDS = ("/reset", "/history", "/system", "/quit", "/exit", "/help")


def add_parser(sub, name: str) -> None:
    p = sub.add_parser(name, help="chat with a model in the terminal (history, system prompt, /reset)",
                       description=HELP, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("model", nargs="?", metavar="MODEL", help="model path or hub id (default: the embedded model)")
    p.add_argument("--system", metavar="TEXT", help="the system prompt (first message of every conversation)")
    p.add_argument("-n", "--max-tokens", type=int, default=DEFAULT_REPLY_TOKENS,
                   help=f"most tokens a reply may have (default {DEFAULT_REPLY_TOKENS})")
    p.add_argument("--chat-template", metavar="FILE", help="a Jinja chat template to use instead of the model's")
    p.add_argument("--quiet", action="store_true", help="no statistics line after each reply")
    add_sampling_flags(p)
    add_runtime_flags(p)
    p.set_defaults(run=run)


def run(args: argparse.Namespace) -> int:
    from strata.api_args import check_count
    from strata.cli.generate import is_embedded
    from strata.default_model import default_model_path
    from strata.errors import ConfigError
    from strata.loader import load

    embedded = is_embedded(args.model)
    config = config_from_args(args)
    options = sampling_options(args, demo=embedded and not config.suffix_draft)  # as generate's
    try:
        check_count("max_tokens", args.max_tokens, minimum=1)
        if args.ctx is not None:
            check_count("max_context", args.ctx, minimum=2)
    except ConfigError as e:
        raise flag_error(e) from None
    check_sampling(options)
    options["stop"] = stop_strings(args.stop)
    if args.report_json:
        raise ConfigError("--report-json does not apply to chat (a conversation has no one report)")
    template = _template_file(args.chat_template)
    model = load(default_model_path(announce=True) if embedded else args.model, max_context=args.ctx)
    template = template or model.tokenizer.chat_template
    if not template:
        raise ConfigError(f"{model.model_path}: the model has no chat template; give one with --chat-template FILE")
    chat = Conversation(model, template, system=args.system)
    with model:
        return _loop(chat, args, options, config)


def _template_file(path: str | None) -> str | None:
    from strata.errors import ConfigError

    if not path:
        return None
    try:
        with open(path, encoding="utf-8") as f:
            return f.read()
    except OSError as e:
        raise ConfigError(f"--chat-template: {path}: {e.strerror}") from None


class Conversation:
    """The messages so far and their prompt: the chat template's rendering, tokenized as
    `generate --chat` does, cut to fit the context by dropping the oldest turns."""

    def __init__(self, model, template: str, *, system: str | None) -> None:
        from strata.chat_template import special_tokens_of

        self.model, self.template, self.system = model, template, system
        self.special_tokens = special_tokens_of(model.model_path)
        self.turns: list[dict] = []  # user and assistant messages, oldest first

    def messages(self) -> list[dict]:
        head = [{"role": "system", "content": self.system}] if self.system else []
        return head + self.turns

    def reset(self) -> None:
        self.turns = []

    def prompt(self, room: int) -> tuple[list[int], int]:
        """The prompt tokens of the conversation with `room` positions left for the reply, and
        how many of the oldest turns were dropped for it (from self.turns too). Raises ConfigError
        when the newest user message alone does not fit."""
        from strata.errors import ConfigError

        limit = self.model.cfg.max_context
        head = [{"role": "system", "content": self.system}] if self.system else []
        alone = self._tokens(head + self.turns[-1:])
        if len(alone) + room > limit:  # the newest message cannot fit however much is dropped
            self.turns.pop()
            raise ConfigError(f"this message is {len(alone)} tokens with the template; with {room} for the reply "
                              f"it does not fit the context of {limit} (shorten it, or lower --max-tokens)")
        dropped = 0
        while True:
            tokens = self._tokens(self.messages())
            if len(tokens) + room <= limit:
                return tokens, dropped
            # drop the oldest exchange (a user turn and the reply to it)
            cut = 2 if len(self.turns) > 2 and self.turns[1]["role"] == "assistant" else 1
            self.turns = self.turns[cut:]
            dropped += cut

    def _tokens(self, messages: list[dict]) -> list[int]:
        from strata.chat_template import render_chat

        text = render_chat(self.template, messages, special_tokens=self.special_tokens)
        return self.model.tokenizer.encode(text)  # the template holds any BOS


def _read(prompt: str) -> str | None:
    try:
        return input(prompt)
    except EOFError:
        return None


def _loop(chat: Conversation, args: argparse.Namespace, options: dict, config) -> int:
    from strata.errors import StrataError
    from strata.generate import stream_generate

    try:
        import readline  # noqa: F401  (line editing and history for input(), where the platform has it)
    except ImportError:
        pass
    out, err = sys.stdout, sys.stderr
    print(f"chatting with {chat.model.model_path.stem} (/help for commands, Ctrl-D to quit)", file=err)
    while True:
        line = _read(PROMPT)
        if line is None or line.strip() in ("/quit", "/exit"):
            out.write("\n" if line is None else "")
            return 0
        text = line.strip()
        if not text:
            continue
        if text.startswith("/") and text.split()[0] in COMMANDS:
            _command(chat, text, err)
            continue
        chat.turns.append({"role": "user", "content": line})
        room = min(args.max_tokens, chat.model.cfg.max_context - 1)
        try:
            tokens, dropped = chat.prompt(room)
        except StrataError as e:
            print(f"error: {e}", file=err)
            continue
        if dropped:
            print(f"[the conversation outgrew the context of {chat.model.cfg.max_context}: dropped the "
                  f"{dropped} oldest messages]", file=err)
        pieces, last = [], None
        try:
            for last in stream_generate(chat.model, tokens, max_tokens=room, config=config, **options):
                pieces.append(last.text)
                out.write(last.text)
                out.flush()
        except KeyboardInterrupt:
            print("\n[stopped]", file=err)
        out.write("\n")
        out.flush()
        chat.turns.append({"role": "assistant", "content": "".join(pieces)})
        if last is not None and not args.quiet:
            print(f"[{last.prompt_tokens} prompt tokens ({last.prompt_reused} reused), {last.generation_tokens} "
                  f"generated at {last.generation_tps:.1f} tok/s, finish: {last.finish_reason}]", file=err)


def _command(chat: Conversation, text: str, err) -> None:
    word, _, rest = text.partition(" ")
    if word == "/reset":
        chat.reset()
        print("[conversation cleared" + (": the system prompt stays]" if chat.system else "]"), file=err)
    elif word == "/system":
        chat.system = rest.strip() or None
        chat.reset()
        print(f"[system prompt {'set' if chat.system else 'cleared'}; conversation cleared]", file=err)
    elif word == "/history":
        messages = chat.messages()
        if not messages:
            print("[the conversation is empty]", file=err)
        for m in messages:
            print(f"{m['role']}: {m['content']}", file=err)
    else:
        print("/reset forget the conversation (the system prompt stays) · /history show it · /system TEXT set "
              "the system prompt · /quit end (or Ctrl-D); Ctrl-C stops a reply", file=err)
