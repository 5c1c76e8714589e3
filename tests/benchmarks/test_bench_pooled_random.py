"""benchmarks/_pooled_random.py: pooled weights keep make_dense's shapes and scales and give
way afterwards; a pooled row store has the declared tables, its shards repeating one shard."""

from __future__ import annotations

import sys
from pathlib import Path

import numpy as np

sys.path.insert(0, str(Path(__file__).resolve().parents[2] / "benchmarks"))

from _pooled_random import POOL_WEIGHTS, pooled_normals, write_pooled_store  # noqa: E402
from strata.formats.quant_types import QuantType  # noqa: E402
from strata.testing import models  # noqa: E402
from strata.testing.models import SHAPES, make_dense  # noqa: E402


def test_pooled_weights_have_make_denses_shapes_and_scales_and_give_way_after():
    cfg = SHAPES["qwen4"]
    fresh = make_dense(cfg, 0)
    original = models._normal
    with pooled_normals(0):
        pooled = make_dense(cfg, 0)
    assert models._normal is original
    assert {k: v.shape for k, v in pooled.items()} == {k: v.shape for k, v in fresh.items()}
    assert all(v.dtype == np.float32 and np.isfinite(v).all() for v in pooled.values())
    big = [k for k, v in fresh.items() if v.ndim == 2 and v.size >= 4096]
    for name in big:  # the same scale (1/sqrt(fan-in), or the structure's), other values
        assert 0.8 < pooled[name].std() / fresh[name].std() < 1.25, name
    assert any(not np.array_equal(pooled[k], fresh[k]) for k in big)


def test_a_long_tensor_wraps_the_pool():
    with pooled_normals(1):
        x = models._normal(None, (POOL_WEIGHTS + 1000,), 2.0)
    assert x.shape == (POOL_WEIGHTS + 1000,) and abs(x.std() - 2.0) < 0.01


def test_a_pooled_store_has_its_tables_and_repeats_one_shard(tmp_path):
    shapes = {0: (1000, 64), 1: (2500, 64)}
    with write_pooled_store(tmp_path / "s.ngrams", shapes=shapes, qtype=QuantType.F16, shard_rows=1000) as store:
        a = store.rows(1, np.arange(0, 10))
        b = store.rows(1, np.arange(1000, 1010))  # the next shard: the same rows again
        c = store.rows(0, np.arange(995, 1000))
        assert a.shape == (10, 64) and np.abs(a).max() > 0
        np.testing.assert_array_equal(a, b)
        np.testing.assert_array_equal(c, store.rows(1, np.arange(995, 1000)))
        last = store.rows(1, np.arange(2490, 2500))
        np.testing.assert_array_equal(last, store.rows(1, np.arange(490, 500)))


def test_large_tensors_can_come_as_float16_of_the_same_scale():
    cfg = SHAPES["qwen4"]
    with pooled_normals(0):
        f32 = make_dense(cfg, 0)
    with pooled_normals(0, f16_from=4096):
        f16 = make_dense(cfg, 0)
    generic = [k for k, v in f16.items() if v.dtype == np.float16]
    assert generic and all(f16[k].size >= 4096 and np.isfinite(f16[k]).all() for k in generic)
    assert all(v.dtype == np.float32 for k, v in f16.items() if v.size < 4096)
    for k in generic:
        assert 0.9 < f16[k].astype(np.float32).std() / f32[k].std() < 1.1, k
