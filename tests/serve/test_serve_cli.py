"""`strata serve`: flags, loopback by default, errors before listening."""

import shlex
from pathlib import Path

import pytest
from serve_support import model_fixture

import strata
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


def test_the_embedded_model_is_served_when_none_is_named(served, capsys):
    assert main(["serve"]) == 0
    state = served[0][0].state.strata
    assert state.name == "default" and state.chat_template  # it chats out of the box
    assert "only /v1/completions" not in capsys.readouterr().err


def test_a_model_without_a_chat_template_is_announced_as_completions_only(served, model, capsys):
    assert model.tokenizer.chat_template is None
    assert main(["serve", str(model.model_path)]) == 0
    err = capsys.readouterr().err
    assert "no chat template: only /v1/completions is available" in err and "--chat-template FILE" in err
    assert main(["serve", str(model.model_path), "--chat-template", str(_template_file(model))]) == 0
    assert "only /v1/completions" not in capsys.readouterr().err


def _template_file(model) -> Path:
    path = Path(model.model_path).with_name("chat.jinja")
    path.write_text("{% for m in messages %}{{ m.content }}{% endfor %}")
    return path


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
    root = Path(__file__).resolve().parents[2]
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


def test_ctx_and_stop_apply_to_every_request(served, model):
    from starlette.testclient import TestClient

    full = strata.generate(model, "ab", max_tokens=40).text
    stop = full[10:12]
    assert "\\" not in stop and full.index(stop) > 0
    assert main(["serve", str(model.model_path), "--ctx", "64", "--stop", stop, "--name", "tiny"]) == 0
    (app, _), = served
    state = app.state.strata
    assert state.context == 64 and state.stops == (stop,)
    with TestClient(app) as client:
        r = client.post("/v1/completions", json={"model": "tiny", "prompt": "x" * 80, "max_tokens": 4})
        assert r.status_code == 400 and r.json()["error"]["code"] == "context_length_exceeded"
        r = client.post("/v1/completions", json={"model": "tiny", "prompt": "ab", "max_tokens": 40,
                                                 "temperature": 0})
        assert r.json()["choices"][0]["text"] == full[:full.index(stop)]
        assert r.json()["choices"][0]["finish_reason"] == "stop"


def test_a_ctx_beyond_the_model_fails_before_listening(served, model, capsys):
    assert main(["serve", str(model.model_path), "--ctx", "100000"]) == 2
    assert "--ctx: 100000 is more than the model's context of 2048" in capsys.readouterr().err and not served
