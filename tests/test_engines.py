"""Engines that live (strata.engines, strata.session): trim, reset, decode_window, prefix reuse,
experts read once per process, and a model whose first layer is dense, through every engine.

Every engine is held to a fresh engine of its own kind (trim, reset, windows) and to the
reference (dense-first layer): bit for bit where the arithmetic is the same (numpy engines, the
same chunks), within the named budgets where positions are computed in other groupings (a
window of T vs T single decodes: FLOAT32_REORDER) or on MLX (mlx_agree's FORWARD).
"""

from __future__ import annotations

import numpy as np
import pytest

import strata
from strata.cache.types import AtLayer
from strata.config import Backend
from strata.engines import close_session
from strata.formats.experts_file import ExpertsFile
from strata.formats.quant_types import QuantType
from strata.testing.engines import open_numpy_streaming
from strata.testing.models import make_model
from tests.budgets import FLOAT32_REORDER
from engine_kinds import ENGINES, EXACT0, agree, all_slots, min_slots, open_kind  # noqa: E402

PROMPT = list(b"def fibonacci(n): return n")  # 26 positions: one prompt chunk (64)
CUT = 14  # trim / window point


@pytest.fixture(scope="module", params=["tiny", "dense-first"])
def model(request, tmp_path_factory):
    made = make_model(tmp_path_factory.mktemp("eng") / request.param, request.param, seed=3,
                      dense_type=QuantType.F16)  # float16-exact dense weights: MLX computes on the same numbers
    m = strata.load(made.model_path)
    yield m
    m.close()












@pytest.mark.parametrize("kind", ENGINES)
def test_trim_then_decode_equals_a_fresh_engine_of_the_first_n(model, kind):
    nxt = PROMPT[CUT]
    with open_kind(model, kind) as fresh:
        fresh.prefill(PROMPT[:CUT])
        want = fresh.decode(nxt)
    with open_kind(model, kind) as eng:
        eng.prefill(PROMPT[:CUT])
        for t in PROMPT[CUT:CUT + 6]:  # positions that trim must take back
            eng.decode(t)
        eng.trim(CUT)
        assert eng.length == CUT and eng.tokens == tuple(PROMPT[:CUT])
        agree(kind, want, eng.decode(nxt), f"{kind}: trim({CUT}) then decode")
        eng.trim(0)
        assert eng.length == 0
        agree(kind, fresh_prefill(model, kind, PROMPT), eng.prefill(PROMPT), f"{kind}: trim(0) then prefill")


def fresh_prefill(model, kind, tokens):
    with open_kind(model, kind) as e:
        return e.prefill(tokens)


@pytest.mark.parametrize("kind", ENGINES)
def test_reset_then_prefill_equals_the_first_prefill(model, kind):
    with open_kind(model, kind) as eng:
        first = eng.prefill(PROMPT)
        eng.decode(7)
        eng.reset()
        assert eng.length == 0 and eng.tokens == ()
        agree(kind, first, eng.prefill(PROMPT), f"{kind}: reset")
        assert eng.stats().prompt_tokens == 2 * len(PROMPT)


@pytest.mark.parametrize("kind", ENGINES)
def test_decode_window_equals_single_decodes(model, kind):
    window = PROMPT[CUT:CUT + 4]
    with open_kind(model, kind) as one:
        one.prefill(PROMPT[:CUT])
        want = np.stack([one.decode(t) for t in window])  # [T, V]
    with open_kind(model, kind) as eng:
        eng.prefill(PROMPT[:CUT])
        got = eng.decode_window(window)
        assert got.shape == want.shape and eng.length == CUT + len(window)
        agree(kind, want, got, f"{kind}: decode_window({len(window)})", regrouped=True)


def test_a_window_the_cache_holds_is_one_cache_window(model):
    """Config.window = 4: a 4-position window is one decode window of the cache machine (its
    smallest arena grows by the window's selections), with the same logits as 4 decodes."""
    config = EXACT0.replace(window=4)
    assert min_slots(model, config) > min_slots(model, EXACT0)
    window = PROMPT[CUT:CUT + 4]
    with open_kind(model, "numpy-min") as one:
        one.prefill(PROMPT[:CUT])
        want = np.stack([one.decode(t) for t in window])
    with open_numpy_streaming(model, config.replace(arena=f"{min_slots(model, config)}slots"), keep_trace=True) as eng:
        eng.prefill(PROMPT[:CUT])
        turns = len(eng.streamer.trace)
        got = eng.decode_window(window)
        new = eng.streamer.trace[turns:]
        assert sum(isinstance(e, AtLayer) for e in new) == model.cfg.n_moe_layers  # one turn per MoE layer
        assert max(len(e.selected) for e in new if isinstance(e, AtLayer)) > model.cfg.n_experts_per_token
    np.testing.assert_allclose(got, want, **FLOAT32_REORDER)


