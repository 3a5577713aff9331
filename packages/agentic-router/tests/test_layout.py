"""The package's layout stays one-way: no import cycle, no oversized module.

Every import counts, including those under `if TYPE_CHECKING:`, those inside
functions and `importlib.import_module("agentic_router....")` literals: a cycle
a type checker or a lazy import hides still ties the modules into one.
"""

from __future__ import annotations

import ast
from collections.abc import Iterator
from pathlib import Path

import pytest

import agentic_router

pytestmark = pytest.mark.unit

PACKAGE = Path(agentic_router.__file__).parent
MAX_LINES = 600


def _modules() -> dict[str, Path]:
    out = {}
    for path in PACKAGE.rglob("*.py"):
        parts = list(path.relative_to(PACKAGE.parent).with_suffix("").parts)
        if parts[-1] == "__init__":
            parts = parts[:-1]
        out[".".join(parts)] = path
    return out


def _imported(module: str, path: Path, known: dict[str, Path]) -> Iterator[str]:
    """The package's modules `module` imports (by any of the means above)."""
    package = module if path.name == "__init__.py" else module.rpartition(".")[0]
    for node in ast.walk(ast.parse(path.read_text(), str(path))):
        names: list[str] = []
        if isinstance(node, ast.Import):
            names = [alias.name for alias in node.names]
        elif isinstance(node, ast.ImportFrom):
            base = node.module or ""
            if node.level:
                parent = package.split(".")[: len(package.split(".")) - (node.level - 1)]
                base = ".".join([*parent, base] if base else parent)
            names = [
                f"{base}.{a.name}" if f"{base}.{a.name}" in known else base for a in node.names
            ]
        elif (
            isinstance(node, ast.Call)
            and getattr(node.func, "attr", getattr(node.func, "id", "")) == "import_module"
            and node.args
            and isinstance(node.args[0], ast.Constant)
            and isinstance(node.args[0].value, str)
        ):
            names = [node.args[0].value]
        for imported in names:
            target = imported
            while target and target not in known:
                target = target.rpartition(".")[0]
            if target and target != module:
                yield target


def _cycle(graph: dict[str, set[str]]) -> list[str] | None:
    """One import cycle, as the list of modules around it, or None."""
    state: dict[str, int] = {}  # 1: on the current path, 2: done
    path: list[str] = []

    def visit(node: str) -> list[str] | None:
        state[node] = 1
        path.append(node)
        for nxt in sorted(graph[node]):
            if state.get(nxt) == 1:
                return [*path[path.index(nxt) :], nxt]
            if nxt not in state:
                found = visit(nxt)
                if found:
                    return found
        path.pop()
        state[node] = 2
        return None

    for node in sorted(graph):
        if node not in state:
            found = visit(node)
            if found:
                return found
    return None


def test_the_package_imports_only_downward() -> None:
    known = _modules()
    graph = {m: set(_imported(m, p, known)) for m, p in known.items()}
    assert len(known) > 40  # the walk saw the package
    assert "agentic_router.types" in graph["agentic_router.router"]  # and its imports
    cycle = _cycle(graph)
    assert cycle is None, "import cycle: " + " -> ".join(cycle or [])


def test_the_cycle_finder_finds_a_cycle() -> None:
    graph = {"a": {"b"}, "b": {"c"}, "c": {"a"}, "d": {"a"}}
    assert _cycle(graph) == ["a", "b", "c", "a"]
    assert _cycle({"a": {"b"}, "b": set()}) is None


def test_no_source_file_is_over_the_limit() -> None:
    sizes = {p: len(p.read_text().splitlines()) for p in PACKAGE.rglob("*.py")}
    over = {str(p.relative_to(PACKAGE)): n for p, n in sizes.items() if n > MAX_LINES}
    assert not over, f"modules over {MAX_LINES} lines: {over}"


def test_the_vocabulary_is_a_leaf() -> None:
    known = _modules()
    leaf = set(_imported("agentic_router.types", known["agentic_router.types"], known))
    assert leaf <= {"agentic_router.settings"}
    assert not set(_imported("agentic_router.settings", known["agentic_router.settings"], known))
