"""Everything downstream on tier 2: `strata doctor DIR` plans with the tier-2 engine's own budget
rule and says what it does not predict; `strata trace` records the family's own selections (equal
to the ones mlx-lm's own model makes) and the read-ahead scores its gates give; a replay of that
trace at the run's arena makes the tier-2 runtime's cache decisions; recall scores its guesses."""

from __future__ import annotations

import json
from pathlib import Path

import numpy as np
import pytest

pytest.importorskip("mlx_lm")

import strata  # noqa: E402
from strata.cli.main import main  # noqa: E402
from strata.config import Config  # noqa: E402
from strata.doctor import diagnose  # noqa: E402
from strata.errors import ConfigError  # noqa: E402
from strata.runtime.budget import PROCESS_RESERVE  # noqa: E402
from strata.runtime.memory import MemoryInfo  # noqa: E402
from strata.tier2.engine import Tier2Engine, arena_plan_for  # noqa: E402
from strata.tools.closed_loop import LoopConfig  # noqa: E402
from strata.tools.recall import readahead_recall  # noqa: E402
from strata.tools.replay import replay  # noqa: E402
from strata.tools.tier2_trace import record_tier2_trace  # noqa: E402
from strata.tools.trace import load_trace, save_trace  # noqa: E402
from tests import tier2_models  # noqa: E402

from doctor_profile import PROFILE  # noqa: E402

TOKENS = [5, 17, 99, 200, 3, 45, 77, 12, 250, 31, 8, 140, 66, 2, 91, 180, 23, 230, 54, 111]
GB = 1_000_000_000
RECIPES = ("qwen3_moe_a4g32", "deepseek_v3_a4g32")  # a softmax gate; a sigmoid gate with a selection bias


@pytest.fixture(scope="module", params=RECIPES)
def made(request, tmp_path_factory):
    d = tier2_models.make_checkpoint(request.param, tmp_path_factory.mktemp("tier2tools") / request.param)
    with strata.load(d) as model:
        trace = record_tier2_trace(model, TOKENS)
        yield d, model, trace


def _mlx_lm_selections(directory: Path, tokens) -> np.ndarray:
    """The experts mlx-lm's own model (every expert resident) hands its switch layers, one token
    per forward. -> int64 [T, L, k]"""
    import mlx.core as mx
    from mlx_lm.models.cache import make_prompt_cache
    from mlx_lm.models.switch_layers import SwitchGLU

    model = tier2_models.mlx_lm_model(directory)
    seen: dict[int, list] = {}
    switches = [(p, m) for p, m in model.named_modules() if isinstance(m, SwitchGLU)]
    switches.sort(key=lambda t: [int(n) for n in t[0].split(".") if n.isdigit()])
    cls = type(switches[0][1])
    order = {id(m): i for i, (_, m) in enumerate(switches)}
    base = cls.__call__

    def patched(self, x, indices):
        seen.setdefault(order[id(self)], []).append(np.array(indices).reshape(-1, indices.shape[-1]))
        return base(self, x, indices)

    cls.__call__ = patched
    try:
        cache = make_prompt_cache(model)
        for t in tokens:
            mx.eval(model(mx.array([t])[None], cache=cache))
    finally:
        cls.__call__ = base
    assert len(seen) == len(switches)
    return np.stack([np.concatenate(seen[i]) for i in range(len(switches))], axis=1).astype(np.int64)


def test_the_trace_records_the_familys_own_selections(made):
    d, model, trace = made
    assert trace.family_routing and trace.n_tokens == len(TOKENS)
    assert (trace.n_layers, trace.n_experts, trace.top_k) == (model.cfg.n_moe_layers, model.cfg.n_experts,
                                                             model.cfg.n_experts_per_token)
    np.testing.assert_array_equal(trace.selected, _mlx_lm_selections(d, TOKENS))
    L = trace.n_layers
    assert set(trace.guesses) == {a for a in (1, 2) if a < L}
    assert trace.guess_logits(1).shape == (len(TOKENS), L - 1, trace.n_experts)
    assert np.isfinite(trace.guess_logits(1)).all() and np.isfinite(trace.logits).all()


