"""Config.kv_cache: f32 by default; f16 gives the MLX engines float16 caches (the resident
engine's and the streaming compute's) and is refused by the numpy engines in one line."""

from __future__ import annotations

import mlx.core as mx
import numpy as np
import pytest

from strata.config import Config
from strata.engines import open_engine
from strata.errors import ConfigError
from strata.mlx_backend.engine import MlxEngine
from strata.reference.attention import KVPrecision
from strata.testing.mlx_params import random_params
from test_mlx_compiled import SMALL


def test_kv_cache_defaults_to_f32_and_reads_f16():
    assert Config().kv_cache is KVPrecision.F32
    assert Config(kv_cache="f16").kv_cache is KVPrecision.F16
    with pytest.raises(ConfigError, match="kv_cache"):
        Config(kv_cache="f8")


def test_mlx_engine_keeps_f16_caches_through_decode_and_reset():
    eng = MlxEngine(random_params(SMALL, seed=2, pred_q8=False), compiled=False, config=Config(kv_cache="f16"))
    assert all(kv.keys.dtype == mx.float16 for kv in eng.state.layers)
    eng.prefill([3, 4, 5])
    logits = eng.decode(6)
    assert np.isfinite(logits).all()
    eng.reset()
    assert all(kv.keys.dtype == mx.float16 for kv in eng.state.layers)


def test_numpy_engines_refuse_f16(tmp_path):
    from strata.testing.models import make_model  # a made model on disk

    made = make_model(tmp_path / "m", "tiny")
    with pytest.raises(ConfigError, match="kv_cache f16"):
        open_engine(made.model_path, Config(backend="numpy", kv_cache="f16"))
