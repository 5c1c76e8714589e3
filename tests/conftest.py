"""Hypothesis profiles: `dev` (random, quick) and `ci` (derandomized, more examples), and
`device` (a GPU run under a time limit: few examples, no shrinking; tests/mlx_agree.py caps the
MLX tests' own example counts with it). Pick one with HYPOTHESIS_PROFILE; CI sets `ci`."""

import os

from hypothesis import HealthCheck, Phase, settings

settings.register_profile("dev", max_examples=50, deadline=None)
settings.register_profile(
    "ci", max_examples=100, deadline=None, derandomize=True, suppress_health_check=[HealthCheck.too_slow]
)
settings.register_profile(
    "device", max_examples=10, deadline=None, derandomize=True, suppress_health_check=list(HealthCheck),
    phases=[Phase.explicit, Phase.reuse, Phase.generate],
)
settings.load_profile(os.environ.get("HYPOTHESIS_PROFILE", "dev"))
