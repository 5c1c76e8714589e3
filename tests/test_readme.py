"""Every command and snippet in the README works as written.

The README's `bash` blocks are run through strata's own command line (`strata.cli.main.main`,
in-process, the code a user's `strata` runs) in the order they appear, with the paths a reader
would have replaced by files made here: `model.gguf` and `/tmp/tiny` by a made model,
`~/hf/Qwen3-30B-A3B` by the checked-in tiny Qwen3-MoE checkpoint (its `-FP8` by that checkpoint
in FP8 blocks, and the hub id by it in a Hugging Face cache laid out here), `~/models/GLM-5-mlx-4bit`
by a tiny GLM-5 checkpoint quantized by mlx-lm's own code, `@prompt.txt` / `@text.txt`
by short text files. A command that cannot run on this machine (a server that blocks, pipeline
stages on two Macs, an illustration with `...`) is parsed by the real parser instead, and says
why in `PARSE_ONLY`. The Python block runs as written against the made model. A README command
that is neither run nor listed fails the test, so the README cannot drift from the code.
"""

from __future__ import annotations

import io
import re
import shlex
from pathlib import Path

import pytest

from fp8_checkpoints import write_fp8_checkpoint
from hf_fixtures import checkpoint_dir, copy_checkpoint
from tier2_models import make_checkpoint
from tests import gguf_models
from strata.cli.main import build_parser, main
from strata.testing.models import make_model

README = Path(__file__).resolve().parents[1] / "README.md"

# commands run by parsing only (as the README spells them, comments dropped), and why
PARSE_ONLY = {
    'strata generate /data/qwen3.gguf "Hi" --hosts 10.0.0.1,10.0.0.2': "needs two pipeline hosts",
    "strata serve /data/qwen3.gguf --name qwen3 --arena 8GB --prefetch 16": "a server runs until stopped "
                                                                            "(tests/serve/test_serve_cli.py serves)",
    "strata serve": "a server runs until stopped (test_the_readme_openai_snippet_chats_with_the_embedded_model "
                    "serves what it builds)",
    'strata chat --system "Answer in Python."': "interactive (tests/cli/test_cli_chat.py drives it through a "
                                                "pseudo-terminal)",
}
SKIPPED = {  # (prefix, why): not strata's command line
    "pip install": "installs; CI runs exactly these lines",
}
ILLUSTRATION = "STRATA_PREFETCH=16 strata generate ..."  # the environment form of any flag


def _blocks(lang: str) -> list[str]:
    return re.findall(rf"```{lang}\n(.*?)```", README.read_text(), flags=re.S)


def readme_commands() -> list[str]:
    commands = []
    for block in _blocks("bash"):
        for line in block.splitlines():
            line = re.sub(r"\s+#\s.*$", "", line).strip()  # a trailing comment
            if line and not line.startswith("#"):
                commands.append(line)
    return commands


@pytest.fixture(scope="module")
def workdir(tmp_path_factory) -> Path:
    d = tmp_path_factory.mktemp("readme")
    # 512 experts (10% of them is a legal arena, 300 slots one that fits) in 4 layers, not the demo
    # shape's 8: every command here runs the same code, at half the cost a token (`strata sweep`
    # alone decodes the text once per policy, ten times)
    make_model(d / "model", "demo", seed=1, n_layers=4, n_experts=128)
    (d / "prompt.txt").write_text("def add(a, b):\n    return")
    (d / "text.txt").write_text("def fibonacci(n):\n    if n < 2:\n        return n\n"
                                "    return fibonacci(n - 1) + fibonacci(n - 2)\n")  # ~100 tokens
    copy_checkpoint("qwen3_moe", d / "hf" / "Qwen3-30B-A3B")
    write_fp8_checkpoint(checkpoint_dir("qwen3_moe"), d / "hf" / "Qwen3-30B-A3B-FP8")  # the published FP8 layout
    make_checkpoint("glm_moe_dsa_a4g32", d / "models" / "GLM-5-mlx-4bit")  # tier 2: as mlx-lm's convert writes it
    gguf_models.write_gguf(d / "hf" / "Qwen3-30B-A3B", d / "models" / "Qwen3-30B-A3B-Q8_0.gguf")  # llama.cpp's, in place
    # the hub id's snapshot, laid out as the hub client does (tests/test_hub_cache.py)
    repo = d / "hub" / "models--Qwen--Qwen3-30B-A3B"
    (repo / "refs").mkdir(parents=True)
    (repo / "refs" / "main").write_text("0" * 40)
    copy_checkpoint("qwen3_moe", repo / "snapshots" / ("0" * 40))
    return d


