"""Test tools for the proxy: fake vLLM / SGLang servers speaking the real protocols,
and a helper that runs the proxy on a loopback socket."""

from agentic_router.server.testing._fake_engine import FakeEngine, Faults, refused_url
from agentic_router.server.testing._running import RunningRouter, running_router

__all__ = ["FakeEngine", "Faults", "RunningRouter", "refused_url", "running_router"]
