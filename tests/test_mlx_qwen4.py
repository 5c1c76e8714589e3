"""The MLX twin of Qwen4-Exp (mlx_backend/hyper_model.py through MlxHyperEngine) against the
reference forward on the made shape `qwen4`, within FORWARD: a prompt holding the PLE's EOS
token, decoded positions past the QSA budget, a decode window and a trim at a kept position.
Runs on MLX's default device (the CPU build here; marked `gpu` where a GPU must run it)."""

from __future__ import annotations

import numpy as np
import pytest

mx = pytest.importorskip("mlx.core")

import strata  # noqa: E402
from mlx_agree import assert_backends_agree  # noqa: E402
from strata.config import Backend, Config  # noqa: E402
from strata.errors import ConfigError  # noqa: E402
from strata.formats.quant_types import QuantType  # noqa: E402
from strata.mlx_backend.hyper_engine import MlxHyperEngine  # noqa: E402
from strata.mlx_backend.kernels.launch import gpu_dialect  # noqa: E402
from strata.reference.model import ModelState, forward  # noqa: E402
from strata.testing.models import make_model  # noqa: E402

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


def _agrees(model):
    tokens = _tokens(model)
    whole, _ = forward(model.resident_params(), ModelState.empty(model.cfg), tokens)
    with strata.open_engine(model, MLX, stream=False) as engine:
        assert isinstance(engine, MlxHyperEngine)
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


@pytest.mark.gpu
@pytest.mark.skipif(gpu_dialect() is None, reason="no MLX GPU here")
def test_mlx_twin_agrees_on_the_gpu(model):
    assert mx.default_device() == mx.gpu
    _agrees(model)


def test_mlx_streaming_is_refused_naming_the_field(model):
    with pytest.raises(ConfigError, match="hc_count"):
        strata.open_engine(model, MLX, stream=True)