def test_trace_round_trips_and_recall_scores_the_guesses(made, tmp_path):
    _, _, trace = made
    back = load_trace(save_trace(tmp_path / "t", trace))
    assert back.family_routing and back.top_k == trace.top_k
    np.testing.assert_array_equal(back.selected, trace.selected)
    for a in (1, 2):
        np.testing.assert_array_equal(back.guess_logits(a), trace.guess_logits(a))
    E = trace.n_experts
    r = readahead_recall(back, (trace.top_k, E))
    assert r.recall[E] == 1.0 and r.top1[E] == 1.0  # every expert is in a guess of all of them
    g = np.argsort(-trace.guess_logits(1), axis=-1, kind="stable")[..., : trace.top_k]
    truth = trace.selected[:, 1:]
    want = np.mean([len(set(g[t, l]) & set(truth[t, l])) / trace.top_k
                    for t in range(trace.n_tokens) for l in range(trace.n_layers - 1)])
    assert r.recall[trace.top_k] == pytest.approx(want)
    assert np.isnan(r.weight_recall[E])  # tier 2 records no combine weights


@pytest.mark.parametrize("switch", [dict(prefetch=2), dict(prefetch=2, prefetch2=True), dict(prefetch=0),
                                    dict(prefetch=3, split_turn=False)], ids=["k2", "pf2", "none", "in-turn"])
def test_replay_of_the_trace_makes_the_runtimes_decisions(made, switch):
    """The tier-2 runtime, decoding the trace's tokens at a small arena, and the replay of its
    trace at that arena: the same cache counts (all but late read-aheads, I/O timing's)."""
    _, model, trace = made
    config = Config(**switch)
    cap = arena_plan_for(model, config.replace(arena="1000000slots")).min_slots + 3
    with Tier2Engine(model, config, cap) as engine:
        for t in TOKENS:
            engine.decode(t)
        got = engine.streamer.totals
    sim = replay(trace, LoopConfig.from_config(config, cap)).stats
    assert got.urgent_misses > 0
    want, have = vars(got).copy(), vars(sim).copy()
    want.pop("late_readaheads"), have.pop("late_readaheads")
    assert have == want


def test_replay_refuses_moce_on_a_tier2_trace(made):
    _, _, trace = made
    with pytest.raises(ConfigError, match="tier-2 model's own routing"):
        replay(trace, LoopConfig(capacity=trace.n_layers * trace.n_experts))


def test_trace_replay_recall_cli(made, tmp_path, capsys):
    d, _, _ = made
    path = tmp_path / "t.npz"
    assert main(["trace", str(d), "@" + str(_text(tmp_path)), "-o", str(path), "--quiet"]) == 0
    assert "wrote" in capsys.readouterr().out
    assert main(["replay", str(path), "--caps", "min,50%", "--K", "0,2"]) == 0
    out = capsys.readouterr().out
    assert "λ0" in out and "urgent miss/tok" in out
    assert main(["replay", str(path), "--caps", "min", "--windows", "2"]) == 0
    capsys.readouterr()
    assert main(["recall", str(path), "--K", "2,4"]) == 0
    assert "recall@K" in capsys.readouterr().out
    assert main(["replay", str(path), "--lambda", "0.5"]) != 0
    assert "tier-2 model's own routing" in capsys.readouterr().err
    assert main(["recall", str(path), "--q8"]) != 0
    assert "--q8" in capsys.readouterr().err


def _text(tmp_path) -> Path:
    p = tmp_path / "text.txt"
    p.write_text("tier two traces ")
    return p


# ---------------------------------------------------------------- doctor


def _doctor(d, available, config=None):
    mem = MemoryInfo(total=max(available, 24 * GB), available=available, source="test")
    return diagnose(d, cache_dir=None, config=config or Config(), profile=PROFILE, memory=mem)


