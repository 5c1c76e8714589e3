"""Replay with T-position windows (strata.tools.windows): windows of one position are the
ordinary replay; a window's union is pinned as one turn; the suffix plan's acceptance follows
the trace's tokens; windows of 3 replayed make the runtime's `decode_window` decisions."""

import json
import tempfile
from dataclasses import asdict, replace
from pathlib import Path

import numpy as np
import pytest

import strata
from strata.cli.main import main
from strata.config import Config
from strata.formats.experts_file import ExpertsFile
from strata.testing.engines import open_numpy_streaming
from strata.testing.models import make_model
from strata.tools.quality import fast_params
from strata.tools.trace import record_trace
from strata.reference.routing import MoCEPolicy
from strata.tools.closed_loop import LoopConfig
from strata.tools.replay import replay
from strata.tools.windows import fixed_windows, replay_windows, suffix_windows
from test_tools_synthetic import synthetic_trace


@pytest.fixture(scope="module")
def trace():
    return synthetic_trace(n_tokens=40, n_layers=3, n_experts=16, top_k=3)


@pytest.mark.parametrize("policy", [None, MoCEPolicy()], ids=["λ0", "moce"])
def test_windows_of_one_are_the_ordinary_replay(trace, policy):
    config = LoopConfig(capacity=30, prefetch_depth=4, policy=policy)
    got = replay_windows(trace, config, fixed_windows(trace.n_tokens, 1), warmup=5)
    want = replay(trace, config, warmup=5)
    assert got.stats == want.stats and got.tokens == want.tokens == trace.n_tokens - 5


def test_a_window_turns_once_per_layer_with_its_union(trace):
    config = LoopConfig(capacity=60, prefetch_depth=0, policy=None)
    one = replay_windows(trace, config, fixed_windows(trace.n_tokens, 1))
    four = replay_windows(trace, config, fixed_windows(trace.n_tokens, 4))
    assert four.windows == 10 and four.tokens == one.tokens == 40
    assert four.stats.lookups < one.stats.lookups  # an expert two positions share is looked up once
    assert trace.top_k < four.union_per_layer <= 4 * trace.top_k
    assert four.union_per_layer == pytest.approx(np.mean(
        [len(set(trace.selected[s:s + 4, l].ravel().tolist())) for s in range(0, 40, 4) for l in range(3)]))


def test_the_suffix_plan_accepts_what_the_text_repeats(trace):
    tokens = np.array([1, 2, 3, 4, 5] * 8)
    plan = suffix_windows(tokens, 2)
    assert sum(w.tokens for w in plan.windows) == len(tokens)
    assert all(w.tokens <= w.positions <= 3 for w in plan.windows)
    late = [w for w in plan.windows if w.start >= 10]
    assert late and all(w.tokens == w.positions == 3 for w in late[:-1])  # the repeat is drafted and kept
    rnd = suffix_windows(np.arange(40), 2)
    assert all(w.positions == 1 for w in rnd.windows)  # nothing repeats: no drafts
    result = replay_windows(replace(trace, tokens=tokens), LoopConfig(capacity=60, prefetch_depth=2, policy=None), plan)
    assert result.acceptance > 0.8 and result.tokens == 40 and result.config.window == 3


def test_strata_replay_with_windows_writes_a_table_and_json(tmp_path, capsys):
    made = make_model(tmp_path / "tiny", "tiny", seed=0)
    text = "the cat sat on the mat; the cat sat on the mat; the cat sat on the hat"
    assert main(["trace", str(made.model_path), text, "-o", str(tmp_path / "t.npz")]) == 0
    code = main(["replay", str(tmp_path / "t.npz"), "--caps", "min,80", "--windows", "3", "--suffix-draft", "1,2",
                 "--lambda", "0", "-o", str(tmp_path / "w")])
    out, _ = capsys.readouterr()
    assert code == 0 and "vs T=1" in out and "suffix-2" in out
    doc = json.loads((tmp_path / "w.json").read_text())
    assert [r["plan"] for r in doc["runs"]] == ["T=1", "T=3 (all accepted)", "suffix-1", "suffix-2"] * 2
    assert doc["slot_bytes"] == made_slot_bytes(made)
    assert all(r["bytes_per_token"] == r["reads_per_token"] * doc["slot_bytes"] for r in doc["runs"])
    assert doc["runs"][3]["acceptance"] > 0  # the text repeats


def made_slot_bytes(made) -> int:
    xf = ExpertsFile.open(made.experts_path)
    try:
        return xf.header.padded_bytes
    finally:
        xf.close()


def test_window_replay_matches_the_runtimes_windows():
    """At λ = 0 the replay of windows of 3 over a decode-order trace makes the runtime's decisions
    when it runs the same text as `decode_window`s of 3 (every count but the timing-dependent
    late read-aheads)."""
    with tempfile.TemporaryDirectory() as d:
        made = make_model(Path(d) / "m", "tiny", seed=7, n_layers=3, n_experts=32)
        model = strata.load(made.model_path)
        tokens = model.tokenizer.encode("def fib(n): return n if n < 2 else fib(n-1)")[:24]
        trace = record_trace(fast_params(model.resident_params()), tokens)
        config = Config(moce_lambda=0.0, window=3)
        cap = LoopConfig.from_config(config, 1).cache_config(3, 32, 4).min_capacity + 5
        config = config.replace(arena=f"{cap}slots")
        with open_numpy_streaming(model, config) as engine:
            for s in range(0, len(tokens), 3):
                engine.decode_window(tokens[s:s + 3])
            got = asdict(engine.streamer.totals)
        model.close()
    sim = replay_windows(trace, LoopConfig.from_config(config, cap), fixed_windows(len(tokens), 3))
    want = asdict(sim.stats)
    for d in (got, want):
        d.pop("late_readaheads")
    assert got == want and got["urgent_misses"] > 0
