"""Every setting of the plugin: the vLLM plugin's, shared through agentic-common.

There is no CLI: the plugin runs inside SGLang's scheduler processes, which
inherit the environment of ``python -m sglang.launch_server``. The variables,
their parsing and SettingsError live in ``agentic_common.plugin_settings``, so
one deployment configures both engines the same way and a bad value is refused
the same way (the plugin logs it and leaves SGLang untouched). What stays here
is what ``engine_id_for``'s numbers are in SGLang. ``_switch`` repeats the
names and words for the ``.pth`` hook, which must not import this; a unit test
keeps them equal.
"""

from __future__ import annotations

from agentic_common import plugin_settings
from agentic_common.plugin_settings import SETTINGS, Settings, SettingsError

__all__ = ["SETTINGS", "Settings", "SettingsError", "engine_id_for"]


def engine_id_for(worker_id: str | None, dp_rank: int, dp_size: int) -> str:
    """The id a scheduler publishes under (docs/design.md §4; the vLLM plugin's rules).

    ``dp_rank`` is SGLang's data-parallel rank of this scheduler (0 without data
    parallelism); ``dp_size`` how many data-parallel engines the server runs,
    i.e. how many schedulers share this environment and need distinct ids.
    """
    return plugin_settings.engine_id_for(worker_id, dp_rank, dp_size)
