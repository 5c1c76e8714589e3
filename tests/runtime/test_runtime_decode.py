"""The streaming engine computes what the all-resident reference computes (λ = 0), at every
arena size down to the smallest legal one and under every design §6 switch; its decisions are
the reference cache machine's; every expert used is the one requested; faults are clear errors."""

import numpy as np
import pytest

import strata
from strata.config import Config
from strata.errors import ArenaTooSmallError, ConfigError, ExpertReadError
from strata.formats.experts_file import checksum
from strata.cache.machine import decision_view, initial_state, step
from strata.cache.types import WaitFor
from strata.numpy_backend.compute import NumpyCompute
from strata.numpy_backend.engine import _NoResidentExperts
from strata.runtime.decode import StreamingEngine, arena_plan_for
from strata.testing.engines import open_numpy_reference, open_numpy_streaming
from strata.runtime.io import ReaderPool
from strata.testing.faults import Faults, RandomDelays
from strata.numpy_backend.arena import NumpyArena
from strata.reference.model import ModelParams
from strata.testing.models import make_model
from tests.budgets import FLOAT32_REORDER

PROMPT = "def fib(n): return n"
N_DECODE = 10


@pytest.fixture(scope="module")
def model(tmp_path_factory):
    """2 layers x 64 experts, top-4: 128 records, so small arenas evict all the time."""
    made = make_model(tmp_path_factory.mktemp("rt") / "tiny64", "tiny", seed=7, n_experts=64)
    return strata.load(made.model_path)


@pytest.fixture(scope="module")
def reference(model):
    """The all-resident engine on the streaming engine's products (STOCK0: the compiled CPU kernels)."""
    return greedy(open_numpy_reference(model, STOCK0), model, N_DECODE)


def greedy(engine, model, n, prompt=PROMPT):
    """Greedy tokens and every logits vector (prefill's last, then each decode)."""
    logits = [engine.prefill(model.tokenizer.encode(prompt))]
    tokens = []
    for _ in range(n):
        tokens.append(int(np.argmax(logits[-1])))
        logits.append(engine.decode(tokens[-1]))
    return tokens, logits


def min_slots(model, config):
    return arena_plan_for(model, config.replace(arena="100000slots")).min_slots


def stream(model, config, n=N_DECODE, **kw):
    with open_numpy_streaming(model, config, **kw) as engine:
        return greedy(engine, model, n), engine


STOCK0 = Config(moce_lambda=0.0, arena="")


@pytest.mark.parametrize("extra", [0, 1, 7, 40])
def test_lambda_zero_logits_are_the_references_at_every_arena_size(model, reference, extra):
    config = STOCK0.replace(arena=f"{min_slots(model, STOCK0) + extra}slots")
    (tokens, logits), engine = stream(model, config)
    assert tokens == reference[0]
    for got, want in zip(logits, reference[1]):
        np.testing.assert_array_equal(got, want)
    assert engine.report().urgent_misses_per_token > 0 or extra == 40


SWITCHES = [
    dict(prefetch=0), dict(prefetch=16), dict(prefetch_touch=True), dict(prefetch2=True),
    dict(split_turn=False), dict(shexp_overlap=False), dict(pred_q8=False), dict(io_threads=1),
    dict(direct_io=False), dict(verify_reads=True), dict(prefill_chunk=3), dict(moce_pre=True),
    dict(layer_pins=True), dict(layer_pins=True, prefetch=1), dict(layer_pins=True, split_turn=False),
]


@pytest.mark.parametrize("switch", SWITCHES, ids=lambda s: ",".join(f"{k}={v}" for k, v in s.items()))
def test_every_switch_keeps_lambda_zero_tokens(model, reference, switch):
    config = STOCK0.replace(**switch)
    config = config.replace(arena=f"{min_slots(model, config)}slots")
    (tokens, logits), _ = stream(model, config)
    assert tokens == reference[0]
    for got, want in zip(logits, reference[1]):
        if config.prefill_chunk >= len(PROMPT):
            np.testing.assert_array_equal(got, want)
        else:  # chunked attention sums in another order
            np.testing.assert_allclose(got, want, **FLOAT32_REORDER)


