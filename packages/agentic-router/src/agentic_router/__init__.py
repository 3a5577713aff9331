"""agentic-router: routes agentic sessions across vLLM / SGLang engines on real engine state."""

__all__: list[str] = []
