"""The prompt path's RoPE (strata/mlx_backend/prompt_attention.py `_rope`): the ops path's rotation
(attention.py: duplicated cos / sin tables, a rotated copy) bit for bit, whole-head and partial."""

from __future__ import annotations

from dataclasses import replace

import mlx.core as mx
import numpy as np
import pytest

from strata.mlx_backend.attention import rope_table_cached
from strata.mlx_backend.prompt_attention import _rope
from strata.testing.models import SHAPES


def _ops_rope(cfg, a, start):
    """attention.py's rotation, as the decode's ops path writes it."""
    cos_t, sin_t = rope_table_cached(cfg)
    t, rd = a.shape[1], cfg.rope_dim
    cos = mx.concatenate([cos_t[start:start + t]] * 2, axis=-1)
    sin = mx.concatenate([sin_t[start:start + t]] * 2, axis=-1)
    rot = mx.concatenate([-a[..., rd // 2:rd], a[..., :rd // 2]], axis=-1)
    return mx.concatenate([a[..., :rd] * cos + rot * sin, a[..., rd:]], axis=-1)


@pytest.mark.parametrize("rotary", [None, 16], ids=["whole_head", "partial"])
@pytest.mark.parametrize("start", [0, 7])
def test_prompt_rope_is_the_ops_rotation(rotary, start):
    cfg = SHAPES["tiny"]
    cfg = replace(cfg, rotary_dim=rotary) if rotary else cfg
    a = mx.array(np.random.default_rng(start).standard_normal((3, 11, cfg.head_dim)).astype(np.float32))
    np.testing.assert_array_equal(np.array(_rope(cfg, a, start)), np.array(_ops_rope(cfg, a, start)))
