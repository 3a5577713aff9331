"""Engines in virtual time, trace replay and the analysers.

`agentic_router.sim` replays a trace through the real `Router` (the same
policies and `InstanceState` as the HTTP proxy) onto simulated engines whose
timing comes from published measurements (`_model.py` names each source).
The `replay`, `demo`, `bench` and `analyze` subcommands live here too.
"""

from agentic_router.sim._config import RunResult, SimConfig, Topology
from agentic_router.sim._engine import SimEngine
from agentic_router.sim._model import CostModel, EngineConfig, HardwareProfile, ModelProfile
from agentic_router.sim._request import EngineMetricsSample, SimRequest
from agentic_router.sim._sim import Simulation, run_matrix, run_one
from agentic_router.sim._trace import (
    AgenticParams,
    Trace,
    TraceError,
    TraceRequest,
    bundled_trace,
    generate_agentic,
    load_trace,
    read_azure_csv,
    read_mooncake,
    write_mooncake,
)

__all__ = [
    "AgenticParams",
    "CostModel",
    "EngineConfig",
    "EngineMetricsSample",
    "HardwareProfile",
    "ModelProfile",
    "RunResult",
    "SimConfig",
    "SimEngine",
    "SimRequest",
    "Simulation",
    "Topology",
    "Trace",
    "TraceError",
    "TraceRequest",
    "bundled_trace",
    "generate_agentic",
    "load_trace",
    "read_azure_csv",
    "read_mooncake",
    "run_matrix",
    "run_one",
    "write_mooncake",
]
