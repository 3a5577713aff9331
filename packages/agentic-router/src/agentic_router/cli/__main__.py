"""`python -m agentic_router.cli ...`: the same as the `agentic-router` command."""

import sys

from agentic_router.cli import main

sys.exit(main())
