"""The analysis subcommands end to end on a tiny made model: trace -> replay / recall, quality,
sweep; JSON, CSV and PNG outputs; one-line errors."""

import csv
import json

import pytest

from strata.cli.main import main
from strata.testing.models import make_model

TEXT = "the cat sat on the mat and then the cat sat on the hat; " * 2


@pytest.fixture(scope="module")
def made(tmp_path_factory):
    return make_model(tmp_path_factory.mktemp("cli") / "tiny", "tiny", seed=0, n_experts=24)


@pytest.fixture(scope="module")
def trace_path(made, tmp_path_factory):
    path = tmp_path_factory.mktemp("tr") / "t.npz"
    assert main(["trace", str(made.model_path), TEXT, "-o", str(path), "--max-tokens", "40"]) == 0
    return path


def run(capsys, *argv):
    code = main([str(a) for a in argv])
    out, err = capsys.readouterr()
    return code, out, err


def test_replay_table_json_png(trace_path, tmp_path, capsys):
    code, out, _ = run(capsys, "replay", trace_path, "--caps", "min,50%", "--K", "0,4", "--lambda", "0,0.85",
                       "--opt", "--warmup", "5", "-o", tmp_path / "r", "--dump", tmp_path / "dump")
    assert code == 0, out
    assert "urgent miss/tok" in out and "Belady" in out
    doc = json.loads((tmp_path / "r.json").read_text())
    assert len(doc["runs"]) == 8 and doc["warmup"] == 5
    assert all(r["belady"]["misses"] <= r["totals"]["urgent_misses"] for r in doc["runs"] if r["prefetch_depth"] == 0)
    assert (tmp_path / "r.png").stat().st_size > 1000
    assert len(list((tmp_path / "dump").glob("*.npz"))) == 8


def test_replay_seed_preset_skips_illegal_arenas(trace_path, capsys):
    # 2 layers x top-4: K=10 needs 8 + 2·10 = 28 slots, K=16 needs 40, two-ahead K=10 needs 58
    code, out, err = run(capsys, "replay", trace_path, "--caps", "36", "--preset", "seed", "--tokens", "12")
    assert code == 0
    assert "K10 touch" in out and "no-prefetch" in out
    assert "K16" not in out and "K16" in err and "2ahead" in err


def test_recall(trace_path, tmp_path, capsys):
    code, out, _ = run(capsys, "recall", trace_path, "--K", "4,8", "-o", tmp_path / "rc.json")
    assert code == 0 and "recall@K" in out
    doc = json.loads((tmp_path / "rc.json").read_text())
    assert set(doc["results"][0]["recall"]) == {"4", "8"}


def test_quality_lambda_zero_is_exact(made, tmp_path, capsys):
    code, out, _ = run(capsys, "quality", made.model_path, TEXT, "--lambda", "0", "--cap", "min",
                       "--max-tokens", "16", "-o", tmp_path / "q.json")
    assert code == 0, out
    doc = json.loads((tmp_path / "q.json").read_text())
    assert doc["kld_mean"] == doc["kld_max"] == 0.0 and doc["relmse"] == 0.0


def test_sweep(made, tmp_path, capsys):
    code, out, _ = run(capsys, "sweep", made.model_path, TEXT, "--J", "1,3", "--lambda", "0,0.85",
                       "--cap", "60%", "--max-tokens", "12", "-o", tmp_path / "s")
    assert code == 0, out
    rows = list(csv.DictReader(open(tmp_path / "s.csv")))
    assert [r["label"] for r in rows] == ["λ0", "J1 λ0.85", "J3 λ0.85"]
    assert float(rows[0]["kld_max"]) == 0.0
    assert (tmp_path / "s.png").stat().st_size > 1000


@pytest.mark.parametrize("argv, fragment", [
    (["replay", "{trace}", "--caps", "3"], "legal arena"),
    (["replay", "{tmp}/nope.npz"], "no such trace"),
    (["quality", "{model}", "hello there", "--J", "1,2"], "one configuration"),
    (["replay", "{trace}", "--caps", "lots"], "capacity"),
])
def test_errors_are_one_line(made, trace_path, tmp_path, capsys, argv, fragment):
    argv = [a.format(trace=trace_path, tmp=tmp_path, model=made.model_path) for a in argv]
    code, _, err = run(capsys, *argv)
    assert code == 2
    assert fragment in err.strip().splitlines()[-1] and err.strip().splitlines()[-1].startswith("error: ")


def test_trace_shows_its_progress_token_by_token(made, tmp_path, capsys):
    from strata.loader import load
    from strata.tools.trace import record_trace

    with load(made.model_path) as model:
        seen = []
        record_trace(model.resident_params(), model.tokenizer.encode(TEXT)[:6], progress=seen.append)
        assert seen == [1, 2, 3, 4, 5, 6]
    code, out, err = run(capsys, "trace", made.model_path, TEXT, "-o", tmp_path / "p.npz", "--max-tokens", "12")
    assert code == 0 and "tracing" in err and "12/12" in err and "wrote" in out
    code, out, err = run(capsys, "trace", made.model_path, TEXT, "-o", tmp_path / "q.npz", "--max-tokens", "12",
                         "--quiet")
    assert code == 0 and "tracing" not in err
