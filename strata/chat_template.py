"""Rendering a model's chat template (a Jinja2 template from its Hugging Face tokenizer files)
the way transformers' `apply_chat_template` does, so `strata generate --chat` prompts exactly
as the model was trained to be prompted.

The environment matches transformers' (`transformers/utils/chat_template_utils.py`): sandboxed,
`trim_blocks` and `lstrip_blocks`, the loop-controls extension, a `{% generation %}` block
that renders its body, a `tojson` that does not escape HTML or non-ASCII, `raise_exception`
and `strftime_now`; the special-token strings (bos_token, eos_token, ...) are variables.
Converted models keep those strings in the GGUF metadata under SPECIAL_TOKEN_KEY_PREFIX.
"""

from __future__ import annotations

import json
import os
from datetime import datetime

from strata.errors import ConfigError
from strata.option_names import option

SPECIAL_TOKEN_KEY_PREFIX = "tokenizer.huggingface."  # + bos_token, eos_token, unk_token, pad_token
MIN_JINJA2 = (3, 1, 6)  # older versions have known sandbox escapes; templates are untrusted code


def _environment():
    try:
        import jinja2
        import jinja2.ext
        from jinja2.sandbox import ImmutableSandboxedEnvironment
    except ImportError:
        raise ConfigError("chat templates need jinja2: pip install 'jinja2>=3.1.6'") from None
    if tuple(int(p) for p in jinja2.__version__.split(".")[:3] if p.isdigit()) < MIN_JINJA2:
        raise ConfigError(f"chat templates need jinja2>=3.1.6, found {jinja2.__version__}")

    class Generation(jinja2.ext.Extension):
        """`{% generation %}...{% endgeneration %}` (marks assistant text for training masks): the body."""

        tags = {"generation"}

        def parse(self, parser):
            lineno = next(parser.stream).lineno
            body = parser.parse_statements(["name:endgeneration"], drop_needle=True)
            return jinja2.nodes.CallBlock(self.call_method("_body"), [], [], body).set_lineno(lineno)

        def _body(self, caller):
            return caller()

    def raise_exception(message):
        raise jinja2.exceptions.TemplateError(message)

    def tojson(x, ensure_ascii=False, indent=None, separators=None, sort_keys=False):
        return json.dumps(x, ensure_ascii=ensure_ascii, indent=indent, separators=separators, sort_keys=sort_keys)

    env = ImmutableSandboxedEnvironment(trim_blocks=True, lstrip_blocks=True,
                                        extensions=[Generation, jinja2.ext.loopcontrols])
    env.filters["tojson"] = tojson
    env.globals["raise_exception"] = raise_exception
    env.globals["strftime_now"] = lambda fmt: datetime.now().strftime(fmt)
    return env, jinja2


def render_chat(template: str, messages: list[dict], *, add_generation_prompt: bool = True,
                special_tokens: dict[str, str] | None = None, tools: list[dict] | None = None) -> str:
    """The prompt text for `messages` ([{"role": ..., "content": ...}, ...]); `tools` are
    function descriptions in the OpenAI shape ({"type": "function", "function": {...}}), which
    is what transformers hands a template as `tools`."""
    env, jinja2 = _environment()
    try:
        return env.from_string(template).render(messages=messages, tools=tools or None, documents=None,
                                                add_generation_prompt=add_generation_prompt,
                                                **(special_tokens or {}))
    except jinja2.exceptions.TemplateError as e:
        raise ConfigError(f"chat template: {' '.join(str(e).split())}") from None


def special_tokens_of(model_path: str | os.PathLike) -> dict[str, str]:
    """The special-token strings stored in a converted model's GGUF metadata (metadata only)."""
    from strata.formats.gguf_file import open_gguf  # checked like every model read (FormatError on a bad file)

    gf = open_gguf(model_path)
    try:
        return {key[len(SPECIAL_TOKEN_KEY_PREFIX):]: f.value for key, f in gf.fields.items()
                if key.startswith(SPECIAL_TOKEN_KEY_PREFIX) and key.endswith("_token")}
    finally:
        gf.close()


def chat_prompt(model, user_text: str) -> str:
    """`user_text` as one user turn of a loaded strata Model, rendered by its chat template."""
    template = model.tokenizer.chat_template
    if not template:
        raise ConfigError(f"{model.model_path}: the model has no chat template ({option('chat')} needs one; "
                          "`strata convert` keeps the checkpoint's)")
    return render_chat(template, [{"role": "user", "content": user_text}],
                       special_tokens=special_tokens_of(model.model_path))
