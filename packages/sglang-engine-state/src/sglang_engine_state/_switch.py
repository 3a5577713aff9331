"""Whether the plugin should do anything at all, for the price of two dict lookups.

Kept apart from ``_settings`` so the ``.pth`` hook, which runs at every
interpreter start, imports nothing but ``os``. The names are the same as the
vLLM plugin's: one engine-state feed, whichever engine publishes to it.
"""

from __future__ import annotations

import os
from collections.abc import Mapping

__all__ = ["ENV_ENABLED", "ENV_URI", "FALSE_WORDS", "TRUE_WORDS", "wanted"]

ENV_URI = "AGENTIC_ENGINE_STATE_URI"
ENV_ENABLED = "AGENTIC_ENGINE_STATE_ENABLED"
TRUE_WORDS = frozenset({"1", "true", "on", "yes"})
FALSE_WORDS = frozenset({"0", "false", "off", "no"})


def wanted(environ: Mapping[str, str] = os.environ) -> bool:
    """A URI is set and the kill switch is not off (a bad value is judged later, loudly)."""
    if not environ.get(ENV_URI, "").strip():
        return False
    return environ.get(ENV_ENABLED, "1").strip().lower() not in FALSE_WORDS
