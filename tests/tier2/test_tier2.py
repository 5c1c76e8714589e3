"""Tier 2 (strata.tier2): tiny random checkpoints made with mlx-lm's own model classes and
quantized by its own quantize_model run through strata's streamed expert layer:

- greedy tokens identical to mlx-lm's own all-resident generate on the same files;
- every score (mlx-lm's log-probabilities, as its sampler sees them) bit for bit, at full
  residency and at the smallest legal arena (where prompt layers run in several passes);
- decisions (the cache's turns and actions) and tokens independent of injected read delays;
- without mlx-lm a checkpoint directory is refused in one line naming the extra; nothing is
  written beside the checkpoint; the report says which tier runs and why."""

from __future__ import annotations

import os
import sys

import numpy as np
import pytest

pytest.importorskip("mlx_lm")

import strata  # noqa: E402
from strata.cache.types import AtLayer  # noqa: E402
from strata.config import Config  # noqa: E402
from strata.engines import open_engine  # noqa: E402
from strata.errors import ConfigError  # noqa: E402
from strata.generate import generate  # noqa: E402
from strata.testing.faults import RandomDelays  # noqa: E402
from strata.tier2.engine import arena_plan_for  # noqa: E402
from tests import tier2_models  # noqa: E402

PROMPT = [5, 17, 99, 200, 3, 45, 77, 12, 250, 31, 8, 140, 66, 2, 91, 180, 23, 230, 54, 111]
STEPS = 6
SMALL = Config(prefetch=2)  # a small read-ahead depth: the smallest legal arena is well below the experts
# recipes whose prompt (at the smallest arena) has a layer run in several passes: the multi-pass
# path is held to mlx-lm bit for bit on these at least
SPLITS = ("qwen3_moe_a4g32", "qwen3_next_a6g32", "mixtral_a8g32", "deepseek_v3_a4g32")


DELAYED = ("qwen3_moe_a4g32", "qwen3_next_a6g32", "deepseek_v3_a4g32")  # one plain, one hybrid, one MLA family
_MADE: dict = {}


def _made(recipe: str, tmp_path_factory):
    """(recipe, checkpoint dir, mlx-lm's greedy tokens, its scores under generate_step's schedule),
    made once per recipe."""
    if recipe not in _MADE:
        d = tier2_models.make_checkpoint(recipe, tmp_path_factory.mktemp("tier2") / recipe)
        tokens = tier2_models.mlx_lm_generate(d, PROMPT, STEPS)
        _MADE[recipe] = recipe, d, tokens, tier2_models.mlx_lm_schedule_logits(d, PROMPT, tokens[:-1])
    return _MADE[recipe]


@pytest.fixture(scope="module", params=sorted(tier2_models.RECIPES))
def made(request, tmp_path_factory):
    return _made(request.param, tmp_path_factory)


@pytest.fixture(scope="module", params=DELAYED)
def delayed_family(request, tmp_path_factory):
    return _made(request.param, tmp_path_factory)


@pytest.fixture(scope="module")
def qwen3(tmp_path_factory):
    return _made("qwen3_moe_a4g32", tmp_path_factory)


def _scores(model, config: Config, continuation, **kw) -> tuple[np.ndarray, object]:
    with open_engine(model, config, **kw) as engine:
        rows = [engine.prefill(PROMPT)]
        rows += [engine.decode(t) for t in continuation]
        return np.stack(rows), engine


def test_greedy_tokens_equal_mlx_lm_generate(made):
    recipe, d, want, _ = made
    before = sorted(os.listdir(d))
    with strata.load(d) as model:
        assert all(s is not None for s in model.scorers)  # every MoE layer's gate gives read-ahead guesses
        result = generate(model, PROMPT, max_tokens=STEPS)
    assert result.tokens == want
    assert sorted(os.listdir(d)) == before  # nothing written beside the checkpoint
    assert "tier 2: mlx-lm's" in result.report.io


