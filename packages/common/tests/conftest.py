"""Shared test setup: the real redis-server fixtures, and Hypothesis settings
for a shared 2-core CI machine (property tests assert invariants, never speed)."""

from hypothesis import HealthCheck, settings

pytest_plugins = ["agentic_common.testing"]

settings.register_profile(
    "agentic-common",
    deadline=None,
    suppress_health_check=[HealthCheck.too_slow],
)
settings.load_profile("agentic-common")
