"""The MLX engines end to end (ops path on CPU; the GPU path where MLX has one): streaming through
an MlxArena + MlxCompute in the runtime's StreamingEngine, and the all-resident MlxEngine, both
against the reference engine on a made model (`strata.testing`)."""

from __future__ import annotations

import numpy as np
import pytest

from mlx_agree import assert_backends_agree
from strata.config import Backend, Config
from strata.engine import ReferenceEngine
from strata.generate import _engine_for, generate
from strata.loader import load
from strata.mlx_backend.compute import MlxCompute
from strata.mlx_backend.engine import MlxEngine
from strata.testing import make_model

pytest.importorskip("gguf")  # the made model is written as GGUF (not installed on the GPU machine)

PROMPT = list(b"def fibonacci(n):")


@pytest.fixture(scope="module")
def tiny(tmp_path_factory):
    made = make_model(tmp_path_factory.mktemp("mlx") / "tiny", "tiny", seed=0)
    return load(made.model_path)


def _run(engine, tokens, steps=4):
    out = [engine.prefill(tokens)]
    for t in range(steps):
        out.append(engine.decode(int(np.argmax(out[-1]))))
    return np.stack(out)


@pytest.mark.parametrize("arena,chunk", [("28slots", 64), ("28slots", 5), ("40slots", 3)])
def test_streaming_mlx_matches_reference_at_lambda_zero(tiny, arena, chunk):
    """λ = 0: the model's own routing; a small arena and short prompt chunks force several passes
    per prompt layer (the pass must read its slots before the next pass reuses them)."""
    ref = _run(ReferenceEngine(tiny.resident_params()), PROMPT)
    eng = _engine_for(tiny, Config(backend=Backend.MLX, arena=arena, moce_lambda=0.0, prefill_chunk=chunk))
    try:
        assert isinstance(eng.compute, MlxCompute)
        assert_backends_agree(ref, _run(eng, PROMPT), "FORWARD", what=f"streaming mlx, arena {arena}")
        assert eng.report().reads_per_token > 0
    finally:
        eng.close()


def test_streaming_mlx_and_numpy_make_the_same_cache_decisions(tiny):
    """With MoCE on (λ = 0.85) routing depends on residency; both backends see the same routing
    (up to float noise), so the same reads, hits and misses."""
    reports = []
    for backend in (Backend.NUMPY, Backend.MLX):
        eng = _engine_for(tiny, Config(backend=backend, arena="30slots"))
        try:
            _run(eng, PROMPT, steps=6)
            reports.append(eng.report())
        finally:
            eng.close()
    a, b = reports
    assert (a.urgent_misses_per_token, a.readahead_hits_per_token, a.reads_per_token) == \
           (b.urgent_misses_per_token, b.readahead_hits_per_token, b.reads_per_token)


def test_all_resident_mlx_engine_matches_reference(tiny):
    eng = _engine_for(tiny, Config(backend=Backend.MLX))
    assert isinstance(eng, MlxEngine)
    ref = _run(ReferenceEngine(tiny.resident_params()), PROMPT)
    assert_backends_agree(ref, _run(eng, PROMPT), "FORWARD", what="all-resident mlx")


def test_generate_with_backend_mlx(tiny):
    want = generate(tiny, "hello", max_tokens=8)
    got = generate(tiny, "hello", max_tokens=8, config=Config(backend=Backend.MLX))
    assert got.tokens == want.tokens
