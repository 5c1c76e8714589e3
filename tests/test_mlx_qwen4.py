"""The MLX twin of Qwen4-Exp (mlx_backend/hyper_model.py through MlxHyperEngine) against the
reference forward on the made shape `qwen4`, within FORWARD: a prompt holding the PLE's EOS
token, decoded positions past the QSA budget, a decode window and a trim at a kept position;
all-resident (MlxHyperEngine) and streaming at the smallest legal arena (HyperMlxCompute). Runs
on MLX's default device (the CPU build here; marked `gpu` where a GPU must run it)."""

from __future__ import annotations

import numpy as np
import pytest

mx = pytest.importorskip("mlx.core")

import strata  # noqa: E402
from mlx_agree import assert_backends_agree  # noqa: E402
from strata.config import Backend, Config  # noqa: E402
from strata.formats.quant_types import QuantType  # noqa: E402
from strata.mlx_backend.hyper_engine import MlxHyperEngine  # noqa: E402
from strata.mlx_backend.kernels.launch import gpu_dialect  # noqa: E402
from strata.reference.model import ModelState, forward  # noqa: E402
from strata.testing.models import make_model  # noqa: E402
from engine_kinds import min_slots  # noqa: E402

MLX = Config(backend=Backend.MLX, moce_lambda=0.0)


@pytest.fixture(scope="module")
def model(tmp_path_factory):
    # Q2_0 experts: a type MLX's expert kernels read (on the GPU they compute them)
    made = make_model(tmp_path_factory.mktemp("q4m") / "qwen4", "qwen4", seed=7, expert_type=QuantType.Q2_0)
    m = strata.load(made.model_path)
    yield m
    m.close()


def _tokens(model) -> np.ndarray:
    eos = model.cfg.ngram_eos_token
    return np.asarray(list(b"def fib(n):") + [eos] + list(b" return fib(n - 1) + fib(n - 2)"))


def _agrees(model, stream: bool = False):
    tokens = _tokens(model)
    whole, _ = forward(model.resident_params(), ModelState.empty(model.cfg), tokens)
    config = MLX.replace(arena=f"{min_slots(model, MLX)}slots") if stream else MLX
    with strata.open_engine(model, config, stream=stream) as engine:
        assert isinstance(engine, MlxHyperEngine) != stream
        got = [engine.prefill(tokens[:10])] + [engine.decode(int(t)) for t in tokens[10:30]]
        window = engine.decode_window(tokens[30:])
        assert_backends_agree(whole[9:30], np.stack(got), "FORWARD", what="prefill + decode")
        assert_backends_agree(whole[30:], window, "FORWARD", what="window")
        keep = 33
        assert engine.kept_position(keep) == keep
        engine.trim(keep)
        assert_backends_agree(whole[keep], engine.decode(int(tokens[keep])), "FORWARD", what="after trim")


def test_mlx_twin_agrees_with_the_reference(model):
    _agrees(model)


def test_mlx_streaming_at_the_smallest_arena_agrees_with_the_reference(model):
    _agrees(model, stream=True)


@pytest.mark.gpu
@pytest.mark.skipif(gpu_dialect() is None, reason="no MLX GPU here")
@pytest.mark.parametrize("stream", [False, True], ids=["resident", "streaming"])
def test_mlx_twin_agrees_on_the_gpu(model, stream):
    assert mx.default_device() == mx.gpu
    _agrees(model, stream)