@pytest.mark.parametrize("arena", ["full", "smallest"])
def test_scores_bit_for_bit(made, arena):
    recipe, d, tokens, want = made
    with strata.load(d) as model:
        config = SMALL
        if arena == "smallest":
            least = arena_plan_for(model, SMALL.replace(arena="1000000slots")).min_slots
            assert least < model.tensors.n_records  # the arena really streams
            config = SMALL.replace(arena=f"{least}slots")
        ours, engine = _scores(model, config, tokens[:-1], keep_trace=True)
        if arena == "smallest":
            assert engine.arena.capacity == least
            assert engine.stats().cache.reads_issued > least  # slots were reused
            assert model.cfg.n_experts > least  # so a prompt layer's experts can exceed the arena
            widest = max(len(ev.selected) for ev in engine.streamer.trace if isinstance(ev, AtLayer))
            if widest > least or recipe in SPLITS:  # such a layer runs in several passes
                assert engine.stream.split_layers > 0
    assert np.array_equal(ours, want), f"{recipe} at the {arena} arena: max |d| {np.abs(ours - want).max()}"


@pytest.mark.parametrize("seed", [1, 2])
def test_decisions_independent_of_read_delays(delayed_family, seed):
    recipe, d, tokens, want = delayed_family
    with strata.load(d) as model:
        least = arena_plan_for(model, SMALL.replace(arena="1000000slots")).min_slots
        config = SMALL.replace(arena=f"{least + 1}slots", io_threads=3)
        runs = []
        for hook in (None, RandomDelays(seed, max_ms=1.0)):
            scores, engine = _scores(model, config, tokens[:-1], hook=hook, keep_trace=True)
            runs.append((scores, engine.streamer.trace, engine.streamer.decisions))
    (s0, t0, d0), (s1, t1, d1) = runs
    assert np.array_equal(s0, want) and np.array_equal(s1, want)
    assert t1 == t0  # the turns the machine was fed: the family's selections and the gate's guesses
    assert d1 == d0  # Read, Cancel, Evict, Use: slot for slot


def test_without_mlx_lm_refused_naming_the_extra(qwen3, monkeypatch):
    _, d, _, _ = qwen3
    monkeypatch.setitem(sys.modules, "mlx_lm", None)  # import mlx_lm raises ImportError
    with pytest.raises(ConfigError) as e:
        strata.load(d)
    assert "strata-moe[mlx-lm]" in str(e.value) and "\n" not in str(e.value)


def test_cli_generate_takes_the_directory(qwen3, capsys):
    recipe, d, want, _ = qwen3
    from strata.cli.main import main

    assert main(["generate", str(d), "hi", "-n", "3"]) == 0
    err = capsys.readouterr().err
    assert "tier 2: mlx-lm's qwen3_moe model file" in err and "strata convert" in err


def test_serve_runs_the_directory(qwen3):
    recipe, d, want, _ = qwen3
    from starlette.testclient import TestClient

    from strata.serve import build_app

    with strata.load(d) as model, TestClient(build_app(model)) as client:
        r = client.post("/v1/completions", json={"model": d.name, "prompt": PROMPT, "max_tokens": STEPS,
                                                 "temperature": 0})
    assert r.status_code == 200, r.text
    assert r.json()["choices"][0]["text"] == model.tokenizer.decode(want)


def test_experts_stored_in_other_pieces_refused_in_one_line(tmp_path):
    """Layers whose experts differ in bits run (the mixed recipes above); a layer whose experts
    are other pieces (left unquantized beside quantized ones) is refused."""
    from strata.errors import FormatError

    def first_layer_unquantized(path, module):
        return not path.startswith("model.layers.0.mlp.switch")

    d = tier2_models.make_checkpoint("qwen3_moe_a4g32", tmp_path / "mixed", quant_predicate=first_layer_unquantized)
    with pytest.raises(FormatError) as e:
        strata.load(d)
    assert "mixed per-layer expert formats" in str(e.value) and "\n" not in str(e.value)


@pytest.mark.parametrize("recipe", [r for r in sorted(tier2_models.RECIPES) if "_mixed_" in r])
def test_mixed_recipes_stream_each_layer_in_its_own_bits(recipe, tmp_path_factory):
    """Under mlx-lm's mixed recipes the layers store experts in two forms: each layer reads its
    own bytes per expert, into a slot sized for the largest (the scores' bit-for-bit equality at
    the smallest arena, where slots pass between layers of both forms, is test_scores_bit_for_bit)."""
    _, d, _, _ = _made(recipe, tmp_path_factory)
    with strata.load(d) as model:
        t = model.tensors
        assert len(t.formats) == 2
        sizes = {t.layer_record_bytes(m) for m in range(t.n_layers)}
        assert len(sizes) == 2 and t.record_bytes == max(sizes) <= t.slot_bytes
        assert sum(p.nbytes for p in t.pieces) == max(sizes)  # the largest form holds every piece's largest
        with open_engine(model, SMALL.replace(arena="1000000slots")) as engine:
            for m in range(t.n_layers):
                stored = {p.name: p for p in t.layer_pieces[m]}
                assert [b.nbytes for b in engine.arena.piece_buffers(0, m)] == [p.nbytes for p in stored.values()]
                down = model.switches[m][3]["down_proj"]  # mlx-lm's layer, its arrays now the arena's
                assert down["weight"] is engine.arena.arrays_of(m)["down_proj.weight"]
                assert tuple(down["weight"].shape[1:]) == stored["down_proj.weight"].shape
                assert down["weight"].shape[-1] * 32 == down.bits * down.input_dims
        assert len({model.switches[m][3]["down_proj"].bits for m in range(t.n_layers)}) == 2


