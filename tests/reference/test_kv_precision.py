"""The KV cache's precision knob (reference.attention.KVPrecision) and its quality measurement
(tools/kv_quality.py): float32 is exact (the default, KLD exactly 0); float16 stores each key and
value rounded once, the writing step's own position included, and changes nothing before it."""

from __future__ import annotations

import numpy as np
import pytest

from strata.reference.attention import KVPrecision, LayerKV
from strata.reference.model import ModelState, forward
from strata.tools.kv_quality import decode_logits, kv_quality, with_precision
from tests.models import tiny_params

TOKENS = np.array([3, 17, 5, 9, 30, 2, 11, 8, 21, 4])


def test_store_rounds_to_binary16_only_for_f16():
    a = np.array([1.0 + 2.0 ** -12, 3.14159265, -7e-6, 65504.0], np.float32)
    assert KVPrecision.F32.store(a) is a
    np.testing.assert_array_equal(KVPrecision.F16.store(a), a.astype(np.float16).astype(np.float32))
    assert KVPrecision.F16.store(a)[0] == 1.0  # to nearest even: the tie goes down


def test_f16_cache_holds_the_f32_run_s_keys_rounded():
    """Step by step, the float16 cache's positions are the float32 cache's, rounded: the keys
    (normed, roped) and values are computed the same way before the store."""
    p = tiny_params(seed=4)
    s32 = ModelState.empty(p.cfg)
    s16 = with_precision(ModelState.empty(p.cfg), KVPrecision.F16)
    for tok in TOKENS[:4]:
        _, s32 = forward(p, s32, np.array([tok]))
        _, s16 = forward(p, s16, np.array([tok]))
        a, b = s32.layers[0], s16.layers[0]  # layer 0's inputs agree exactly; later layers see the rounding
        assert isinstance(b, LayerKV) and b.precision is KVPrecision.F16 and a.precision is KVPrecision.F32
        np.testing.assert_array_equal(b.keys, KVPrecision.F16.store(a.keys))
        np.testing.assert_array_equal(b.values, KVPrecision.F16.store(a.values))
    assert s16.layers[0].trim(2).precision is KVPrecision.F16


def test_kv_quality_is_exactly_zero_for_f32_and_small_for_f16():
    p = tiny_params(seed=5)
    q32 = kv_quality(p, TOKENS, KVPrecision.F32, warmup=1)
    assert q32.kld_max == 0.0 and q32.argmax_agree == 1.0 and q32.ppl == q32.ppl_f32
    q16 = kv_quality(p, TOKENS, KVPrecision.F16, warmup=1)
    assert q16.positions == len(TOKENS) - 1
    assert 0.0 < q16.kld_max  # the rounding reaches the logits
    assert q16.kld_mean <= q16.kld_p90 <= q16.kld_max
    assert not np.array_equal(decode_logits(p, TOKENS[:5], KVPrecision.F32), decode_logits(p, TOKENS[:5], KVPrecision.F16))


def test_with_precision_refuses_a_filled_cache():
    p = tiny_params(seed=6)
    _, state = forward(p, ModelState.empty(p.cfg), TOKENS[:2])
    with pytest.raises(ValueError, match="empty"):
        with_precision(state, KVPrecision.F16)
