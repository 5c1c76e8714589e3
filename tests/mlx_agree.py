"""One comparison helper for the MLX backend's differential tests (STYLE §7); the budgets it
names (FAST, FORWARD, QUANTIZED, EXACT, ROUTING) are defined, with why, in tests/budgets.py."""

from __future__ import annotations

import sys

import numpy as np
from hypothesis import settings

from tests.budgets import BUDGETS, Budget  # noqa: F401  (Budget: re-exported for callers)


def to_numpy(a) -> np.ndarray:
    return np.array(a) if not isinstance(a, np.ndarray) else a


def assert_backends_agree(ref, fast, budget: str | Budget, *, what: str = "") -> None:
    """Shape, dtype (fast is float32 wherever the reference is), finiteness, then closeness."""
    b = BUDGETS[budget] if isinstance(budget, str) else budget
    r, f = to_numpy(ref), to_numpy(fast)
    assert r.shape == f.shape, f"{what}: shape {f.shape}, reference {r.shape}"
    if r.dtype == np.float32:
        assert f.dtype == np.float32, f"{what}: dtype {f.dtype}, reference float32"
    assert np.all(np.isfinite(f)) or not np.all(np.isfinite(r)), f"{what}: non-finite values"
    if b.rel_l2 == 0.0:
        np.testing.assert_array_equal(f, r, err_msg=what)
        return
    r64, f64 = r.astype(np.float64), f.astype(np.float64)
    scale = max(float(np.abs(r64).max(initial=0.0)), 1e-30)
    err = np.abs(f64 - r64)
    rel = float(np.linalg.norm(err) / max(np.linalg.norm(r64), 1e-30))
    assert rel <= b.rel_l2, f"{what}: relative L2 error {rel:.3g} > {b.rel_l2:g}"
    assert float(err.max(initial=0.0)) <= b.max_rel * scale, \
        f"{what}: max error {err.max():.3g} > {b.max_rel:g} x max|ref| {scale:.3g}"


def assert_selections_agree(ref, fast, *, what: str = "") -> None:
    """Two Selections: the same experts, ranks, protection, drops; weights to ROUTING."""
    for field in ("experts", "ranks", "protected", "resident", "dropped"):
        np.testing.assert_array_equal(getattr(fast, field), getattr(ref, field), err_msg=f"{what}: {field}")
    assert_backends_agree(ref.weights, fast.weights, "ROUTING", what=f"{what}: weights")


# ---------------------------------------------------------------- GPU runs under a time limit

DEVICE_PROFILE = "device"  # tests/conftest.py


def examples(n: int) -> int:
    """n hypothesis examples, or at most the `device` profile's when that profile is loaded (a GPU
    run has a time limit; every other profile keeps n)."""
    if getattr(settings, "_current_profile", None) == DEVICE_PROFILE:
        return max(1, min(n, settings.default.max_examples))
    return n


def pytest_runtest_logreport(report) -> None:
    """As a pytest plugin (`-p mlx_agree`, benchmarks/device_run.sh): a failure's traceback is
    printed the moment it happens, so a run killed at its time limit still shows it."""
    if report.failed:
        print(f"\n---- FAILED {report.nodeid} ({report.when})\n{report.longreprtext[-4000:]}\n----",
              file=sys.stdout, flush=True)