@pytest.fixture(scope="module")
def hybrid(tmp_path_factory):
    return _made("qwen3_next_a6g32", tmp_path_factory)


@pytest.mark.parametrize("which", ["qwen3", "hybrid"])
def test_a_session_continues_a_prompt_it_holds(which, request):
    """A second call whose prompt extends the first's text: attention-only caches trim to the
    common prefix and prefill the rest; a hybrid's recurrent state restores only all or nothing."""
    _, d, _, _ = request.getfixturevalue(which)
    with strata.load(d) as model:
        first = generate(model, PROMPT, max_tokens=STEPS).tokens
        again = generate(model, PROMPT + first[:3], max_tokens=STEPS - 3)
    assert again.tokens == first[3:]
    assert (again.prompt_reused > 0) == (which == "qwen3")


def test_speculative_windows_keep_greedy_tokens(qwen3):
    _, d, _, _ = qwen3
    prompt = [5, 17, 99, 200, 3] * 4  # repeats: the suffix drafter drafts
    with strata.load(d) as model:
        plain = generate(model, prompt, max_tokens=16).tokens
    with strata.load(d) as model:
        spec = generate(model, prompt, max_tokens=16, config=Config(suffix_draft=2, spec_gate=False))
    assert spec.tokens == plain
    assert spec.speculation.spec_windows > 0  # a window was drafted (and its rejected drafts rolled back)


class _CorruptSecondRead:
    """Flips a byte of every expert's second read (its first read set the checksum to hold it to)."""

    def __init__(self) -> None:
        self.seen: dict = {}

    def before(self, req) -> None:
        pass

    def after(self, req, buf, got: int) -> int:
        key = (req.layer, req.expert)
        self.seen[key] = self.seen.get(key, 0) + 1
        if self.seen[key] == 2:
            buf[0] ^= 0xFF
        return got


@pytest.mark.parametrize("fault", ["eio", "short", "changed"])
def test_bad_reads_refused_naming_the_expert(qwen3, fault):
    from strata.errors import ExpertReadError
    from strata.testing.faults import Faults

    _, d, tokens, _ = qwen3
    with strata.load(d) as model:
        least = arena_plan_for(model, SMALL.replace(arena="1000000slots")).min_slots
        config = SMALL.replace(arena=f"{least}slots")
        everything = {(m, e) for m in range(model.cfg.n_moe_layers) for e in range(model.cfg.n_experts)}
        hook = {"eio": Faults(eio=everything), "short": Faults(short=everything), "changed": _CorruptSecondRead()}
        with pytest.raises(ExpertReadError) as e:
            _scores(model, config, tokens[:-1], hook=hook[fault])
    want = {"eio": "read error", "short": "short read", "changed": "checksum mismatch"}[fault]
    assert want in str(e.value) and "layer" in str(e.value) and "expert" in str(e.value)


def test_the_benchmark_runs_and_reports_every_row(qwen3, capsys, monkeypatch):
    import json
    import runpy
    from pathlib import Path

    _, d, _, _ = qwen3
    script = Path(__file__).resolve().parents[2] / "benchmarks" / "tier2.py"
    monkeypatch.setattr(sys, "argv", [str(script), str(d), "--tokens", "3", "--prompt-tokens", "8"])
    runpy.run_path(str(script), run_name="__main__")
    res = json.loads(capsys.readouterr().out.splitlines()[-1])
    assert len(res["rows"]) == 4 and all(r["ms_per_token"] > 0 for r in res["rows"].values())
    assert res["rows"]["tier 2, quarter arena, read-ahead off"]["readahead_hits_per_token"] == 0


