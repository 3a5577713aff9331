pytest_plugins = ["agentic_common.testing"]
