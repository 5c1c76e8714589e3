"""Hypothesis profiles: `dev` (random, quick) and `ci` (derandomized, more examples).
Pick one with HYPOTHESIS_PROFILE; CI sets `ci`."""

import os

from hypothesis import HealthCheck, settings

settings.register_profile("dev", max_examples=50, deadline=None)
settings.register_profile(
    "ci", max_examples=100, deadline=None, derandomize=True, suppress_health_check=[HealthCheck.too_slow]
)
settings.load_profile(os.environ.get("HYPOTHESIS_PROFILE", "dev"))