def test_doctor_plans_a_tier2_directory_with_the_engines_rule(made):
    d, model, _ = made
    t = model.tensors
    full = _doctor(d, 20 * GB)
    t2 = full.tier2
    assert t2.verdict == "fits resident" and t2.slot_bytes == t.slot_bytes and t2.dense_bytes == model.dense_bytes
    text = full.text()
    assert "verdict: fits resident on tier 2" in text and "tier: 2 as it is" in text
    assert "predicted decode: none for tier 2" in text and "not supported" not in text
    # memory for the base process, the dense weights, keep and a number of slots between the
    # smallest legal arena and every expert: the budget rule streams at that number
    assert t2.min_slots < t.n_records
    slots = (t2.min_slots + t.n_records) // 2
    short = _doctor(d, PROFILE.base_rss + model.dense_bytes + PROCESS_RESERVE + slots * t.slot_bytes).tier2
    assert short.verdict == "streams" and short.arena_slots == slots
    # an explicit arena: the slots the engine itself opens with
    config = Config(arena=f"{slots + 1}slots")
    asked = _doctor(d, 20 * GB, config).tier2
    with Tier2Engine.open(model, config) as engine:
        assert asked.arena_slots == engine.arena.capacity
    assert json.loads(_doctor(d, 20 * GB, config).to_json())["tier2"]["arena_slots"] == asked.arena_slots


def test_doctor_says_when_tier2_will_not_run(made):
    d, _, _ = made
    low = _doctor(d, 1000)
    assert low.tier2.verdict == "will not run" and "needs at least" in low.tier2.refusal
    assert "verdict: will not run on tier 2" in low.text()
    moce = _doctor(d, 20 * GB, Config(moce_lambda=0.5, moce_drop_tail=0.05)).tier2
    assert moce.verdict == "will not run" and "MoCE" in moce.refusal
    from strata.tier2.moce import MOCE_MODEL_TYPES

    bonus = _doctor(d, 20 * GB, Config(moce_lambda=0.5)).tier2  # a bonus alone runs where tier 2 replaces the gate
    assert bonus.runs == (bonus.model_type in MOCE_MODEL_TYPES)
    assert bonus.runs or "routes inside its MoE block" in bonus.refusal


# ---------------------------------------------------------------- convert: the experts as aligned records


@pytest.mark.parametrize("recipe", ["qwen3_moe_a4g32", "qwen3_next_mixed_4_6"])  # one form; two (a mixed recipe)
def test_convert_repacks_the_experts_bits_unchanged(recipe, tmp_path, capsys):
    """`strata convert DIR` writes the experts as aligned records; tier 2 then reads one record per
    expert and every score is the in-place run's, bit for bit, at full residency and at the
    smallest legal arena; a shard changed after the repack is refused naming the fix."""
    import os

    from strata.tier2.records import RECORDS_NAME

    d = tier2_models.make_checkpoint(recipe, tmp_path / "q")
    config = Config(prefetch=2)

    def scores(arena):
        with strata.load(d) as model:
            least = arena_plan_for(model, config.replace(arena="1000000slots")).min_slots
            cap = least if arena == "min" else model.tensors.n_records
            with Tier2Engine(model, config, cap) as engine:
                rows = [engine.prefill(TOKENS)] + [engine.decode(t) for t in TOKENS[:5]]
                return np.stack(rows), model.tensors.records, engine.io.note

    before = {a: scores(a) for a in ("min", "all")}
    assert before["min"][1] is None
    assert main(["convert", str(d), "--quiet"]) == 0
    assert "wrote" in capsys.readouterr().out and (d / RECORDS_NAME).exists()
    for a in ("min", "all"):
        got, records, note = scores(a)
        assert records == d / RECORDS_NAME and "aligned records" in note
        np.testing.assert_array_equal(got, before[a][0])
    shard = next(d.glob("*.safetensors"))
    os.utime(shard, ns=(0, 0))
    with pytest.raises(Exception, match="strata convert"):
        strata.load(d)
    assert main(["convert", str(d), "--quiet"]) == 0  # repacked again from the shards as they are now
    with strata.load(d) as model:
        assert model.tensors.records is not None
    assert main(["convert", str(tmp_path / "nowhere")]) != 0
    assert "give OUT" in capsys.readouterr().err
