"""The entry points refuse bad input in one line (exit 2, no traceback), before any work: the
CLI's options, prompts, paths and environment, and the first-use mistakes (issue 23)."""

import errno
import re
import os
import subprocess
import sys
from pathlib import Path

import numpy as np
import pytest

from strata.formats.quant_types import QuantType
from strata.cli.main import main
from strata.testing.models import make_model

REPO = Path(__file__).resolve().parent.parent


@pytest.fixture(scope="module")
def made(tmp_path_factory):
    return make_model(tmp_path_factory.mktemp("entry") / "tiny", "tiny", seed=0)


@pytest.fixture(scope="module")
def q4(tmp_path_factory):
    return make_model(tmp_path_factory.mktemp("entry_q4") / "q4", "tiny", seed=0, expert_type=QuantType.Q4_0)


def one_line_error(capsys, *argv, fragments=()):
    code = main([str(a) for a in argv])
    err = capsys.readouterr().err
    lines = err.strip().splitlines()
    assert code == 2, err
    assert len(lines) == 1 and lines[0].startswith("error: "), err
    assert "Traceback" not in err
    for f in fragments:
        assert f in lines[0], (f, lines[0])
    return lines[0]


@pytest.mark.parametrize("flags, fragments", [
    (["--temp", "-1"], ["--temp", ">= 0"]), (["--temp", "nan"], ["--temp", "finite"]),
    (["--temp", "inf"], ["--temp", "finite"]), (["--top-p", "0"], ["--top-p", "(0, 1]"]),
    (["--top-p", "2"], ["--top-p"]), (["--seed", "-1"], ["--seed", ">= 0"]), (["-n", "-1"], ["--max-tokens"]),
    (["--top-k", "-1"], ["--top-k"]), (["--min-p", "1.5"], ["--min-p"]), (["--repeat-penalty", "0"], ["--repeat-penalty"]),
    (["--threads", "-2"], ["threads"]), (["--set", "io_timeout=inf"], ["io_timeout", "finite"]),
    (["--report-json", "/no/such/dir/r.json"], ["--report-json", "no such directory"]),
    (["--logpos", "/no/such/dir/l.bin"], ["--logpos", "no such directory"]),
    (["--arena", "lots"], ["arena", "cannot read"]),
])
def test_generate_refuses_bad_options_before_loading(made, capsys, monkeypatch, flags, fragments):
    import strata.loader

    monkeypatch.setattr(strata.loader, "load", lambda *a, **k: pytest.fail("the model loaded before the check"))
    one_line_error(capsys, "generate", made.model_path, "hi", *flags, fragments=fragments)


def test_mlx_backend_refuses_q4_0_experts(q4, capsys):
    one_line_error(capsys, "generate", q4.model_path, "hi", "--backend", "mlx", fragments=["Q2_0", "Q4_0", "--backend numpy"])


@pytest.mark.parametrize("prompt", ["\udcff\udcfehi", "ok \udc80"])
def test_non_utf8_prompt(made, capsys, prompt):  # undecodable argv bytes reach Python as lone surrogates
    one_line_error(capsys, "generate", made.model_path, prompt, fragments=["UTF-8"])


def test_prompt_files_and_stdin(made, tmp_path, capsys, monkeypatch):
    (tmp_path / "p.txt").write_text("hello")
    (tmp_path / "bad.txt").write_bytes(b"\xff\xfehello")
    assert main(["generate", str(made.model_path), f"@{tmp_path / 'p.txt'}", "-n", "3", "--quiet"]) == 0
    from_file = capsys.readouterr().out
    assert main(["generate", str(made.model_path), "hello", "-n", "3", "--quiet"]) == 0
    assert capsys.readouterr().out == from_file  # @FILE is the file's text
    monkeypatch.setattr(sys, "stdin", type("In", (), {"buffer": __import__("io").BytesIO(b"hello")})())
    assert main(["generate", str(made.model_path), "-", "-n", "3", "--quiet"]) == 0
    assert capsys.readouterr().out == from_file
    one_line_error(capsys, "generate", made.model_path, f"@{tmp_path / 'bad.txt'}", fragments=["bad.txt", "UTF-8"])
    one_line_error(capsys, "generate", made.model_path, f"@{tmp_path / 'none.txt'}", fragments=["no such prompt file", "@@"])


