"""The residual stream's strategies (strata/reference/residual.py): one per `ResidualKind` in every
backend's table, chosen by the config, and no loop or engine chooser that branches on the
hyper-connection fields instead."""

from __future__ import annotations

from pathlib import Path

import numpy as np
import pytest

from strata.errors import ConfigError
from strata.model_config import LayerRange, ResidualKind
from strata.reference.model import ModelParams, ModelState, forward
from strata.reference.residual import RESIDUALS, HyperConnections, PlainResidual, residual_for
from strata.testing.models import SHAPES, make_dense

ROOT = Path(__file__).resolve().parents[2]
# the layer loops and the engine choosers: the residual is the strategy's business, not theirs
CHOOSERS = ("strata/reference/model.py", "strata/reference/layers.py", "strata/numpy_backend", "strata/engines.py",
            "strata/mlx_backend/engine.py", "strata/mlx_backend/model.py", "strata/mlx_backend/compute.py",
            "strata/runtime/decode.py", "strata/runtime/prompt.py")


def _params(shape: str) -> ModelParams:
    cfg = SHAPES[shape]
    return ModelParams(cfg, make_dense(cfg, seed=3), experts=None)


def test_every_kind_has_a_reference_strategy():
    assert set(RESIDUALS) == set(ResidualKind)


def test_every_kind_has_an_mlx_strategy():
    pytest.importorskip("mlx.core")
    from strata.mlx_backend.residual import RESIDUALS as MLX_RESIDUALS

    assert set(MLX_RESIDUALS) == set(ResidualKind)


@pytest.mark.parametrize("shape, kind, strategy", [("tiny", ResidualKind.PLAIN, PlainResidual),
                                                   ("qwen4", ResidualKind.HYPER_CONNECTIONS, HyperConnections)])
def test_the_config_chooses_the_strategy(shape, kind, strategy):
    params = _params(shape)
    assert params.cfg.residual is kind
    assert isinstance(residual_for(params), strategy)


def test_hyper_connections_widen_the_residual_to_every_stream():
    params = _params("qwen4")
    cfg, residual = params.cfg, residual_for(params)
    x = np.arange(2 * cfg.hidden_size, dtype=np.float32).reshape(2, cfg.hidden_size)
    streams = residual.expand(params, x, np.zeros(2, np.int64))
    assert streams.shape == (2, cfg.qwen4.hc_count * cfg.hidden_size)
    assert np.array_equal(streams[:, -cfg.hidden_size:], x)  # every stream starts as the embedding
    h, inject = residual.ffn_read(params, 0, streams)
    assert h.shape == (2, cfg.hidden_size) and inject.shape == (2, cfg.qwen4.hc_count)


def test_a_pipeline_stage_of_hyper_connections_is_refused_in_one_line():
    params = _params("qwen4")
    stage = LayerRange(0, 2, params.cfg.n_layers)
    with pytest.raises(ConfigError, match="pipeline stages of a hyper-connection model"):
        forward(params, ModelState.empty(params.cfg), np.asarray([1, 2]), layers=stage)


def test_no_loop_or_chooser_branches_on_the_hyper_connection_fields():
    files = []
    for name in CHOOSERS:
        path = ROOT / name
        files += sorted(path.rglob("*.py")) if path.is_dir() else [path]
    assert len(files) > 5
    found = [f"{f.relative_to(ROOT)}:{i}" for f in files
             for i, line in enumerate(f.read_text().splitlines(), 1) if "hc_count" in line]
    assert not found, "a branch on hc_count outside the residual strategies: " + ", ".join(found)
