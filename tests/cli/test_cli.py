"""`strata` on the command line: generate, make-model, and one-line errors for bad input."""

import os

import pytest

from strata.cli.main import main
from strata.formats import model_file
from strata.formats.experts_file import ExpertsFile
from strata.model_config import TensorNames, dense_tensor_shapes
from strata.testing.models import make_dense, make_model
from strata.tokenizer import byte_level_tokenizer_json


@pytest.fixture()
def made(tmp_path):
    return make_model(tmp_path / "tiny", "tiny", seed=0)


def run(capsys, *argv):
    code = main(list(argv))
    out, err = capsys.readouterr()
    return code, out, err


def assert_one_line_error(code, err, *fragments):
    assert code == 2
    lines = err.strip().splitlines()
    assert len(lines) == 1 and lines[0].startswith("error: "), err
    for f in fragments:
        assert f in lines[0], (f, lines[0])


def test_generate_prints_text_and_summary(made, capsys):
    code, out, err = run(capsys, "generate", str(made.model_path), "hello", "-n", "5")
    assert code == 0
    assert "5 generated" in err and "tok/s" in err
    assert out.endswith("\n")


def test_make_model_writes_both_files(tmp_path, capsys):
    code, out, _ = run(capsys, "make-model", str(tmp_path / "m"), "--shape", "tiny", "--experts", "q4_0")
    assert code == 0
    assert (tmp_path / "m.gguf").exists() and (tmp_path / "m.experts").exists()
    assert ExpertsFile.open(tmp_path / "m.experts").header.qtype == 2  # Q4_0


def test_help_lists_subcommands(capsys):
    with pytest.raises(SystemExit):
        main(["--help"])
    out = capsys.readouterr().out
    assert "generate" in out and "make-model" in out and "examples" in out


def test_missing_model_file(tmp_path, capsys):
    code, _, err = run(capsys, "generate", str(tmp_path / "nope.gguf"), "hi")
    assert_one_line_error(code, err, "nope.gguf")


def test_truncated_experts_file(made, capsys):
    with open(made.experts_path, "r+b") as f:
        f.truncate(os.path.getsize(made.experts_path) - 100)
    code, _, err = run(capsys, "generate", str(made.model_path), "hi")
    assert_one_line_error(code, err, "tiny.experts", "truncated")


def test_corrupted_expert_record_names_layer_and_expert(made, capsys):
    xf = ExpertsFile.open(made.experts_path)
    offset = xf.record_offset(1, 5)
    xf.close()
    with open(made.experts_path, "r+b") as f:
        f.seek(offset + 3)
        byte = f.read(1)
        f.seek(offset + 3)
        f.write(bytes([byte[0] ^ 0xFF]))
    code, _, err = run(capsys, "generate", str(made.model_path), "hi")
    assert_one_line_error(code, err, "layer 1", "expert 5")


def test_gguf_missing_a_tensor(made, monkeypatch, capsys):
    router = TensorNames.block(1, TensorNames.router)
    shapes = {k: v for k, v in dense_tensor_shapes(made.cfg).items() if k != router}
    dense = {k: v for k, v in make_dense(made.cfg, 0).items() if k != router}
    monkeypatch.setattr(model_file, "dense_tensor_shapes", lambda cfg: shapes)
    model_file.write_model(made.model_path, made.cfg, dense, tokenizer_json=byte_level_tokenizer_json())
    monkeypatch.undo()
    code, _, err = run(capsys, "generate", str(made.model_path), "hi")
    assert_one_line_error(code, err, "tiny.gguf", router)


def test_experts_file_of_another_model(tmp_path, made, capsys):
    other = make_model(tmp_path / "other", "tiny", seed=0, n_experts=8)
    os.replace(other.experts_path, made.experts_path)
    code, _, err = run(capsys, "generate", str(made.model_path), "hi")
    assert_one_line_error(code, err, "tiny.experts", "wants")


def test_prompt_longer_than_context(made, capsys):
    code, _, err = run(capsys, "generate", str(made.model_path), "x" * (made.cfg.max_context + 5))
    assert_one_line_error(code, err, "context is 256")


def test_bad_expert_type(tmp_path, capsys):
    code, _, err = run(capsys, "make-model", str(tmp_path / "m"), "--experts", "q3_k")
    assert_one_line_error(code, err, "q3_k", "q2_0")


def test_too_many_positional_arguments(made, capsys):
    code, _, err = run(capsys, "generate", str(made.model_path), "a", "b")
    assert_one_line_error(code, err, "quote the prompt")