def replay_decisions(engine):
    """The reference machine fed the runtime's turns (no ReadDone): its decisions and view."""
    s, decisions = initial_state(engine.cache_config), []
    for event in engine.streamer.trace:
        s, actions = step(s, event)
        decisions.extend(a for a in actions if not isinstance(a, WaitFor))
    return decisions, s


@pytest.mark.parametrize("config", [
    Config(prefetch=16), Config(moce_j=1, moce_lambda=1.5, prefill_chunk=4), Config(split_turn=False),
    Config(prefetch2=True, moce_drop_tail=0.2, moce_drop_rank=2), Config(moce_scale="range", moce_lambda=0.3),
    Config(layer_pins=True),
], ids=["k16", "j1", "nosplit", "pf2-droptail", "range", "layer-pins"])
def test_runtime_decisions_are_the_reference_machines(model, config):
    config = config.replace(arena=f"{min_slots(model, config) + 3}slots")
    _, engine = stream(model, config, keep_trace=True, hook=RandomDelays(seed=3, max_ms=1))
    decisions, final = replay_decisions(engine)
    assert decisions == engine.streamer.decisions
    assert decision_view(final) == decision_view(engine.streamer.state)


class CheckingCompute(NumpyCompute):
    """Checks, at the moment of use and again when the compute returns (read-aheads for the next
    layer run meanwhile), that every slot holds the record the cache says it does."""

    engine = None
    checked = 0

    def routed(self, layer, h, slots, weights):
        xf, state = self.engine.model.experts_file, self.engine.streamer.state
        used = [(s, int(state.slot_key[s])) for s in np.unique(slots[slots >= 0]).tolist()]

        def check():
            for s, key in used:
                assert key // xf.header.n_experts == layer
                rec = self.arena.slot_buffer(s)[: xf.header.record_bytes]
                assert checksum(rec) == xf.checksum(layer, key % xf.header.n_experts)
                self.checked += 1

        check()
        out = super().routed(layer, h, slots, weights)
        check()
        return out


@pytest.mark.parametrize("seed, layer_pins", [(0, False), (1, False), (2, False), (0, True), (1, True)])
def test_every_expert_computed_with_is_the_expert_requested(model, reference, seed, layer_pins):
    config = Config(moce_lambda=0.0, prefetch=16, io_threads=3, prefill_chunk=5, layer_pins=layer_pins)
    capacity = min_slots(model, config)
    arena = NumpyArena(capacity, model.experts_file.header.padded_bytes)
    pool = ReaderPool(model.experts_file, arena, threads=3, hook=RandomDelays(seed, max_ms=1.5))
    compute = CheckingCompute(ModelParams(model.cfg, model.dense, _NoResidentExperts()), arena,
                              model.experts_file.layout)
    with StreamingEngine(model, config, arena, compute, pool) as engine:
        compute.engine = engine
        tokens, _ = greedy(engine, model, N_DECODE)
    assert tokens == reference[0]
    assert compute.checked > 50


def _an_urgent_miss(model, config):
    """(layer, expert) of a decode urgent read in a clean run of `config`."""
    _, engine = stream(model, config, n=3, keep_trace=True)
    from strata.cache.types import Read
    n_prompt_reads = engine.report().prompt_reads
    reads = [a for a in engine.streamer.decisions if isinstance(a, Read) and a.urgent]
    late = reads[-1]
    return late.layer, late.expert, n_prompt_reads


@pytest.mark.parametrize("fault, verify, message", [
    ("eio", False, "read error"), ("short", False, "short read"), ("corrupt", True, "checksum mismatch"),
])
def test_a_read_fault_in_generation_is_a_clear_error(model, fault, verify, message):
    config = STOCK0.replace(verify_reads=verify)
    config = config.replace(arena=f"{min_slots(model, config)}slots")
    layer, expert, _ = _an_urgent_miss(model, config)
    offset = model.experts_file.record_offset(layer, expert)
    hook = Faults(**{fault: {(layer, expert)}}, delays=RandomDelays(seed=1, max_ms=0.5))
    with pytest.raises(ExpertReadError, match=f"layer {layer} expert {expert} at offset {offset}: {message}"):
        stream(model, config, n=3, hook=hook)


