"""Give a strata model file a chat template (or replace its own), keeping every weight byte-identical.

    python scripts/set_chat_template.py strata/data/default.gguf                 # the embedded model's
    python scripts/set_chat_template.py model.gguf --template chat.jinja         # any model, any template

The file is read with strata's own reader and written again with its own writer (strata.formats.
model_file.write_model): the same config, tokenizer, metadata and tensors, in the types they are
stored in (F16 tensors are handed over as float16, so nothing is converted), the template under
`tokenizer.chat_template`, and a new file checksum. Before the new file replaces the old one, the
script checks that every tensor's bytes, name, type and shape are what they were; it refuses
otherwise. The `.experts` file beside it is not touched (a model file without an experts identity,
like the embedded one, stays without one; one with an identity keeps it).

The embedded model (docs/model-card.md) is trained on Python source only: it knows no chat
format, so its template frames the conversation as Python comments (`# user: ...`) and lets the
model answer with the code that follows, which is what it writes.
"""

from __future__ import annotations

import argparse
import os
import sys
from pathlib import Path

import numpy as np

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from strata.formats.dense_weights import StoredTensor  # noqa: E402
from strata.formats.gguf_file import open_gguf  # noqa: E402
from strata.formats.model_file import read_model, write_model  # noqa: E402
from strata.formats.quant_types import QuantType  # noqa: E402

# System and user turns become comment lines (each line of the text behind "# "); an assistant
# turn is its text as written (code), then a blank line. The generation prompt adds nothing: the
# model continues after the last comment, as it continues any commented Python.
PYTHON_COMMENT_TEMPLATE = """\
{%- for message in messages %}
{%- if message.role == 'assistant' %}
{{- message.content }}

{% else %}
{{- '# ' ~ message.role ~ ': ' ~ (message.content | replace('\\n', '\\n# ')) }}
{% endif %}
{%- endfor %}"""


def tensor_bytes(path: str) -> dict[str, tuple[int, tuple[int, ...], bytes]]:
    """name -> (ggml type, numpy shape, raw bytes) of every tensor in a GGUF file."""
    gf = open_gguf(path)
    try:
        return {name: (info.ggml_type, info.shape, gf.raw(info).tobytes()) for name, info in gf.tensors.items()}
    finally:
        gf.close()


def stored_arrays(mf) -> tuple[dict[str, np.ndarray], QuantType]:
    """The dense tensors as write_model takes them without converting (float16 for F16, float32
    for F32) and the matrices' type. Any other stored type is refused: only these two pass
    through the writer unchanged (the byte check in main would refuse the rest anyway)."""
    dense, dense_type = {}, QuantType.F32
    for name in mf.dense:
        held = mf.dense.stored(name)
        if isinstance(held, StoredTensor):
            if held.qtype.name != "F16":
                raise SystemExit(f"{name}: stored as {held.qtype.name}; this script keeps only F16 and F32 "
                                 "tensors byte-identical")
            dense[name], dense_type = np.asarray(held.codes, np.float16), QuantType.F16
        else:
            dense[name] = np.asarray(held, np.float32)
    return dense, dense_type


def main() -> int:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("model", help="a strata model file (NAME.gguf)")
    p.add_argument("--template", help="a Jinja chat template file (default: the Python-comment template)")
    args = p.parse_args()
    template = Path(args.template).read_text(encoding="utf-8") if args.template else PYTHON_COMMENT_TEMPLATE
    path = os.fspath(args.model)
    before = tensor_bytes(path)
    mf = read_model(path)
    dense, dense_type = stored_arrays(mf)
    out = path + ".new"
    write_model(out, mf.cfg, dense, tokenizer_json=mf.tokenizer_json, chat_template=template,
                dense_type=dense_type, extra_metadata=mf.metadata, experts_identity=mf.experts_identity,
                ngrams_identity=mf.ngrams_identity)
    after = tensor_bytes(out)
    if list(after) != list(before) or any(after[n] != before[n] for n in before):
        changed = next((n for n in before if after.get(n) != before[n]), "the tensor list")
        os.unlink(out)
        raise SystemExit(f"refused: {changed} would change; {path} is left as it was")
    check = read_model(out)  # the checksum and the config read back
    assert check.chat_template == template and check.metadata == mf.metadata
    os.replace(out, path)
    print(f"{path}: chat template set ({len(template)} characters); {len(before)} tensors byte-identical")
    return 0


if __name__ == "__main__":
    sys.exit(main())
