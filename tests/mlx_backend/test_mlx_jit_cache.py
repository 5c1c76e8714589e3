"""MLX's PTX cache directory (strata/mlx_backend/jit_cache.py): the user's value is kept, the
default is per MLX version under the user's cache directory, and clear() empties it."""

from __future__ import annotations

import os
from pathlib import Path

import mlx.core as mx

import strata.mlx_backend  # noqa: F401  (its import sets the default)
from strata.mlx_backend import jit_cache


def test_import_set_a_cache_dir():
    assert os.environ.get(jit_cache.ENV)


def test_user_value_is_kept():
    env = {jit_cache.ENV: "/somewhere/else", "XDG_CACHE_HOME": "/x"}
    assert jit_cache.set_default(env) == "/somewhere/else"
    assert env[jit_cache.ENV] == "/somewhere/else"


def test_default_is_per_version_under_the_cache_home(tmp_path):
    env = {"XDG_CACHE_HOME": str(tmp_path)}
    got = jit_cache.set_default(env)
    assert Path(got) == tmp_path / "strata" / "mlx-ptx" / mx.__version__ == Path(env[jit_cache.ENV])
    assert jit_cache.default_dir("9.9.9", {}) == Path.home() / ".cache" / "strata" / "mlx-ptx" / "9.9.9"
    assert jit_cache.set_default({jit_cache.ENV: "", "XDG_CACHE_HOME": str(tmp_path)}) == got  # empty: unset


def test_clear_removes_the_cached_modules(tmp_path, monkeypatch):
    d = tmp_path / "ptx"
    (d / "long").mkdir(parents=True)
    for name in ("gather_float32_int32_1.ptx", "gather_float32_int32_1.txt", "long/tail.ptx"):
        (d / name).write_bytes(b"x")
    monkeypatch.setenv(jit_cache.ENV, str(d))
    assert jit_cache.cache_dir() == d
    assert jit_cache.clear() == 3
    assert not d.exists()
    assert jit_cache.clear() == 0
