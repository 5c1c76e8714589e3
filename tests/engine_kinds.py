"""The engines the session tests run every case through, one name each, and how their outputs are
compared: bit for bit where the arithmetic is the reference's (the numpy engines, positions
grouped alike), FLOAT32_REORDER where positions were grouped otherwise, FORWARD on MLX."""

from __future__ import annotations

import numpy as np
import pytest

from mlx_agree import assert_backends_agree
from strata.config import Backend, Config
from strata.engines import open_engine
from strata.runtime.decode import arena_plan_for
from strata.testing.engines import open_numpy_streaming
from tests.budgets import FLOAT32_REORDER

EXACT0 = Config(moce_lambda=0.0)
ENGINES = ["reference", "numpy-min", "numpy-full", "mlx-resident", "mlx-min"]
EXACT_ENGINES = {"reference", "numpy-min", "numpy-full"}  # the reference's arithmetic


def min_slots(model, config: Config = EXACT0) -> int:
    """The smallest legal arena for `config` (its window and read-ahead)."""
    return arena_plan_for(model, config.replace(arena="100000slots")).min_slots


def all_slots(model) -> int:
    return model.experts_file.header.n_records


def open_kind(model, kind: str, config: Config = EXACT0):
    """The engine `kind` names: the reference, numpy streaming at the smallest arena or with every
    expert (or the window's smallest arena where that is more), MLX resident, MLX streaming at the
    smallest arena. The caller closes it."""
    if kind == "reference":
        return open_engine(model, config.replace(backend=Backend.NUMPY), stream=False)
    if kind == "numpy-min":
        return open_numpy_streaming(model, config.replace(arena=f"{min_slots(model, config)}slots"))
    if kind == "numpy-full":
        slots = max(all_slots(model), min_slots(model, config))
        return open_numpy_streaming(model, config.replace(arena=f"{slots}slots"))
    pytest.importorskip("mlx.core")
    from strata.formats.quant_types import QuantType
    from strata.mlx_backend.quants import native_refusal

    why = native_refusal(QuantType(model.experts_file.header.qtype))
    if why is not None:  # MXFP4 on MLX's CUDA build: refused in one line, not computed
        pytest.skip(why)
    if kind == "mlx-resident":
        return open_engine(model, config.replace(backend=Backend.MLX), stream=False)
    if kind == "mlx-min":
        return open_engine(model, config.replace(backend=Backend.MLX, arena=f"{min_slots(model, config)}slots"),
                           stream=True)
    raise ValueError(kind)


def agree(kind: str, ref, got, what: str, *, regrouped: bool = False) -> None:
    """Bit for bit on the numpy engines (FLOAT32_REORDER where positions were grouped otherwise);
    FORWARD on MLX."""
    if kind not in EXACT_ENGINES:
        assert_backends_agree(np.asarray(ref), np.asarray(got), "FORWARD", what=what)
    elif regrouped:
        np.testing.assert_allclose(got, ref, err_msg=what, **FLOAT32_REORDER)
    else:
        np.testing.assert_array_equal(got, ref, err_msg=what)
