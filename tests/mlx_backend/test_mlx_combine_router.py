"""The combine and router kernels on the emulated path against numpy: odd hidden sizes and partial
counts, T > 1, the shared expert absent / ungated / gated, the guess absent or present, sizes that
take the kernels' batched loops (several load batches a lane, several norm passes); and
determinism (the same inputs twice give the same bits: every sum is in a fixed order); and the
specialisations the tiny model does not launch, compile-checked as Metal and CUDA.
"""

from __future__ import annotations

import mlx.core as mx
import numpy as np
import pytest
from mlx_agree import assert_backends_agree
from test_metal_compile import _check as compile_check

from strata.formats.quant_types import QuantType
from strata.mlx_backend.kernels import combine as combine_kernel
from strata.mlx_backend.kernels import emulate
from strata.mlx_backend.kernels import router as router_kernel
from strata.mlx_backend.kernels.launch import KernelPath, recording, using_path
from strata.mlx_backend.kernels.preludes import Dialect
from strata.reference.attention import rms_norm
from strata.reference.quants import gemv, quantize

pytestmark = pytest.mark.skipif(not emulate.available(), reason="no C++20 compiler")

EPS = 1e-6


# ---------------------------------------------------------------- combine


def _combine_case(seed: int, t: int, d: int, p: int, ps: int, gate: bool):
    rng = np.random.default_rng(seed)
    x = rng.standard_normal((t, d)).astype(np.float32)
    routed = rng.standard_normal((t, p, d)).astype(np.float32)
    shared = rng.standard_normal((t, ps, d)).astype(np.float32) if ps else None
    h = rng.standard_normal((t, d)).astype(np.float32)
    gate_inp = (rng.standard_normal(d) / np.sqrt(d)).astype(np.float16) if gate else None
    return x, routed, shared, h, gate_inp


def _combine_reference(x, routed, shared, h, gate_inp) -> np.ndarray:
    """x + (sum routed + sigmoid(gate_inp . h) * sum shared), in float64."""
    y = x.astype(np.float64) + routed.astype(np.float64).sum(axis=1)
    if shared is not None:
        s = shared.astype(np.float64).sum(axis=1)
        if gate_inp is not None:
            s = s / (1.0 + np.exp(-(h.astype(np.float64) @ gate_inp.astype(np.float64))))[:, None]
        y = y + s
    return y.astype(np.float32)


def _combine(x, routed, shared, h, gate_inp) -> np.ndarray:
    with using_path(KernelPath.EMULATED):
        return np.array(combine_kernel.combine(mx.array(x), mx.array(routed), None if shared is None else mx.array(shared),
                                               mx.array(h), None if gate_inp is None else mx.array(gate_inp)))


COMBINE_CASES = [  # (T, D, P, PS, gate_inp given)
    (1, 64, 3, 2, True),     # gated, one strip group a block
    (1, 64, 5, 0, False),    # no shared expert
    (1, 64, 5, 0, True),     # gate_inp given but no shared expert: ungated
    (2, 100, 7, 3, False),   # ungated; D % 16 != 0 (a partial last strip)
    (3, 130, 9, 1, True),    # D % 4 != 0: scalar columns
    (1, 256, 37, 5, True),   # odd counts of partials, 42 rows over 64 subsets
    (2, 48, 1, 1, True),     # one partial each
    (1, 32, 600, 17, True),  # more rows than one load batch (64 subsets x 8 loads)
]


@pytest.mark.parametrize("t,d,p,ps,gate", COMBINE_CASES)
def test_combine_against_numpy(t, d, p, ps, gate):
    args = _combine_case(0, t, d, p, ps, gate)
    assert_backends_agree(_combine_reference(*args), _combine(*args), "FAST", what=f"combine T={t} D={d} P={p} PS={ps}")


def test_combine_is_deterministic():
    args = _combine_case(1, 2, 160, 23, 7, True)
    np.testing.assert_array_equal(_combine(*args), _combine(*args))


def test_combine_token_bits_do_not_depend_on_the_batch():
    """The strip width is fixed, so a token's sum order is the same alone and in a batch."""
    x, routed, shared, h, gate_inp = _combine_case(2, 3, 96, 11, 4, True)
    batch = _combine(x, routed, shared, h, gate_inp)
    alone = _combine(x[1:2], routed[1:2], shared[1:2], h[1:2], gate_inp)
    np.testing.assert_array_equal(batch[1:2], alone)


