"""Hypothesis settings for the router's tests.

CI is a shared 2-core machine: property tests assert invariants, never speed,
so neither a per-example deadline nor the "input generation is slow" health
check may fail a run there (seen once in a full CI run).
"""

from hypothesis import HealthCheck, settings

settings.register_profile(
    "agentic-router",
    deadline=None,
    suppress_health_check=[HealthCheck.too_slow],
)
settings.load_profile("agentic-router")