@pytest.mark.parametrize("kind", ["reference", "numpy-min", "mlx-resident"])
def test_prefix_reuse_gives_a_fresh_prefills_output(model, kind, tmp_path):
    """A Model keeps its engine: a prompt extending what the session holds prefills only the new
    suffix, and generates what a fresh model generates."""
    config = {"reference": EXACT0.replace(backend=Backend.NUMPY),
              "numpy-min": EXACT0.replace(backend=Backend.NUMPY, arena=f"{min_slots(model, EXACT0)}slots"),
              "mlx-resident": EXACT0.replace(backend=Backend.MLX)}[kind]
    close_session(model)  # whatever an earlier test left
    first = strata.generate(model, PROMPT[:CUT], max_tokens=3, config=config)
    assert first.prompt_reused == 0
    second = strata.generate(model, PROMPT, max_tokens=6, config=config)
    assert second.prompt_reused == CUT  # the first prompt; its generated tokens differ from PROMPT's
    fresh_model = strata.load(model.model_path)
    try:
        fresh = strata.generate(fresh_model, PROMPT, max_tokens=6, config=config)
    finally:
        fresh_model.close()
    assert second.tokens == fresh.tokens and second.prompt_tokens == fresh.prompt_tokens
    again = strata.generate(model, PROMPT, max_tokens=6, config=config)  # the same prompt: all but one reused
    assert again.prompt_reused == len(PROMPT) - 1 and again.tokens == fresh.tokens


@pytest.mark.parametrize("backend", [Backend.NUMPY, Backend.MLX])
def test_two_generates_on_one_model_read_each_expert_once(model, backend, monkeypatch):
    reads = []
    original = ExpertsFile.read_record

    def counting(self, layer, expert, **kw):
        reads.append((layer, expert))
        return original(self, layer, expert, **kw)

    monkeypatch.setattr(ExpertsFile, "read_record", counting)
    m = strata.load(model.model_path)
    try:
        config = EXACT0.replace(backend=backend)
        strata.generate(m, PROMPT, max_tokens=4, config=config)
        strata.generate(m, PROMPT[:CUT], max_tokens=4, config=config)
        assert len(reads) == len(set(reads)) == all_slots(m)
        assert m.session.stats().expert_reads == all_slots(m)
    finally:
        m.close()


def test_streaming_at_full_residency_reads_no_expert_twice_across_calls(model):
    m = strata.load(model.model_path)
    try:
        config = EXACT0.replace(backend=Backend.NUMPY, arena=f"{all_slots(m)}slots")
        strata.generate(m, PROMPT, max_tokens=4, config=config)
        after_one = m.session.stats().cache
        second = strata.generate(m, PROMPT, max_tokens=4, config=config)
        assert second.prompt_reused == len(PROMPT) - 1
        total = m.session.stats().cache
        # nothing is evicted from an arena that holds every expert: each read that was not
        # dropped while queued brought in an expert for good
        assert 0 < after_one.reads_issued and total.reads_issued - total.reads_cancelled <= all_slots(m)
        assert second.report.urgent_misses_per_token == 0
    finally:
        m.close()


@pytest.mark.parametrize("kind", ENGINES)
def test_a_dense_first_layer_model_agrees_with_the_reference(tmp_path_factory, kind):
    """DeepSeek-style: layer 0 dense, MoE after it. The cache and the .experts file see the MoE
    layers only (no cache turn for the dense layer); every engine gives the reference's logits."""
    made = make_model(tmp_path_factory.mktemp("df") / "df", "dense-first", seed=5, dense_type=QuantType.F16)
    m = strata.load(made.model_path)
    try:
        assert m.cfg.moe_layers == (1, 2) and m.experts_file.header.n_layers == 2
        with open_kind(m, "reference") as ref:
            want = [ref.prefill(PROMPT)] + [ref.decode(t) for t in PROMPT[:5]]
        with open_kind(m, kind) as eng:
            got = [eng.prefill(PROMPT)] + [eng.decode(t) for t in PROMPT[:5]]
            if kind.startswith("numpy") or kind == "mlx-min":
                assert eng.cache_config.n_layers == 2
                assert eng.report().reads_per_token > 0 or kind == "numpy-full"
        agree(kind, np.stack(want), np.stack(got), f"dense-first, {kind}")
    finally:
        m.close()


def test_engine_input_errors_are_one_line():
    from strata.errors import StrataError
    from strata.session import SessionEngine

    eng = SessionEngine()
    for bad in ([], [1.5], [True], "ab"):
        with pytest.raises(StrataError, match="token ids"):
            eng.prefill(bad)
    with pytest.raises(StrataError, match=r"trim: n must be an int in \[0, 0\]"):
        eng.trim(3)


def test_non_finite_router_logits_name_the_model_layer(tmp_path):
    """A forward that produces non-finite values says so in one line, naming the (model) layer:
    the reference and the streaming selector alike, on a model whose layer 0 is dense."""
    from strata.errors import NonFiniteError
    from strata.model_config import TensorNames
    from strata.numpy_backend.engine import ReferenceEngine
    from strata.reference.model import ModelParams

    made = make_model(tmp_path / "df", "dense-first", seed=1)
    m = strata.load(made.model_path)
    try:
        dense = dict(m.dense)
        name = TensorNames.block(2, TensorNames.router)
        dense[name] = np.full_like(dense[name], np.nan)
        eng = ReferenceEngine(ModelParams(m.cfg, dense, m.resident_params().experts))
        with pytest.raises(NonFiniteError, match=r"^layer 2: router logits are not finite"):
            eng.prefill(PROMPT[:4])
        m.dense.update(dense)  # the streaming engine reads the same dict
        with open_numpy_streaming(m, EXACT0.replace(arena=f"{min_slots(m, EXACT0)}slots")) as s:
            with pytest.raises(NonFiniteError, match=r"^layer 2: router logits are not finite"):
                s.prefill(PROMPT[:4])
    finally:
        m.close()