@pytest.mark.parametrize("arg", ["model.gguf", "x/model.experts", "weights.safetensors", "{dir}"])
def test_a_lone_model_path_is_not_taken_as_the_prompt(tmp_path, capsys, monkeypatch, arg):
    import strata.loader

    monkeypatch.setattr(strata.loader, "load", lambda *a, **k: pytest.fail("generated with the path as the prompt"))
    one_line_error(capsys, "generate", arg.format(dir=tmp_path), fragments=["looks like a model", "PROMPT"])


def _llama_gguf(path):
    import gguf

    w = gguf.GGUFWriter(str(path), "qwen3moe")
    w.add_block_count(2)
    w.add_tensor("token_embd.weight", np.zeros((4, 8), np.float32))
    w.write_header_to_file()
    w.write_kv_data_to_file()
    w.write_tensors_to_file()
    w.close()
    return path


def test_sources_to_convert_are_named(tmp_path, capsys):
    hf = tmp_path / "hf"
    hf.mkdir()
    (hf / "config.json").write_text("{}")
    (hf / "model.safetensors").write_bytes(b"\0" * 16)
    plain = tmp_path / "plain"
    plain.mkdir()
    llama = _llama_gguf(tmp_path / "llama.gguf")
    one_line_error(capsys, "generate", hf, "hi", fragments=["Hugging Face checkpoint", f"strata convert {hf} OUT"])
    one_line_error(capsys, "generate", hf / "model.safetensors", "hi", fragments=["not a strata model", "strata convert"])
    one_line_error(capsys, "generate", plain, "hi", fragments=["a directory, not a strata model", "strata convert"])
    # a llama.cpp GGUF runs in place (tests/convert/test_gguf_in_place.py): this one, with no experts, is refused
    # there in one line naming the key
    one_line_error(capsys, "generate", llama, "hi", fragments=["qwen3moe.expert_count is missing or 0"])
    os.mkfifo(tmp_path / "pipe.gguf")
    one_line_error(capsys, "generate", tmp_path / "pipe.gguf", "hi", fragments=["not a regular file"])


def test_a_stray_environment_variable_is_named(made, capsys, monkeypatch):
    monkeypatch.setenv("STRATA_FOO", "1")
    one_line_error(capsys, "generate", made.model_path, "hi", fragments=["environment variable STRATA_FOO"])
    monkeypatch.delenv("STRATA_FOO")
    monkeypatch.setenv("STRATA_PREFETCH", "many")
    one_line_error(capsys, "generate", made.model_path, "hi", fragments=["STRATA_PREFETCH", "many"])


def test_recall_refuses_depth_zero(made, tmp_path, capsys):
    trace = tmp_path / "t.npz"
    assert main(["trace", str(made.model_path), "hello world", "-o", str(trace)]) == 0
    capsys.readouterr()
    one_line_error(capsys, "recall", trace, "--K", "0", fragments=["--K 0"])
    one_line_error(capsys, "recall", trace, "--K", "4,999", fragments=["--K 999"])


def test_convert_checks_out_first_and_maps_os_errors(made, tmp_path, capsys, monkeypatch):
    (tmp_path / "afile").write_text("")
    one_line_error(capsys, "convert", tmp_path, tmp_path / "afile" / "out", fragments=["OUT", "not a directory"])
    (tmp_path / "ro").mkdir(mode=0o555)
    if os.geteuid() != 0:  # root writes anywhere
        one_line_error(capsys, "convert", tmp_path, tmp_path / "ro" / "out", fragments=["not writable"])
    import strata.convert

    def full(*a, **k):
        raise OSError(errno.ENOSPC, "No space left on device", str(tmp_path / "out.experts.partial"))

    monkeypatch.setattr(strata.convert, "convert", full)
    one_line_error(capsys, "convert", tmp_path, tmp_path / "out", fragments=["out.experts.partial", "disk is full"])


