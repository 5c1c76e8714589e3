"""Hub ids (`Qwen/Qwen3-30B-A3B`) resolved from a local Hugging Face cache laid out here as the hub
client lays it out (models--OWNER--NAME/refs/main, snapshots/<commit>/), with no network: the
cache location follows HF_HUB_CACHE / HF_HOME, a strata model in a snapshot loads, a checkpoint
converts, and an id not in the cache is refused in one line."""

from pathlib import Path

import pytest

import strata
from hf_fixtures import copy_checkpoint
from strata.cli.main import main
from strata.errors import FormatError
from strata.hub_cache import hub_cache_dir, looks_like_hub_id, snapshot_dir
from strata.testing.models import make_model

COMMIT = "0123456789abcdef0123456789abcdef01234567"


def lay_out(cache: Path, repo_id: str, commit: str = COMMIT) -> Path:
    """An empty snapshot of `repo_id` at `commit`, with refs/main pointing at it."""
    repo = cache / ("models--" + repo_id.replace("/", "--"))
    (repo / "refs").mkdir(parents=True)
    (repo / "refs" / "main").write_text(commit)
    snapshot = repo / "snapshots" / commit
    snapshot.mkdir(parents=True)
    (repo / "snapshots" / ("f" * 40)).mkdir()  # an older commit: refs/main decides, not the directory listing
    return snapshot


@pytest.fixture
def cache(tmp_path, monkeypatch):
    d = tmp_path / "hub"
    monkeypatch.setenv("HF_HUB_CACHE", str(d))
    monkeypatch.chdir(tmp_path)
    return d


def test_the_cache_directory_follows_the_hub_clients_variables():
    assert hub_cache_dir({"HF_HUB_CACHE": "/a", "HF_HOME": "/b"}) == Path("/a")
    assert hub_cache_dir({"HUGGINGFACE_HUB_CACHE": "/c", "HF_HOME": "/b"}) == Path("/c")
    assert hub_cache_dir({"HF_HOME": "/b"}) == Path("/b/hub")
    assert hub_cache_dir({"XDG_CACHE_HOME": "/x", "HOME": "/h"}) == Path("/x/huggingface/hub")
    assert hub_cache_dir({"HOME": "/h"}) == Path("/h/.cache/huggingface/hub")


def test_a_path_wins_over_a_hub_id(tmp_path, monkeypatch):
    monkeypatch.chdir(tmp_path)
    assert looks_like_hub_id("Qwen/Qwen3-30B-A3B") and not looks_like_hub_id("/data/qwen3")
    assert not looks_like_hub_id("out/tiny.gguf") and not looks_like_hub_id("a/../b")
    make_model(tmp_path / "out" / "tiny", "tiny", seed=0)
    assert not looks_like_hub_id("out/tiny")  # out/tiny.gguf is there: a path without its suffix


def test_a_strata_model_in_a_snapshot_loads_and_generates(cache, capsys):
    snapshot = lay_out(cache, "someone/tiny-strata")
    make_model(snapshot / "tiny", "tiny", seed=1)
    with strata.load("someone/tiny-strata") as model:
        assert model.model_path == snapshot / "tiny.gguf"
        want = strata.generate(model, "hi", max_tokens=4).text
    assert main(["generate", "someone/tiny-strata", "hi", "-n", "4", "--quiet"]) == 0
    assert capsys.readouterr().out == want + "\n"


def test_a_checkpoint_in_the_cache_converts_but_does_not_generate(cache, tmp_path, capsys):
    snapshot = lay_out(cache, "Qwen/Qwen3-30B-A3B")
    snapshot.rmdir()
    copy_checkpoint("qwen3_moe", snapshot)
    assert snapshot_dir("Qwen/Qwen3-30B-A3B") == snapshot
    assert main(["generate", "Qwen/Qwen3-30B-A3B", "hi"]) == 2
    err = capsys.readouterr().err.strip()
    assert err.startswith("error: Qwen/Qwen3-30B-A3B: a Hugging Face checkpoint") and "\n" not in err
    assert "strata convert Qwen/Qwen3-30B-A3B OUT" in err
    assert main(["convert", "Qwen/Qwen3-30B-A3B", str(tmp_path / "q3"), "--quiet"]) == 0
    assert (tmp_path / "q3.gguf").exists() and (tmp_path / "q3.experts").exists()
    capsys.readouterr()


def test_a_hub_id_not_in_the_cache_is_refused_in_one_line(cache, capsys):
    for argv in (["generate", "Qwen/Qwen3-30B-A3B", "hi"], ["convert", "Qwen/Qwen3-30B-A3B", "out"],
                 ["serve", "Qwen/Qwen3-30B-A3B"]):
        assert main(argv) == 2
        err = capsys.readouterr().err.strip()
        assert "\n" not in err and err.startswith("error: Qwen/Qwen3-30B-A3B: not in the local Hugging Face cache")
        assert str(cache) in err and "hf download Qwen/Qwen3-30B-A3B" in err
    repo = lay_out(cache, "Qwen/Qwen3-30B-A3B").parents[1]
    (repo / "refs" / "main").unlink()
    with pytest.raises(FormatError, match="no refs/main: the download did not finish"):
        strata.load("Qwen/Qwen3-30B-A3B")



def test_a_cached_hub_id_alone_is_taken_for_a_model_not_a_prompt(cache, capsys):
    lay_out(cache, "Qwen/Qwen3-30B-A3B")
    assert main(["generate", "Qwen/Qwen3-30B-A3B"]) == 2
    assert "looks like a model, not a prompt" in capsys.readouterr().err
    assert main(["generate", "and/or", "-n", "2", "--quiet"]) == 0  # not in the cache: a prompt
    assert "looks like a model" not in capsys.readouterr().err