def _localized(command: str, d: Path) -> str:
    """The command with the README's placeholder paths pointing into `d`."""
    return (command.replace("~/hf/Qwen3-30B-A3B", str(d / "hf" / "Qwen3-30B-A3B"))
            .replace("~/models/", f"{d / 'models'}/")
            .replace("/data/qwen3", str(d / "qwen3")).replace("/tmp/tiny", str(d / "tiny"))
            .replace("model.gguf", str(d / "model.gguf"))
            .replace("@prompt.txt", f"@{d / 'prompt.txt'}").replace("@text.txt", f"@{d / 'text.txt'}"))


def _run(argv: list[str], stdin: str | None, monkeypatch, capsys) -> tuple[int, str, str]:
    if stdin is not None:
        monkeypatch.setattr("sys.stdin", io.TextIOWrapper(io.BytesIO(stdin.encode())))
    try:
        rc = main(argv)
    except SystemExit as e:  # --help and --version exit through argparse
        rc = int(e.code or 0)
    out, err = capsys.readouterr()
    return rc, out, err


def test_every_readme_command_runs_or_parses(workdir, monkeypatch, capsys):
    monkeypatch.chdir(workdir)
    monkeypatch.setenv("HF_HUB_CACHE", str(workdir / "hub"))
    commands = readme_commands()
    assert len(commands) >= 20, "the README's commands were not found"
    # the trace the README's replay lines read is made by its `strata trace` line: run that first
    commands.sort(key=lambda c: not c.startswith("strata trace"))
    ran = parsed = 0
    for command in commands:
        if any(command.startswith(p) for p in SKIPPED) or command == ILLUSTRATION:
            continue
        line = _localized(command, workdir)
        stdin = None
        if line.startswith("echo "):  # `echo TEXT | strata ...`: TEXT on standard input
            echo, line = line.split(" | ", 1)
            stdin = shlex.split(echo)[1] + "\n"
        argv = shlex.split(line)
        assert argv[0] == "strata", f"not a strata command: {command}"
        if command in PARSE_ONLY:
            args = build_parser().parse_args(argv[1:])
            assert args.command == argv[1], command
            parsed += 1
            continue
        rc, out, err = _run(argv[1:], stdin, monkeypatch, capsys)
        assert rc == 0, f"README command failed: {command}\n{err[-2000:]}"
        assert "Traceback" not in err, command
        ran += 1
    assert parsed == len(PARSE_ONLY), "a PARSE_ONLY entry is no longer in the README"
    assert ran >= 18


def test_the_readme_version_line_is_what_strata_prints(monkeypatch, capsys):
    promised = re.search(r"strata --version\s+#\s*(.+)", README.read_text()).group(1).strip()
    rc, out, _ = _run(["--version"], None, monkeypatch, capsys)
    assert rc == 0 and out.strip() == promised


def test_the_readme_python_block_runs(workdir, monkeypatch, capsys):
    monkeypatch.chdir(workdir)
    make_model(workdir / "tiny", "tiny", seed=2)
    python_blocks = [b for b in _blocks("python") if "import strata" in b]
    assert len(python_blocks) == 1
    code = python_blocks[0].replace("/tmp/tiny.gguf", str(workdir / "tiny.gguf"))
    exec(compile(code, str(README), "exec"), {"__name__": "readme"})
    out = capsys.readouterr().out
    assert "EngineStats(engine=" in out.rstrip().splitlines()[-1], "the session's stats are printed last"


def test_the_readme_openai_snippet_chats_with_the_embedded_model(monkeypatch, capsys):
    """`strata serve` as the README starts it (the embedded model), answering the README's OpenAI
    snippet as written (only the port differs: a free one)."""
    import uvicorn
    from serve_support import live_server

    built = []
    monkeypatch.setattr(uvicorn, "run", lambda app, **kw: built.append((app, kw)))
    assert main(["serve"]) == 0
    (app, kw), = built
    assert (kw["host"], kw["port"]) == ("127.0.0.1", 8000)
    snippet = next(b for b in _blocks("python") if "from openai import OpenAI" in b)
    capsys.readouterr()
    with live_server(app) as url:
        code = snippet.replace("http://127.0.0.1:8000", url)
        exec(compile(code, str(README), "exec"), {"__name__": "readme"})
    printed = capsys.readouterr().out.rstrip("\n")
    text, cached = printed.rsplit(" ", 1)
    assert text.strip() and cached == "0", printed  # a reply, and nothing cached on a fresh server
