"""scripts/set_chat_template.py: a chat template goes into a model file's metadata and every
tensor's bytes stay as they were (how the embedded model got its template)."""

import subprocess
import sys
from pathlib import Path

import strata
from strata.formats.quant_types import QuantType
from strata.testing.models import make_model

SCRIPT = Path(__file__).resolve().parents[1] / "scripts" / "set_chat_template.py"


def _tensors(path):
    from strata.formats.gguf_file import open_gguf

    gf = open_gguf(path)
    try:
        return {name: (info.ggml_type, gf.raw(info).tobytes()) for name, info in gf.tensors.items()}
    finally:
        gf.close()


def test_the_template_is_set_and_the_weights_stay_byte_identical(tmp_path):
    made = make_model(tmp_path / "m", "tiny", seed=4, dense_type=QuantType.F16)
    before = _tensors(made.model_path)
    template = tmp_path / "t.jinja"
    template.write_text("{% for m in messages %}{{ m.role }}> {{ m.content }}\n{% endfor %}")
    run = subprocess.run([sys.executable, str(SCRIPT), str(made.model_path), "--template", str(template)],
                         capture_output=True, text=True)
    assert run.returncode == 0, run.stderr
    assert "byte-identical" in run.stdout
    assert _tensors(made.model_path) == before
    with strata.load(made.model_path) as model:  # checksum, experts pairing and template read back
        assert model.tokenizer.chat_template == template.read_text()
        assert strata.generate(model, "ab", max_tokens=2).tokens
