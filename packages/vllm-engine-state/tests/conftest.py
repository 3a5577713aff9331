from __future__ import annotations

import sys
from pathlib import Path

pytest_plugins = ["agentic_common.testing"]

# The fakes live beside the tests; make them importable from every tier.
sys.path.insert(0, str(Path(__file__).parent))
