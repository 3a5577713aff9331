"""Every setting of the plugin: agentic-common's `plugin_settings`, shared with SGLang.

There is no CLI: the plugin runs inside vLLM's processes, which inherit the
environment of `vllm serve`. A setting that does not parse is a SettingsError
with a message naming the variable; `register()` logs it and leaves vLLM
untouched. What stays here is what `engine_id_for`'s numbers are in vLLM.
"""

from __future__ import annotations

from agentic_common import plugin_settings
from agentic_common.plugin_settings import SETTINGS, Settings, SettingsError

__all__ = ["SETTINGS", "Settings", "SettingsError", "engine_id_for"]


def engine_id_for(worker_id: str | None, dp_index: int, dp_local_size: int) -> str:
    """The id an EngineCore publishes under (docs/design.md §4).

    `dp_index` is vLLM's data-parallel index of this engine (not
    `data_parallel_rank`, which vLLM resets to 0 in every engine of a dense
    model); `dp_local_size` is how many engines this one server runs, i.e. how
    many processes share this environment and need distinct ids.
    """
    return plugin_settings.engine_id_for(worker_id, dp_index, dp_local_size)
