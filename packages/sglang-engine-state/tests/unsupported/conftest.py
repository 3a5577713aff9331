"""An SGLang release outside the supported range: only the CPU stubs, no harness."""

from __future__ import annotations

import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).parent.parent / "contract"))

import cpu_stubs

cpu_stubs.install()
