"""`agentic-router serve`: the OpenAI-compatible HTTP proxy in front of vLLM / SGLang.

`create_app(config, plugin_manager)` builds the aiohttp application (tests
run it on a real socket); `ServerConfig` holds every setting, and
`load_config(args)` merges flags, AGENTIC_* environment variables and a YAML
file. See README.md ("serve") for the endpoints, the session headers and the
P/D modes.
"""

from agentic_router.server._app import PROXY, create_app
from agentic_router.server._config import ServerConfig, load_config
from agentic_router.server._files import ConfigError

__all__ = ["PROXY", "ConfigError", "ServerConfig", "create_app", "load_config"]
