"""Regenerate tests/fixtures/llama_cpp/: GGUF files written by llama.cpp itself, from the repo's
tiny checkpoints, with llama.cpp's own `convert_hf_to_gguf.py` (and the gguf-py it bundles) and
quantized by its `llama-quantize` to mixes like unsloth's dynamic (UD) recipes. Needs torch (the
converter imports it) and a llama.cpp source tree with its CPU tools built (docs/cpu.md says
how: the llama-cpp-python source package vendors one):

    python scripts/make_llama_cpp_fixtures.py --llama-cpp SRC --build BUILD [CASE ...]

SRC is llama.cpp's source root (convert_hf_to_gguf.py, gguf-py/), BUILD its cmake build folder
(bin/llama-quantize, bin/llama-imatrix). Each case: the checkpoint (a checked-in trained fixture,
or the seeded wide random one for the 256-weight rows K- and IQ-quants need), converted to F32 by
llama.cpp's converter, then quantized from F32 with a base type and per-tensor `--tensor-type`
overrides (IQ2_XXS needs an importance matrix: llama-imatrix on PARITY_TEXT). The changes to
llama.cpp's converter's run: our tiny tokenizer's pre-tokenizer hash is not in its table, so
`get_vocab_base_pre` answers "gpt-2" (the fixtures' tokenizer is GPT-2's byte-level regex); and for
a case with `config_json_only` (qwen4exp) the converter takes its own fallback for a model
transformers does not know, config.json as written (docs/testing.md says why). Prints
every command it runs, each file's size and the total (about 4 MB for all eleven).
"""

from __future__ import annotations

import argparse
import json
import shlex
import shutil
import subprocess
import sys
import tempfile
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from tests import hf_fixtures, hf_models  # noqa: E402
from tests.llama_cpp_fixtures import CASES, FIXTURE_ROOT, LlamaCppCase  # noqa: E402

# run as `python -c`: llama.cpp's converter with the tokenizer's pre-tokenizer named
_CONVERT = """
import runpy, sys
src, config_json_only = sys.argv.pop(1), sys.argv.pop(1) == "config.json"
sys.path[:0] = [src, src + "/gguf-py"]
import conversion.base as base
base.TextModel.get_vocab_base_pre = lambda self, tokenizer: "gpt-2"
if config_json_only:  # the converter's own fallback where transformers does not know the model
    def _unknown(*args, **kwargs):
        raise ValueError("architecture unknown to transformers")
    base.AutoConfig.from_pretrained = _unknown
sys.argv[0] = src + "/convert_hf_to_gguf.py"
runpy.run_path(sys.argv[0], run_name="__main__")
"""


def _run(cmd: list[str], shown: list[str] | None = None) -> None:
    print("$ " + " ".join(shlex.quote(c) for c in shown or cmd), flush=True)
    done = subprocess.run(cmd, stdout=subprocess.DEVNULL, stderr=subprocess.PIPE, text=True)
    if done.returncode:
        sys.exit(f"{cmd[0]} failed ({done.returncode}):\n{done.stderr[-3000:]}")


def _source_checkpoint(case: LlamaCppCase, tmp: Path) -> Path:
    out = tmp / "hf"
    if case.source == "wide":
        hf_models.write_synthetic_checkpoint(out, **case.wide)
    else:
        shutil.copytree(hf_fixtures.checkpoint_dir(case.source), out)
    if case.added_tokens:
        tok = json.loads((out / "tokenizer.json").read_text())
        first = 1 + max([*tok["model"]["vocab"].values(), *(t["id"] for t in tok["added_tokens"])])
        tok["added_tokens"] += [{"id": first + i, "content": text, "single_word": False, "lstrip": False,
                                 "rstrip": False, "normalized": False, "special": True}
                                for i, text in enumerate(case.added_tokens)]
        (out / "tokenizer.json").write_text(json.dumps(tok, ensure_ascii=False))
    if case.config_extra:
        cfg = json.loads((out / "config.json").read_text())
        (out / "config.json").write_text(json.dumps({**cfg, **case.config_extra}, indent=1))
    return out


def build_case(case: LlamaCppCase, src: Path, build: Path, tmp: Path) -> Path:
    hf_dir = _source_checkpoint(case, tmp)
    f32 = tmp / "f32.gguf"
    args = [str(hf_dir), "--outfile", str(f32), "--outtype", "f32", *case.convert_args]
    hparams = "config.json" if case.config_json_only else "transformers"
    _run([sys.executable, "-c", _CONVERT, str(src), hparams, *args],
         ["python", f"{src}/convert_hf_to_gguf.py", *args, f"# tokenizer.ggml.pre: gpt-2; hparams: {hparams}"])
    quantize = [str(build / "bin" / "llama-quantize")]
    if case.needs_imatrix:
        text = tmp / "calibration.txt"
        text.write_text(hf_models.PARITY_TEXT + "\n")
        imatrix = tmp / "imatrix.gguf"
        _run([str(build / "bin" / "llama-imatrix"), "-m", str(f32), "-f", str(text), "-o", str(imatrix),
              "-c", "32", "-b", "32", "-t", "1"])
        quantize += ["--imatrix", str(imatrix)]
    for pattern, qtype in case.tensor_types:
        quantize += ["--tensor-type", f"{pattern}={qtype}"]
    out = FIXTURE_ROOT / f"{case.name}.gguf"
    out.parent.mkdir(parents=True, exist_ok=True)
    _run([*quantize, str(f32), str(out), case.base_type, "1"])
    return out


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--llama-cpp", type=Path, required=True, help="llama.cpp's source root")
    p.add_argument("--build", type=Path, required=True, help="its cmake build folder (bin/llama-quantize)")
    p.add_argument("cases", nargs="*", help=f"case names (default: all of {[c.name for c in CASES]})")
    a = p.parse_args()
    chosen = [c for c in CASES if not a.cases or c.name in a.cases]
    for case in chosen:
        with tempfile.TemporaryDirectory() as tmp:
            path = build_case(case, a.llama_cpp, a.build, Path(tmp))
            print(f"{path}: {path.stat().st_size / 1024:.0f} KiB")
    total = sum(f.stat().st_size for f in FIXTURE_ROOT.glob("*.gguf"))
    print(f"total {total / 1024:.0f} KiB in {FIXTURE_ROOT}")


if __name__ == "__main__":
    main()
