"""Engines on a hybrid model (the made shape `hybrid`: three gated DeltaNet layers, then gated
attention with partial rotary; every layer MoE): trim and decode_window on recurrent layers,
prefix reuse, streaming at the smallest legal arena, the read-ahead across DeltaNet layers, and
decisions independent of I/O timing.

A DeltaNet layer restores only the positions it kept a snapshot of (the end of every call, every
position of a decode window): `kept_position(n)` names them, and `trim` elsewhere is refused.
"""

from __future__ import annotations

import numpy as np
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

import strata
from strata.cache.types import AfterLayer
from strata.config import Backend, Config
from strata.engines import close_session
from strata.errors import StrataError
from strata.formats.quant_types import QuantType
from strata.model_config import Mixer
from strata.testing.faults import RandomDelays
from strata.testing.engines import open_numpy_streaming
from strata.testing.models import make_model
from engine_kinds import ENGINES, EXACT0, agree, min_slots, open_kind  # noqa: E402

PROMPT = list(b"def fibonacci(n): return n")
CUT = 14


@pytest.fixture(scope="module")
def model(tmp_path_factory):
    made = make_model(tmp_path_factory.mktemp("hyb") / "hybrid", "hybrid", seed=3, dense_type=QuantType.F16)
    m = strata.load(made.model_path)
    yield m
    m.close()










def test_the_made_hybrid_has_both_mixers_and_every_layer_moe(model):
    assert [k.mixer for k in model.cfg.kinds] == [Mixer.DELTANET] * 3 + [Mixer.ATTENTION]
    assert model.cfg.moe_layers == (0, 1, 2, 3) and model.cfg.rope_dim < model.cfg.head_dim


@pytest.mark.parametrize("kind", ENGINES)
def test_every_engine_agrees_with_the_reference(model, kind):
    with open_kind(model, "reference") as ref:
        want = [ref.prefill(PROMPT)] + [ref.decode(t) for t in PROMPT[:5]]
    with open_kind(model, kind) as eng:
        got = [eng.prefill(PROMPT)] + [eng.decode(t) for t in PROMPT[:5]]
    agree(kind, np.stack(want), np.stack(got), f"hybrid, {kind}")


@pytest.mark.parametrize("kind", ENGINES)
def test_kept_positions_are_call_ends_and_window_positions(model, kind):
    with open_kind(model, kind) as eng:
        eng.prefill(PROMPT[:CUT])  # kept: 0, CUT
        eng.decode_window(PROMPT[CUT:CUT + 3])  # kept: CUT+1, CUT+2, CUT+3
        eng.decode(PROMPT[CUT + 3])  # kept: CUT+4
        assert [eng.kept_position(n) for n in range(CUT + 6)] == [0] * CUT + list(range(CUT, CUT + 5)) + [CUT + 4]
        with pytest.raises((StrataError, ValueError), match="snapshot"):
            eng.trim(CUT - 1)


@pytest.mark.parametrize("kind", ENGINES)
def test_trim_into_a_window_then_decode_equals_a_fresh_engine(model, kind):
    """A rejected draft rolled back: trim to a position inside the last decode window."""
    keep = CUT + 2
    with open_kind(model, kind) as fresh:
        fresh.prefill(PROMPT[:CUT])
        fresh.decode_window(PROMPT[CUT:keep])
        want = fresh.decode(PROMPT[keep])
    with open_kind(model, kind) as eng:
        eng.prefill(PROMPT[:CUT])
        eng.decode_window(PROMPT[CUT:CUT + 5])
        eng.trim(keep)
        assert eng.length == keep and eng.tokens == tuple(PROMPT[:keep])
        agree(kind, want, eng.decode(PROMPT[keep]), f"{kind}: trim({keep}) inside a window",
              regrouped=True)  # the attention layer's window of 5 is a matmul of 5 rows, not 2
        eng.trim(CUT)  # the prompt's end
        agree(kind, fresh_prefill_decode(model, kind), eng.decode(PROMPT[CUT]), f"{kind}: trim({CUT})")
        eng.trim(0)
        with open_kind(model, kind) as other:
            agree(kind, other.prefill(PROMPT), eng.prefill(PROMPT), f"{kind}: trim(0) then prefill")


def fresh_prefill_decode(model, kind):
    with open_kind(model, kind) as e:
        e.prefill(PROMPT[:CUT])
        return e.decode(PROMPT[CUT])


@pytest.mark.parametrize("kind", ENGINES)
def test_decode_window_equals_single_decodes(model, kind):
    window = PROMPT[CUT:CUT + 4]
    with open_kind(model, kind) as one:
        one.prefill(PROMPT[:CUT])
        want = np.stack([one.decode(t) for t in window])
    with open_kind(model, kind) as eng:
        eng.prefill(PROMPT[:CUT])
        got = eng.decode_window(window)
    agree(kind, want, got, f"{kind}: decode_window({len(window)})", regrouped=True)


@pytest.mark.parametrize("kind", ["reference", "numpy-min"])
def test_prefix_reuse_trims_to_a_kept_position(model, kind):
    config = {"reference": EXACT0.replace(backend=Backend.NUMPY),
              "numpy-min": EXACT0.replace(backend=Backend.NUMPY, arena=f"{min_slots(model)}slots")}[kind]
    close_session(model)
    strata.generate(model, PROMPT[:CUT], max_tokens=3, config=config)
    second = strata.generate(model, PROMPT, max_tokens=6, config=config)
    assert second.prompt_reused == CUT  # the first prompt's end: a kept position
    fresh_model = strata.load(model.model_path)
    try:
        fresh = strata.generate(fresh_model, PROMPT, max_tokens=6, config=config)
    finally:
        fresh_model.close()
    assert second.tokens == fresh.tokens
    close_session(model)


def test_read_ahead_guesses_reach_across_deltanet_layers(model):
    """AfterLayer(m) carries guesses for MoE layer m+1, whatever mixer lies between."""
    with open_numpy_streaming(model, EXACT0.replace(arena=f"{min_slots(model)}slots", prefetch=4),
                              keep_trace=True) as eng:
        eng.prefill(PROMPT[:CUT])
        start = len(eng.streamer.trace)
        eng.decode(PROMPT[CUT])
        after = [e for e in eng.streamer.trace[start:] if isinstance(e, AfterLayer)]
    assert len(after) == model.cfg.n_moe_layers
    assert all(len(e.guesses) == 4 for e in after[:-1]) and not after[-1].guesses


@settings(max_examples=4, deadline=None)
@given(seed=st.integers(0, 2**16))
def test_random_io_timing_changes_no_decision_and_no_token(model, seed):
    config = Config(moce_j=1, moce_lambda=2.0, prefetch=4, prefill_chunk=6, io_threads=3)
    config = config.replace(arena=f"{min_slots(model, config) + 2}slots")

    def run(hook):
        with open_numpy_streaming(model, config, hook=hook, keep_trace=True) as engine:
            logits = engine.prefill(PROMPT[:CUT])
            tokens = []
            for _ in range(6):
                tokens.append(int(np.argmax(logits)))
                logits = engine.decode(tokens[-1])
            return tokens, engine.streamer.decisions

    assert run(RandomDelays(seed, max_ms=2.0)) == run(None)
