"""The kill switch, readable at interpreter start-up for the price of one dict lookup.

Kept apart from ``_settings`` so the ``.pth`` hook imports nothing but ``os``.
"""

from __future__ import annotations

import os
from collections.abc import Mapping

__all__ = ["ENV_ENABLED", "FALSE_WORDS", "TRUE_WORDS", "kill_switch_engaged"]

ENV_ENABLED = "SGLANG_SESSION_FIX"
TRUE_WORDS = frozenset({"1", "true", "on", "yes"})
FALSE_WORDS = frozenset({"0", "false", "off", "no"})


def kill_switch_engaged(environ: Mapping[str, str] = os.environ) -> bool:
    """True when ``SGLANG_SESSION_FIX`` turns the fix off (any false-like value)."""
    return environ.get(ENV_ENABLED, "1").strip().lower() in FALSE_WORDS
