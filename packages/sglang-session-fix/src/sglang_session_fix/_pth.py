"""Imported by ``sglang_session_fix.pth`` at interpreter start (site-packages only).

Must stay cheap and must never raise: it only installs the import hook.
"""

try:
    from ._autopatch import install

    install("pth", defer_to_plugins=True)
except Exception:  # pragma: no cover - a broken hook must not break Python
    pass