@pytest.mark.parametrize("setting", [dict(moce_lambda=0.85), dict(moce_drop_tail=0.05), dict(backend="numpy"),
                                     dict(kv_cache="f16"), dict(logpos="/tmp/x"), dict(layer_pins=True)])
def test_settings_tier_2_would_ignore_are_refused(qwen3, setting):
    _, d, _, _ = qwen3
    with strata.load(d) as model, pytest.raises(ConfigError) as e:
        open_engine(model, Config(**setting))
    assert "\n" not in str(e.value)


def test_two_engines_over_one_model_keep_their_own_arenas(qwen3):
    _, d, tokens, want = qwen3
    with strata.load(d) as model:
        least = arena_plan_for(model, SMALL.replace(arena="1000000slots")).min_slots
        with open_engine(model, SMALL) as full, open_engine(model, SMALL.replace(arena=f"{least}slots")) as small:
            rows = {id(full): [full.prefill(PROMPT)], id(small): [small.prefill(PROMPT)]}
            for t in tokens[:-1]:  # interleaved: each forward runs on its own engine's arena
                for e in (full, small):
                    rows[id(e)].append(e.decode(t))
    for r in rows.values():
        assert np.array_equal(np.stack(r), want)


NATIVE = ("qwen3_moe_a4g32", "qwen3_moe_mxfp4", "mixtral_a8g32", "qwen2_moe_a4g32", "olmoe_a8g32")


@pytest.fixture(scope="module", params=NATIVE)
def native_family(request, tmp_path_factory):
    return _made(request.param, tmp_path_factory)


def test_native_path_and_tier_2_agree(native_family, tmp_path):
    """The same checkpoint through `strata convert` (the native path, float32 activations) and as
    tier 2: with mlx-lm's dense parameters widened to float32 (exact) the two agree within
    MLX_LM_LOGIT_BUDGET with every argmax equal; as shipped (bfloat16 activations) within
    TIER2_BF16_LOGPROB_BUDGET."""
    import mlx.core as mx
    from mlx.utils import tree_map

    from strata.convert import convert
    from strata.reference.model import ModelState, forward
    from tests.budgets import MLX_LM_LOGIT_BUDGET, TIER2_BF16_LOGPROB_BUDGET

    recipe, d, tokens, _ = native_family
    seq = np.asarray(PROMPT + tokens + list(range(100, 140)))
    native = strata.load(convert(d, tmp_path / "native").model_path)
    logits, _ = forward(native.resident_params(), ModelState.empty(native.cfg), seq)
    native.close()
    z = logits - logits.max(-1, keepdims=True)
    ours = z - np.log(np.exp(z).sum(-1, keepdims=True))  # native log-probabilities [T, V]
    scale = float(np.abs(ours).max())
    for widened, budget in ((True, MLX_LM_LOGIT_BUDGET), (False, TIER2_BF16_LOGPROB_BUDGET)):
        with strata.load(d) as model:
            if widened:  # before the engine installs its arena (whose pieces keep their stored types)
                wide = lambda a: a.astype(mx.float32) if a.dtype in (mx.bfloat16, mx.float16) else a  # noqa: E731
                model.mlx_model.update(tree_map(wide, model.mlx_model.parameters()))
            with open_engine(model, Config()) as engine:
                theirs = engine.decode_window(seq)  # tier 2's scores: mlx-lm's log-probabilities [T, V]
        rel = float(np.abs(ours - theirs).max()) / scale
        print(f"\n{recipe}, {'float32' if widened else 'bfloat16'} activations: native vs tier 2, "
              f"max |Δ log-probability| / scale = {rel:.2e}")
        assert rel <= budget
        if widened:
            assert np.array_equal(ours.argmax(-1), theirs.argmax(-1))


def test_doctor_says_which_tier_runs_a_directory(qwen3, tmp_path):
    import json

    from doctor_profile import diagnose_on_profile as _diag

    _, d, _, _ = qwen3
    text = _diag(d).text()
    assert "tier: 2 as it is" in text and "mlx-lm's qwen3_moe model file" in text and "strata convert" in text
    (tmp_path / "config.json").write_text(json.dumps({**json.loads((d / "config.json").read_text()),
                                                      "model_type": "no_such_family"}))
    assert "tier: no tier 2 (mlx-lm has no no_such_family model file)" in _diag(tmp_path).text()
