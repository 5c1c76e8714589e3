"""Latent attention (reference/mla.py): the absorbed and expanded forms agree, the cache holds
the latent and the rope key only, decoding position by position is the whole prompt at once,
`trim` restores, and the 'mla' made model streams bit for bit like the reference."""

from __future__ import annotations

import numpy as np
import pytest

from strata.model_config import Mixer, dense_tensor_shapes
from strata.reference.mla import LatentKV, absorbed_is_cheaper, mla
from strata.testing.models import SHAPES, make_dense
from tests.budgets import FLOAT32_REORDER

CFG = SHAPES["mla"]


@pytest.fixture(scope="module")
def dense():
    d = make_dense(CFG, 1)
    rng = np.random.default_rng(0)
    for name in d:  # larger queries than the made model's: attention far from uniform, so a wrong score shows
        if "attn_q_b" in name:
            d[name] = rng.normal(0, 0.3, d[name].shape).astype(np.float32)
    return d


def test_forms_agree_and_the_cache_is_the_latent(dense):
    x = np.random.default_rng(1).normal(0, 1, (12, CFG.hidden_size)).astype(np.float32)
    a, sa = mla(CFG, dense, 1, LatentKV.empty(CFG), x, absorbed=True)
    b, sb = mla(CFG, dense, 1, LatentKV.empty(CFG), x, absorbed=False)
    np.testing.assert_allclose(a, b, **FLOAT32_REORDER)
    assert sa.latent.shape == (12, CFG.mla.kv_lora_rank) and sa.rope_key.shape == (12, CFG.mla.qk_rope_head_dim)
    np.testing.assert_array_equal(sa.latent, sb.latent)


def test_decode_one_by_one_is_the_prompt_at_once_and_trim_restores(dense):
    x = np.random.default_rng(2).normal(0, 1, (9, CFG.hidden_size)).astype(np.float32)
    whole, state = mla(CFG, dense, 2, LatentKV.empty(CFG), x)
    kv, rows = LatentKV.empty(CFG), []
    for t in range(9):
        out, kv = mla(CFG, dense, 2, kv, x[t:t + 1])
        rows.append(out[0])
    np.testing.assert_allclose(np.stack(rows), whole, **FLOAT32_REORDER)
    again, _ = mla(CFG, dense, 2, state.trim(5), x[5:])
    np.testing.assert_allclose(again, whole[5:], **FLOAT32_REORDER)


def test_causality(dense):
    x = np.random.default_rng(3).normal(0, 1, (6, CFG.hidden_size)).astype(np.float32)
    y = x.copy()
    y[4:] += 1.0
    a, _ = mla(CFG, dense, 1, LatentKV.empty(CFG), x)
    b, _ = mla(CFG, dense, 1, LatentKV.empty(CFG), y)
    np.testing.assert_array_equal(a[:4], b[:4])
    assert not np.allclose(a[4:], b[4:])


def test_which_form_is_cheaper():
    """Decoding absorbs once anything is cached; a prompt chunk over itself expands
    (DeepSeek-V3's shape: c = 512, n = r*2 = v = 128)."""

    ds = CFG.with_fields(kv_lora_rank=512, qk_nope_head_dim=128, qk_rope_head_dim=64, v_head_dim=128, head_dim=192,
                 q_lora_rank=1536)
    assert absorbed_is_cheaper(ds, 1, 2) and absorbed_is_cheaper(ds, 1, 4096)
    assert not absorbed_is_cheaper(ds, 512, 512)


def test_mla_tensors_replace_the_attention_projections():
    shapes = dense_tensor_shapes(CFG)
    assert "blk.1.attn_k.weight" not in shapes and "blk.1.attn_q.weight" not in shapes
    assert shapes["blk.1.attn_kv_b.weight"] == (CFG.n_heads * (16 + 16), 32)
    assert shapes["blk.1.attn_output.weight"] == (CFG.hidden_size, CFG.n_heads * 16)
    assert all(k.mixer is Mixer.MLA for k in CFG.kinds)