# ---------------------------------------------------------------- router


def _router_case(seed: int, t: int, d: int, p: int, e: int, ng: int):
    rng = np.random.default_rng(seed)
    x = rng.standard_normal((t, d)).astype(np.float32)
    parts = (rng.standard_normal((t, p, d)) * 0.5).astype(np.float32)
    norm_w = (1.0 + 0.1 * rng.standard_normal(d)).astype(np.float16)
    w = (rng.standard_normal((e, d)) / np.sqrt(d)).astype(np.float32)
    guess = quantize(QuantType.Q8_0, rng.standard_normal((ng, d)) / np.sqrt(d)) if ng else None
    return x, parts, norm_w, w, guess


def _router(x, parts, norm_w, w, guess) -> list[np.ndarray]:
    with using_path(KernelPath.EMULATED):
        out = router_kernel.router(mx.array(x), mx.array(parts), mx.array(norm_w), mx.array(w),
                                   None if guess is None else mx.array(guess.codes),
                                   None if guess is None else mx.array(guess.scales), EPS)
        return [np.array(a) for a in out]


ROUTER_CASES = [  # (T, D, P, E, NG)
    (1, 64, 1, 8, 8),       # one partial (attention's coming layout), guess present
    (2, 96, 3, 5, 0),       # odd E, no guess, T > 1
    (3, 160, 2, 13, 7),     # odd E and NG: partly idle warps in both halves
    (1, 256, 1, 16, 16),
    (1, 36, 2, 3, 0),       # D % 32 != 0 without a guess
    (2, 4096, 1, 4, 3),     # two batches of row loads a lane
    (1, 8192, 2, 2, 1),     # two norm passes a thread
    (1, 256, 16, 16, 0),    # a partial a head (attend_project): four batches of PB = 4 partials
    (2, 96, 6, 5, 3),       # P not a multiple of PB
]


@pytest.mark.parametrize("t,d,p,e,ng", ROUTER_CASES)
def test_router_against_numpy(t, d, p, e, ng):
    x, parts, norm_w, w, guess = _router_case(0, t, d, p, e, ng)
    x_mid, h, z, g = _router(x, parts, norm_w, w, guess)
    ref_mid = (x.astype(np.float64) + parts.astype(np.float64).sum(axis=1)).astype(np.float32)
    ref_h = rms_norm(ref_mid, norm_w.astype(np.float32), EPS)
    what = f"router T={t} D={d} P={p} E={e} NG={ng}"
    assert_backends_agree(ref_mid, x_mid, "FAST", what=f"{what}: x_mid")
    assert_backends_agree(ref_h, h, "FAST", what=f"{what}: h")
    assert_backends_agree(ref_h @ w.T, z, "FAST", what=f"{what}: z")
    assert g.shape == (t, max(ng, 1))
    if ng:
        assert_backends_agree(gemv(guess, ref_h), g, "FAST", what=f"{what}: guess")


def test_router_is_deterministic():
    args = _router_case(1, 2, 160, 2, 13, 7)
    for a, b in zip(_router(*args), _router(*args)):
        np.testing.assert_array_equal(a, b)


def test_router_rejects_hidden_sizes_its_loads_cannot_take():
    x, parts, norm_w, w, _ = _router_case(0, 1, 34, 1, 4, 0)
    with pytest.raises(ValueError, match="multiple of 4"):
        _router(x, parts, norm_w, w, None)


# ---------------------------------------------------------------- the odd specialisations compile


@pytest.mark.parametrize("dialect", [Dialect.METAL, Dialect.CUDA], ids=["metal", "cuda"])
def test_odd_specialisations_compile(tmp_path, dialect):
    """The tiny model (tests/mlx_backend/test_metal_compile.py) launches neither scalar-column combine
    (D % 4 != 0) nor batched router loads (D > 2560): compile those as Metal and CUDA too."""
    with recording() as rec:
        _combine(*_combine_case(0, 1, 130, 3, 2, True))
        _router(*_router_case(0, 1, 4096, 1, 4, 3))
    errors = [err for err in (compile_check(tmp_path, dialect, spec) for spec in rec) if err]
    assert not errors, "\n\n".join(errors)
