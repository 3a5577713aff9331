"""``python -m sglang_session_fix.launch_server <sglang.launch_server arguments>``.

For SGLang without a plugin system (0.5.10 and the forks based on it) when the
``.pth`` hook is not wanted or site-packages is skipped (``python -S``). The
hook is installed at module import: under ``spawn`` every child re-imports the
parent's main module (as ``__mp_main__``), so scheduler processes get it too.
"""

from __future__ import annotations

import runpy

from sglang_session_fix._autopatch import install

install("launcher", defer_to_plugins=False)


def main() -> None:
    # alter_sys=False keeps this module as sys.modules["__main__"]: spawn children
    # re-import *it* (as __mp_main__), and so install the hook. With True they
    # would re-import sglang.launch_server instead and run unpatched.
    runpy.run_module("sglang.launch_server", run_name="__main__", alter_sys=False)


if __name__ == "__main__":
    main()