def test_unexpected_errors_are_one_line_unless_debugging(made, capsys, monkeypatch):
    import strata.cli.generate as gen

    def bug(args):
        raise KeyError("a bug")

    monkeypatch.setattr(gen, "run", bug)
    one_line_error(capsys, "generate", "hi", fragments=["internal error: KeyError", "--debug", "STRATA_DEBUG=1"])
    with pytest.raises(KeyError):
        main(["generate", "hi", "--debug"])
    monkeypatch.setenv("STRATA_DEBUG", "1")  # not a Config field: the environment check lets it through
    with pytest.raises(KeyError):
        main(["generate", "hi"])


def test_version_and_summary_memory(made, capsys):
    with pytest.raises(SystemExit):
        main(["--version"])
    assert capsys.readouterr().out.strip() == "strata 0.1.0 (distribution strata-moe)"
    assert main(["generate", str(made.model_path), "hello", "-n", "3"]) == 0
    err = capsys.readouterr().err
    assert re.search(r"peak memory \d+(\.\d+)? [MG]B\]", err), err  # GB once a long test process passes 1 GB


def test_threads_are_set_before_numpy_starts():
    """The CLI puts --threads into the BLAS variables before numpy's first import (the path
    without threadpoolctl), and they win over nothing the user set."""
    code = ("import os, sys; from strata.threads import preset_environment; "
            "preset_environment(sys.argv[1:]); assert 'numpy' not in sys.modules; "
            "print(os.environ['OPENBLAS_NUM_THREADS'], os.environ.get('OMP_NUM_THREADS', '-'))")
    env = {k: v for k, v in os.environ.items() if k not in ("OPENBLAS_NUM_THREADS", "OMP_NUM_THREADS", "MKL_NUM_THREADS")}
    env["PYTHONPATH"] = str(REPO)
    run = lambda *argv, **extra: subprocess.run([sys.executable, "-c", code, *argv], env=dict(env, **extra),
                                                capture_output=True, text=True, timeout=60).stdout.split()
    assert run("generate", "hi", "--threads", "3") == ["3", "3"]
    assert run("generate", "hi") == ["1", "1"]  # auto before the model is known: one thread
    assert run("generate", "hi", OPENBLAS_NUM_THREADS="2") == ["2", "-"]  # the user's own setting stays
    assert run("generate", "hi", "--threads=4", OPENBLAS_NUM_THREADS="2") == ["4", "4"]  # the flag wins


def test_main_names_another_strata_package(monkeypatch, capsys):
    import strata

    monkeypatch.setattr(strata, "__distribution__", "amperor-strata", raising=False)
    code = main(["--version"])
    err = capsys.readouterr().err
    assert code == 2 and "not strata-moe's" in err and "pip install strata-moe" in err


def test_one_size_grammar_in_generate_and_replay(made, tmp_path, capsys):
    import json

    reports = []
    for arena in ("30", "30slots"):
        out = tmp_path / f"r{arena}.json"
        assert main(["generate", str(made.model_path), "hi", "-n", "2", "--quiet", "--arena", arena,
                     "--report-json", str(out)]) == 0
        reports.append(json.loads(out.read_text())["arena_slots"])
    assert reports == [30, 30]  # a bare number counts slots, as in replay's --caps
    trace = tmp_path / "t.npz"
    assert main(["trace", str(made.model_path), "hello world", "-o", str(trace)]) == 0
    capsys.readouterr()
    assert main(["replay", str(trace), "--caps", "30slots,30", "--K", "0", "--lambda", "0"]) == 0
    one_line_error(capsys, "replay", trace, "--caps", "2MB", fragments=["no record size"])
