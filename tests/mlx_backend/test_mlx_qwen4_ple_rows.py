"""PLE rows from the row store on the MLX engines (the ops twin resident, and streaming): the same
logits as the same model with its tables among the dense weights, bit for bit, on MLX's default
device (the CPU build here; marked `gpu` where a GPU must run it)."""

from __future__ import annotations

import numpy as np
import pytest

mx = pytest.importorskip("mlx.core")

import strata  # noqa: E402
from strata.config import Backend, Config  # noqa: E402
from strata.engines import open_engine  # noqa: E402
from strata.formats.quant_types import QuantType  # noqa: E402
from strata.mlx_backend.kernels.launch import gpu_dialect  # noqa: E402
from strata.runtime import ngram_source  # noqa: E402
from strata.testing.models import SHAPES, make_model  # noqa: E402

EOS = SHAPES["qwen4"].qwen4.ngram_eos_token
PROMPT = [5, 6, 7, EOS, 8, 9, 10, 11, EOS, 12]


@pytest.fixture(scope="module")
def pair(tmp_path_factory):
    d = tmp_path_factory.mktemp("mlx_ple")
    a = make_model(d / "dense", "qwen4", seed=2, ngram_vocab_base=5003)
    b = make_model(d / "stored", "qwen4", seed=2, ple_rows=QuantType.F32, ngram_vocab_base=5003)
    with strata.load(a.model_path) as ma, strata.load(b.model_path) as mb:
        yield ma, mb


def _run(model, stream: bool) -> np.ndarray:
    config = Config(moce_lambda=0.0, backend=Backend.MLX, arena="40slots" if stream else "", ple_reserve="40KiB")
    with open_engine(model, config, stream=stream) as e:
        return np.stack([e.prefill(PROMPT)] + [e.decode(t) for t in (3, EOS, 4)])


def _check(pair, stream: bool, monkeypatch) -> None:
    dense, stored = pair
    want = _run(dense, stream)
    if not stream:  # the resident twin with rows from the row cache, not the tables read whole
        monkeypatch.setattr(ngram_source, "resident_room", lambda model, config: 0)
    np.testing.assert_array_equal(_run(stored, stream), want)


@pytest.mark.parametrize("stream", [False, True])
def test_streamed_rows_give_the_mlx_engines_identical_logits(pair, stream, monkeypatch):
    _check(pair, stream, monkeypatch)


@pytest.mark.gpu
@pytest.mark.skipif(gpu_dialect() is None, reason="no MLX GPU here")
@pytest.mark.parametrize("stream", [False, True])
def test_streamed_rows_give_identical_logits_on_the_gpu(pair, stream, monkeypatch):
    assert mx.default_device() == mx.gpu
    _check(pair, stream, monkeypatch)
