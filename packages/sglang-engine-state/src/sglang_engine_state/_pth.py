"""Imported by ``sglang_engine_state.pth`` at interpreter start (site-packages only).

Must stay cheap and must never raise: it only installs the import hook, and
only when a URI is set and the kill switch is not off.
"""

try:
    from sglang_engine_state._autopatch import install

    install("pth", defer_to_plugins=True)
except Exception:  # pragma: no cover - a broken hook must not break Python
    pass
