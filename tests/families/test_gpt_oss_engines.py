"""Engines on a gpt-oss model (the made shape `gpt-oss`: sliding / full attention alternating with
a window of 8, sinks, router and expert biases, the clamped SwiGLU, YaRN), with Q2_0 and MXFP4
experts: every engine agrees with the reference over a prompt longer than the window (the numpy
streaming engine exactly, at the smallest legal arena too; the MLX engines, whose gpt-oss layers
run on the ops path, within FORWARD); a sliding layer keeps every position, so trim restores any
n and decode_window equals single decodes.
"""

from __future__ import annotations

import numpy as np
import pytest

import strata
from engine_kinds import ENGINES, agree, open_kind
from strata.formats.quant_types import QuantType
from strata.testing.models import make_model

PROMPT = list(b"def fibonacci(n): return n if n < 2 else fibonacci(n - 1)")
CUT = 20


@pytest.fixture(scope="module", params=[QuantType.Q2_0, QuantType.MXFP4], ids=lambda q: q.name)
def model(request, tmp_path_factory):
    made = make_model(tmp_path_factory.mktemp("gptoss") / "m", "gpt-oss", seed=5, expert_type=request.param,
                      dense_type=QuantType.F16)
    m = strata.load(made.model_path)
    yield m
    m.close()


@pytest.mark.parametrize("kind", ENGINES)
def test_every_engine_agrees_with_the_reference_past_the_window(model, kind):
    assert len(PROMPT) > 4 * model.cfg.gpt_oss.sliding_window
    with open_kind(model, "reference") as ref:
        want = [ref.prefill(PROMPT)] + [ref.decode(t) for t in PROMPT[:10]]
    with open_kind(model, kind) as eng:
        got = [eng.prefill(PROMPT)] + [eng.decode(t) for t in PROMPT[:10]]
    agree(kind, np.stack(want), np.stack(got), f"gpt-oss {model.experts_file.header.qtype.name}, {kind}")


@pytest.mark.parametrize("kind", ENGINES)
def test_trim_anywhere_then_decode_equals_a_fresh_engine(model, kind):
    """A sliding layer's cache keeps every position: trim restores any n, even one whose window
    reaches back before positions the last window no longer needed."""
    with open_kind(model, kind) as eng:
        eng.prefill(PROMPT)
        assert [eng.kept_position(n) for n in range(len(PROMPT) + 1)] == list(range(len(PROMPT) + 1))
        for keep in (len(PROMPT) - 1, CUT, 3):
            eng.trim(keep)
            assert eng.length == keep and eng.tokens == tuple(PROMPT[:keep])
            with open_kind(model, kind) as fresh:
                fresh.prefill(PROMPT[:keep])
                want = fresh.decode(PROMPT[keep])
            agree(kind, want, eng.decode(PROMPT[keep]), f"{kind}: trim({keep})", regrouped=True)


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
