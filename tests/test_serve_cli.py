"""`strata serve`: flags, loopback by default, errors before listening."""

import shlex
from pathlib import Path

import pytest
from serve_support import model_fixture

from strata.cli.main import main

model = model_fixture()


@pytest.fixture
def served(monkeypatch):
    """uvicorn.run replaced by a recorder: the command runs up to the point of listening."""
    import uvicorn

    calls = []
    monkeypatch.setattr(uvicorn, "run", lambda app, **kw: calls.append((app, kw)))
    return calls


def test_help_lists_the_endpoints_and_examples(capsys):
    with pytest.raises(SystemExit) as e:
        main(["serve", "--help"])
    out = capsys.readouterr().out
    assert e.value.code == 0
    assert "/v1/chat/completions" in out and "strata serve /data/qwen3.gguf" in out and "--prefetch" in out


def test_serve_binds_loopback_with_the_runtime_flags(served, model, capsys):
    assert main(["serve", str(model.model_path), "--port", "8123", "--prefetch", "4", "--name", "mine"]) == 0
    (app, kw), = served
    assert (kw["host"], kw["port"]) == ("127.0.0.1", 8123)
    from uvicorn.protocols.http.auto import AutoHTTPProtocol

    assert issubclass(kw["http"], AutoHTTPProtocol) and kw["http"].__name__.startswith("JsonErrors")  # its 400s: JSON
    state = app.state.strata
    assert state.name == "mine" and state.worker.config.prefetch == 4
    assert "warning" not in capsys.readouterr().err


def test_the_embedded_model_is_served_when_none_is_named(served):
    assert main(["serve"]) == 0
    assert served[0][0].state.strata.name == "default"


def test_a_public_host_is_warned_about(served, model, capsys):
    assert main(["serve", str(model.model_path), "--host", "0.0.0.0"]) == 0
    assert "no authentication" in capsys.readouterr().err


@pytest.mark.parametrize("args, message", [
    (["/nonexistent/model.gguf"], "no such model file"),
    (["--arena", "2slots"], "cannot hold one window"),
    (["--port", "70000"], "--port must be in"),
    (["--chat-template", "/nonexistent.jinja"], "--chat-template"),
    (["--report-json", "x.json"], "does not apply to serve"),
])
def test_bad_setups_fail_before_listening(served, model, capsys, args, message):
    argv = ["serve"] + (args if args[0].startswith("/") else [str(model.model_path), *args])
    assert main(argv) == 2
    assert message in capsys.readouterr().err and not served


def _documented_serve_commands() -> list[str]:
    root = Path(__file__).resolve().parents[1]
    lines = []
    for doc in (root / "README.md", root / "docs" / "serve.md"):
        for line in doc.read_text().splitlines():
            if line.startswith("strata serve") and "--help" not in line:
                lines.append(line.split("#")[0].strip())
    return lines


def test_the_documented_serve_commands_parse():
    from strata.cli.main import build_parser

    commands = _documented_serve_commands()
    assert len(commands) >= 4
    for command in commands:
        args = build_parser().parse_args(shlex.split(command)[1:])
        assert args.command == "serve", command
