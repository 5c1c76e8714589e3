"""The tokenizer of a checkpoint: `tokenizer.json` (the `tokenizers` library's file, stored
verbatim in the GGUF), the chat template and the special-token strings templates refer to.

The chat template is read where transformers looks for it, in its order: `chat_template.jinja`
(what transformers 5 writes), `chat_template.json`, then `tokenizer_config.json`'s
`chat_template` (a string, or a list of named templates of which "default" is taken).
"""

from __future__ import annotations

import json
from dataclasses import dataclass, field
from pathlib import Path

from strata.errors import ConfigError, FormatError
from strata.tokenizer import Tokenizer

TOKENIZER_JSON = "tokenizer.json"
TOKENIZER_CONFIG = "tokenizer_config.json"
CHAT_TEMPLATE_JINJA = "chat_template.jinja"
CHAT_TEMPLATE_JSON = "chat_template.json"
SPECIAL_TOKEN_KEYS = ("bos_token", "eos_token", "unk_token", "pad_token")
DEFAULT_TEMPLATE_NAME = "default"


@dataclass(frozen=True)
class TokenizerFiles:
    tokenizer_json: str
    vocab_size: int  # ids the tokenizer can produce, added tokens included
    chat_template: str | None
    special_tokens: dict[str, str] = field(default_factory=dict)  # bos_token etc. -> its text


def _json(path: Path) -> dict:
    try:
        d = json.loads(path.read_text(encoding="utf-8"))
    except (OSError, UnicodeDecodeError, json.JSONDecodeError) as e:
        raise FormatError(f"{path}: unreadable ({type(e).__name__}: {' '.join(str(e).split())})") from None
    if not isinstance(d, dict):
        raise FormatError(f"{path}: not a JSON object")
    return d


def _token_text(v) -> str | None:
    """A special token as tokenizer_config.json spells it: a string or an AddedToken dict."""
    if isinstance(v, dict):
        v = v.get("content")
    return v if isinstance(v, str) else None


def _template(v, source: Path) -> str | None:
    if v is None or isinstance(v, str):
        return v
    if isinstance(v, list):
        named = {t.get("name"): t.get("template") for t in v if isinstance(t, dict)}
        if DEFAULT_TEMPLATE_NAME in named:
            return named[DEFAULT_TEMPLATE_NAME]
        raise ConfigError(f"{source}: chat_template lists {sorted(map(str, named))} but no {DEFAULT_TEMPLATE_NAME!r}")
    raise FormatError(f"{source}: chat_template must be a string or a list of named templates")


def read_tokenizer_files(directory: str | Path) -> TokenizerFiles:
    d = Path(directory)
    path = d / TOKENIZER_JSON
    try:
        text = path.read_text(encoding="utf-8")
    except FileNotFoundError:
        raise FormatError(f"{d}: no {TOKENIZER_JSON} (only tokenizers in the `tokenizers` library's format are "
                          "supported; transformers' fast tokenizers save it)") from None
    except (OSError, UnicodeDecodeError) as e:
        raise FormatError(f"{path}: unreadable ({e})") from None
    vocab_size = Tokenizer.from_json(text, source=str(path)).vocab_size  # fail here, not at load time
    config = _json(d / TOKENIZER_CONFIG) if (d / TOKENIZER_CONFIG).exists() else {}
    special = {k: t for k in SPECIAL_TOKEN_KEYS if (t := _token_text(config.get(k))) is not None}
    if (d / CHAT_TEMPLATE_JINJA).exists():
        template = (d / CHAT_TEMPLATE_JINJA).read_text(encoding="utf-8")
    elif (d / CHAT_TEMPLATE_JSON).exists():
        template = _template(_json(d / CHAT_TEMPLATE_JSON).get("chat_template"), d / CHAT_TEMPLATE_JSON)
    else:
        template = _template(config.get("chat_template"), d / TOKENIZER_CONFIG)
    return TokenizerFiles(text, vocab_size, template, special)
