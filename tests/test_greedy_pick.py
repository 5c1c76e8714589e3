"""Greedy selection in one launch (kernels/greedy_pick.py; greedy.PICK_KERNEL) against the host's
choice: numpy's first index of the maximum (ties inside a block and across blocks), the
log-probability within DEVICE_LOGPROB_ATOL of log_softmax, check_finite_logits' test (a NaN
anywhere, an infinite maximum, every logit -inf); as one chained launch and as two (Metal's form)."""

from __future__ import annotations

import mlx.core as mx
import numpy as np
import pytest

from budgets import DEVICE_LOGPROB_ATOL
from strata.mlx_backend import greedy
from strata.mlx_backend.greedy import greedy_select, read_selection
from strata.mlx_backend.kernels import greedy_pick, phases
from strata.mlx_backend.kernels.launch import LAUNCHES, KernelPath, using_path
from strata.reference.sampling import SamplerConfig, log_softmax, sample
from tests.kernel_paths import KERNEL_PATHS, emulated

CH = greedy_pick.CH


def _host(z: np.ndarray) -> tuple[int, float | None, bool]:
    token, finite = sample(z, SamplerConfig(), 0), bool(np.isfinite(z.max()))
    return token, float(log_softmax(z)[token]) if finite else None, finite


def _check(z: np.ndarray, got) -> None:
    token, logprob, finite = _host(z)
    assert got.finite is finite
    if finite:
        assert got.token == token
        assert abs(got.logprob - logprob) <= DEVICE_LOGPROB_ATOL


@pytest.mark.parametrize("path", KERNEL_PATHS)
@pytest.mark.parametrize("vocab", [7, CH, 3 * CH + 5, 151_936])
def test_the_pick_is_the_hosts_choice(path, vocab):
    rng = np.random.default_rng(vocab)
    with using_path(path):
        for trial in range(3):
            z = (rng.standard_normal(vocab) * 4).astype(np.float32)
            if trial == 1:  # ties at the maximum, spread over the blocks
                at = rng.choice(vocab, size=min(4, vocab), replace=False)
                z[at] = z.max() + 1.0
            if trial == 2 and vocab > CH:  # the maximum in three blocks, first in block 0's last place
                z[[CH + 3, CH - 1, vocab - 1]] = z.max() + 2.0
            _check(z, read_selection(greedy_pick.pick(mx.array(z))))


@emulated
@pytest.mark.parametrize("chained", [True, False], ids=["one-launch", "two-launches"])
@pytest.mark.parametrize("bad, finite", [("nan", False), ("nan-late", False), ("inf", False), ("all -inf", False),
                                         ("some -inf", True), ("a block of -inf", True)])
def test_finiteness_is_check_finite_logits_test(monkeypatch, chained, bad, finite):
    monkeypatch.setattr(phases, "available", lambda: chained)
    z = np.linspace(-3, 3, 2 * CH + 100, dtype=np.float32)
    if bad == "nan":
        z[10] = np.nan
    elif bad == "nan-late":  # a NaN in the last block, the maximum in another
        z[-1], z[5] = np.nan, 9.0
    elif bad == "inf":
        z[5] = np.inf
    elif bad == "all -inf":
        z[:] = -np.inf
    elif bad == "some -inf":
        z[:20] = -np.inf
    else:
        z[CH:2 * CH] = -np.inf
    names = ("strata_chain_greedy_part_greedy_join",) if chained else ("strata_greedy_part", "strata_greedy_join")
    before = [LAUNCHES[n] for n in names]
    with using_path(KernelPath.EMULATED):
        got = read_selection(greedy_pick.pick(mx.array(z)))
    assert [LAUNCHES[n] - b for n, b in zip(names, before)] == [1] * len(names)
    assert got.finite is finite is _host(z)[2]
    _check(z, got)


@pytest.mark.parametrize("path", KERNEL_PATHS)
def test_greedy_select_takes_the_launch_where_switched_on(monkeypatch, path):
    """greedy.PICK_KERNEL on a kernel path (on the GPU: compiled, twice, the second a replay): the
    same packed layout, token and finiteness as MLX's ops form, the log-probability within the
    budget of it; on the ops path the ops form."""
    rng = np.random.default_rng(3)
    zs = [(rng.standard_normal(5000) * 3).astype(np.float32) for _ in range(2)]
    with using_path(KernelPath.OPS):
        ops = [np.array(greedy_select(mx.array(z)[None])) for z in zs]
    monkeypatch.setattr(greedy, "PICK_KERNEL", True)
    with using_path(path):
        name = "strata_chain_greedy_part_greedy_join" if phases.available() else "strata_greedy_join"
        before = LAUNCHES[name]
        got = []
        for z in zs:
            packed = greedy_select(mx.array(z)[None])
            assert packed.dtype == mx.int32 and packed.shape == (ops[0].size,)
            got.append(np.array(packed))
    assert LAUNCHES[name] - before >= 1
    for g, o in zip(got, ops):
        assert g[0] == o[0] and g[2] == o[2] and (g[3:] == 0).all()
        assert abs(g[1:2].view(np.float32)[0] - o[1:2].view(np.float32)[0]) <= DEVICE_LOGPROB_ATOL
    with using_path(KernelPath.OPS):
        assert np.array(greedy_select(mx.array(zs[0]))).tobytes() == ops[0].tobytes()


def test_a_vocabulary_past_exact_float_indices_is_refused():
    with pytest.raises(ValueError, match="2\\^24"):
        greedy_pick.pick(mx.zeros((1 << 24,)))
