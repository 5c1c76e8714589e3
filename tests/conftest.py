"""Hypothesis profiles: `dev` (random, quick) and `ci` (derandomized, more examples), and
`device` (a GPU run under a time limit: few examples, no shrinking; tests/mlx_agree.py caps the
MLX tests' own example counts with it). Pick one with HYPOTHESIS_PROFILE; CI sets `ci`.

`-n auto` (the README's test command, pytest-xdist): one worker a physical core, at most
MAX_AUTO_WORKERS."""

import os

import psutil
import pytest
from hypothesis import HealthCheck, Phase, settings

# Each worker holds MLX, numpy's BLAS threads and, now and then, a C++ compiler and hundreds of
# megabytes of made models: past 8 the suite's longest tests, not the worker count, set its time.
MAX_AUTO_WORKERS = 8

settings.register_profile("dev", max_examples=50, deadline=None)
settings.register_profile(
    "ci", max_examples=100, deadline=None, derandomize=True, suppress_health_check=[HealthCheck.too_slow]
)
settings.register_profile(
    "device", max_examples=10, deadline=None, derandomize=True, suppress_health_check=list(HealthCheck),
    phases=[Phase.explicit, Phase.reuse, Phase.generate],
)
settings.load_profile(os.environ.get("HYPOTHESIS_PROFILE", "dev"))


@pytest.hookimpl(optionalhook=True)  # a hook of pytest-xdist: absent without it
def pytest_xdist_auto_num_workers(config):
    if os.environ.get("PYTEST_XDIST_AUTO_NUM_WORKERS"):
        return None  # pytest-xdist's own variable: its default hook reads it
    return max(1, min(MAX_AUTO_WORKERS, psutil.cpu_count(logical=False) or os.cpu_count() or 1))