def test_an_arena_below_the_minimum_is_refused(model):
    least = min_slots(model, STOCK0)
    with pytest.raises(ArenaTooSmallError, match=f"needs at least {least} slots"):
        open_numpy_streaming(model, STOCK0.replace(arena=f"{least - 1}slots"))


def test_generate_streams_when_asked_and_reports(model, reference, tmp_path):
    logpos = tmp_path / "logits.f32"
    config = STOCK0.replace(arena=f"{min_slots(model, STOCK0)}slots", logpos=str(logpos), profile=True)
    result = strata.generate(model, PROMPT, max_tokens=N_DECODE, config=config)
    assert result.tokens == reference[0]
    r = result.report
    assert r.tokens == N_DECODE - 1  # the last token is sampled, not decoded
    assert r.arena_slots == min_slots(model, STOCK0) and r.arena_bytes == r.arena_slots * model.experts_file.header.padded_bytes
    assert 0 < r.hit_rate < 1 and r.reads_per_token > 0 and len(r.misses_by_rank) == model.cfg.n_experts_per_token
    assert abs(sum(r.misses_by_rank) - r.urgent_misses_per_token) < 1e-9
    assert r.prompt_tokens == len(PROMPT) and set(r.profile) >= {"routed", "turn", "attention"}
    assert "ms/token" in r.text() and '"hit_rate"' in r.to_json()
    dumped = np.fromfile(logpos, np.float32).reshape(-1, model.cfg.vocab_size)
    assert dumped.shape[0] == len(PROMPT) + N_DECODE - 1
    np.testing.assert_array_equal(dumped[len(PROMPT) - 1], reference[1][0])
    responses = list(strata.stream_generate(model, PROMPT, max_tokens=3, config=config.replace(logpos="")))
    assert all(r.cache is not None for r in responses) and responses[-1].report is not None
    assert responses[0].report is None


def test_generate_stays_all_resident_when_the_experts_fit(model):
    result = strata.generate(model, PROMPT, max_tokens=3, config=Config())
    assert result.report is None


def test_moce_changes_routing_only_through_residency(model):
    """λ > 0 streams deterministically and reads less than λ = 0 on the same arena."""
    base = Config(prefetch=4)
    arena = f"{min_slots(model, base)}slots"
    (_, _), e0 = stream(model, base.replace(arena=arena, moce_lambda=0.0), n=16)
    (_, _), e1 = stream(model, base.replace(arena=arena, moce_lambda=2.0, moce_j=1), n=16)
    assert e1.report().urgent_misses_per_token < e0.report().urgent_misses_per_token


@pytest.mark.parametrize("split_turn", [True, False])
def test_waiting_is_part_of_the_host_turn(tmp_path, split_turn):
    """The report's 'host X ms per window, of it waiting Y': Y never exceeds X, also when the
    after-turn waits for limbo slots still reading (those waits belong to `after`). A 16-expert
    model at the smallest arena with K = 16 retires read-aheads that are still reading."""
    small = strata.load(make_model(tmp_path / "tiny16", "tiny", seed=0).model_path)
    config = Config(prefetch=16, split_turn=split_turn)
    config = config.replace(arena=f"{min_slots(small, config)}slots")
    _, engine = stream(small, config, hook=RandomDelays(seed=5, max_ms=3))
    times = engine.streamer.times
    assert times.waiting > 0
    assert times.waiting <= times.host


def test_layer_pins_are_refused_where_compute_runs_after_the_turns(model):
    """An asynchronous backend (MLX) computes a window's layers after their turns: a pin of one
    layer would let a read overwrite a slot still to be read, so such an engine refuses it."""

    class Deferred(NumpyCompute):
        synchronous = False

    config = Config(layer_pins=True)
    config = config.replace(arena=f"{min_slots(model, config)}slots")
    arena = NumpyArena(min_slots(model, config), model.experts_file.header.padded_bytes)
    pool = ReaderPool(model.experts_file, arena, threads=1)
    compute = Deferred(ModelParams(model.cfg, model.dense, _NoResidentExperts()), arena, model.experts_file.layout)
    try:
        with pytest.raises(ConfigError, match="layer_pins: this backend computes"):
            StreamingEngine(model, config, arena, compute, pool)
    finally:
        pool.close()
