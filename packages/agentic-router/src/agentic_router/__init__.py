"""agentic-router: routes agentic sessions across vLLM / SGLang engines on real engine state."""

from agentic_router.decision import CandidateScore, Decision
from agentic_router.feed import StateFeed
from agentic_router.instance import InstanceState
from agentic_router.plugins import make_plugin_manager
from agentic_router.request import build_routing_request
from agentic_router.router import Router
from agentic_router.types import RouterConfig, RoutingRequest

__all__ = [
    "CandidateScore",
    "Decision",
    "InstanceState",
    "Router",
    "RouterConfig",
    "RoutingRequest",
    "StateFeed",
    "build_routing_request",
    "make_plugin_manager",
]
