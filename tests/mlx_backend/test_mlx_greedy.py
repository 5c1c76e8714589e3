"""Greedy selection on the device (strata/mlx_backend/greedy.py) against the host's choice:
numpy's argmax with its first-index tie rule, log_softmax's value, check_finite_logits' test;
and the compiled step's device-token input (a GPU trace; the shape check anywhere)."""

from __future__ import annotations

from dataclasses import replace

import mlx.core as mx
import numpy as np
import pytest

from budgets import DEVICE_LOGPROB_ATOL
from strata.mlx_backend import compiled as compiled_step
from strata.mlx_backend import model as mlx_model
from strata.mlx_backend.compiled import CompiledDecode
from strata.mlx_backend.greedy import greedy_select, read_selection
from strata.mlx_backend.kernels.launch import LAUNCHES, KernelPath, gpu_dialect, index_param, using_path
from strata.mlx_backend.kernels.source import MIN_INPUT_SIZE
from strata.reference.sampling import SamplerConfig, log_softmax, sample
from strata.testing.mlx_params import SEED_SHAPE, random_params

SMALL = replace(SEED_SHAPE, n_layers=2, hidden_size=256, n_experts=16, n_experts_per_token=4, expert_ffn_size=64,
                shared_ffn_size=64, n_heads=4, n_kv_heads=2, head_dim=64, vocab_size=512, max_context=64)
GREEDY = SamplerConfig()


def _host(z: np.ndarray) -> tuple[int, float | None, bool]:
    """What generate's host loop takes of one position's logits: token, logprob, finite (no
    logprob where it would raise first)."""
    token, finite = sample(z, GREEDY, 0), bool(np.isfinite(z.max()))
    return token, float(log_softmax(z)[token]) if finite else None, finite


@pytest.mark.parametrize("vocab", [7, 512, 151_936])
def test_the_device_choice_is_the_hosts(vocab):
    rng = np.random.default_rng(vocab)
    for trial in range(4):
        z = (rng.standard_normal(vocab) * 4).astype(np.float32)
        if trial:  # ties at the maximum: numpy keeps the first index, so must the device
            at = rng.choice(vocab, size=min(3, vocab), replace=False)
            z[at] = z.max() + 1.0
        got = read_selection(greedy_select(mx.array(z)[None]))
        token, logprob, finite = _host(z)
        assert got.token == token and got.finite and finite
        assert abs(got.logprob - logprob) <= DEVICE_LOGPROB_ATOL


@pytest.mark.parametrize("bad, finite", [("nan", False), ("inf", False), ("all -inf", False), ("some -inf", True)])
def test_finiteness_is_check_finite_logits_test(bad, finite):
    """The host raises where the max is not finite (NaN propagates through it); -inf logits that
    are not the max are legitimate (a masked token)."""
    z = np.linspace(-3, 3, 64, dtype=np.float32)
    if bad == "nan":
        z[10] = np.nan
    elif bad == "inf":
        z[5] = np.inf
    elif bad == "all -inf":
        z[:] = -np.inf
    else:
        z[:20] = -np.inf
    got = read_selection(greedy_select(mx.array(z)))
    assert got.finite is finite is _host(z)[2]
    if finite:
        assert got.token == _host(z)[0] and abs(got.logprob - _host(z)[1]) <= DEVICE_LOGPROB_ATOL


def test_the_selection_is_a_device_token_input():
    """Its shape is index_param's (one trace serves host and device tokens), element 0 the id."""
    packed = greedy_select(mx.array(np.arange(10, dtype=np.float32)))
    assert packed.dtype == mx.int32 and packed.shape == (MIN_INPUT_SIZE,) == index_param(3).shape
    assert int(packed[0].item()) == 9
    compiled_step.check_device_token(packed)
    with pytest.raises(ValueError, match="int32"):
        compiled_step.check_device_token(mx.zeros((MIN_INPUT_SIZE,), mx.float32))
    with pytest.raises(ValueError, match="int32"):
        compiled_step.check_device_token(mx.zeros((2,), mx.int32))
    one = mx.array([9], mx.int32)  # [1] is taken too, padded to the one input shape
    compiled_step.check_device_token(one)
    assert np.array(compiled_step.device_ids(one)).tolist() == [9] + [0] * (MIN_INPUT_SIZE - 1)
    assert compiled_step.device_ids(packed) is packed
    with pytest.raises(ValueError, match="one position"):
        greedy_select(mx.zeros((2, 8)))


@pytest.mark.gpu
@pytest.mark.skipif(gpu_dialect() is None, reason="no MLX GPU here")
def test_compiled_step_with_a_device_token_equals_the_int_token():
    """The same trace (no Python wrapper runs again) and the same logits, bit for bit, whether the
    token comes from the host or from the previous step's device selection."""
    with using_path(KernelPath.GPU):
        p = random_params(SMALL, seed=11, pred_q8=False)
        prompt = np.array([7, 3, 11])
        runs = []
        for device in (False, True):
            logits, state = mlx_model.forward(p, mlx_model.MlxModelState.empty(p.cfg), prompt)
            token = greedy_select(logits[-1:])
            step = CompiledDecode(p, state)
            out = []
            for i in range(4):
                before = sum(LAUNCHES.values())
                host = read_selection(token).token
                logits, state = step(state, (token if i % 2 else token[:1]) if device else host)  # [8] and [1]
                if i:
                    assert sum(LAUNCHES.values()) == before, "retraced"
                token = greedy_select(logits)
                out.append(np.array(logits))
            runs.append(np.stack(out))
        assert runs[0].tobytes() == runs[1].tobytes()
