"""`strata generate` with runtime flags: streaming on request, the report line and --report-json,
environment under flags, clear errors."""

import json

import pytest

from strata.cli.main import main
from strata.testing.models import make_model

REPORT_FIELDS = {"tokens", "ms_per_token", "urgent_misses_per_token", "readahead_hits_per_token",
                 "reads_per_token", "bytes_per_token", "hit_rate", "host_ms_per_window",
                 "waiting_ms_per_window", "late", "after_ms", "misses_by_rank", "arena_slots", "arena_bytes"}


@pytest.fixture(scope="module")
def model_path(tmp_path_factory):
    return str(make_model(tmp_path_factory.mktemp("cli") / "tiny", "tiny", seed=5, n_experts=32).model_path)


def test_generate_streams_and_writes_the_report(model_path, tmp_path, capsys, monkeypatch):
    monkeypatch.setenv("STRATA_PREFETCH", "16")  # the flag below wins
    out = tmp_path / "r.json"
    rc = main(["generate", model_path, "hello", "-n", "5", "--arena", "20slots", "--prefetch", "4",
               "--no-split-turn", "--moce-lambda", "0", "--set", "io_timeout=9", "--report-json", str(out)])
    assert rc == 0
    report = json.loads(out.read_text())
    assert REPORT_FIELDS <= set(report) and report["arena_slots"] == 20 and report["tokens"] == 4
    assert "stream: 4 tokens" in capsys.readouterr().err


def test_environment_reaches_the_run_and_errors_are_clear(model_path, capsys, monkeypatch):
    monkeypatch.setenv("STRATA_PREFETCH", "16")
    assert main(["generate", model_path, "hello", "-n", "2", "--arena", "20slots"]) == 2
    assert "needs at least 40 slots" in capsys.readouterr().err
    monkeypatch.setenv("STRATA_PREFETCHH", "1")
    assert main(["generate", model_path, "hello", "-n", "2"]) == 2
    assert "environment variable STRATA_PREFETCHH" in capsys.readouterr().err


def test_all_resident_run_writes_a_stub_report(model_path, tmp_path):
    out = tmp_path / "r.json"
    assert main(["generate", model_path, "hi", "-n", "2", "--quiet", "--report-json", str(out)]) == 0
    assert json.loads(out.read_text()) == {"streaming": False}
