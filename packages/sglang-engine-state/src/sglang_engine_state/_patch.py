"""The patch: wrap SGLang's Scheduler so every publishing scheduler gets a publisher.

Owns the class-level wrappers, the guards in front of them and the registry of
live publishers. It wraps (never replaces) two methods of
``sglang.srt.managers.scheduler.Scheduler``:

- ``__init__``: after the original returns, start one publisher thread for the
  new instance, if it is the rank that speaks for its engine (SGLang runs one
  scheduler per TP/PP rank; see ``_snapshot.publishing_rank``);
- ``recv_requests``: record the wall-clock time of the step (one attribute
  store). Every SGLang event loop (normal, overlap, pipeline-parallel, P/D
  prefill and decode) calls it once per iteration, before scheduling.

It must not touch anything else in SGLang, and must not start threads or do
I/O at apply time: the plugin entry point runs in every SGLang process.
"""

from __future__ import annotations

import atexit
import contextlib
import functools
import importlib.metadata
import logging
import re
import threading
import time
import weakref
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any, Final

from agentic_common import StateWriter, redact_uri
from sglang_engine_state._prefix_cache import prefix_cache_view
from sglang_engine_state._publisher import LAST_STEP_ATTR, Publisher
from sglang_engine_state._settings import Settings, SettingsError, engine_id_for
from sglang_engine_state._snapshot import kv_tokens, publishing_rank

__all__ = [
    "INSTRUMENTOR",
    "MARKER",
    "SUPPORTED_SGLANG",
    "SUPPORTED_SGLANG_SPEC",
    "EngineStateInstrumentor",
    "UnsupportedSGLangError",
    "check_version",
    "missing_request_members",
    "missing_scheduler_members",
]

log = logging.getLogger("sglang_engine_state")

SCHEDULER_PATH: Final = "sglang.srt.managers.scheduler"
# Inclusive lower, exclusive upper: the releases the contract tests run on.
# 0.5.13 renamed the request fields (fill_len, then extend_range, then
# prefix_len/extend_end), and 0.5.16 plans batches differently.
SUPPORTED_SGLANG: Final = ((0, 5, 9), (0, 5, 13))
SUPPORTED_SGLANG_SPEC: Final = ">=0.5.9,<0.5.13"
MARKER: Final = "__agentic_engine_state__"  # set on each wrapper we install
_WRAPPED: Final = ("__init__", "recv_requests")
_MISSING = object()


class UnsupportedSGLangError(RuntimeError):
    """The installed SGLang is one this plugin refuses to patch (the message says why)."""


def parse_version(text: str) -> tuple[int, int, int] | None:
    match = re.match(r"^\s*v?(\d+)\.(\d+)\.(\d+)", text)
    if match is None:
        return None
    return int(match[1]), int(match[2]), int(match[3])


def check_version(version: str, *, allow_unsupported: bool = False) -> None:
    """Raise UnsupportedSGLangError unless ``version`` is in SUPPORTED_SGLANG (or allowed)."""
    parsed = parse_version(version)
    low, high = SUPPORTED_SGLANG
    if (parsed is None or not low <= parsed < high) and not allow_unsupported:
        raise UnsupportedSGLangError(
            f"SGLang {version} is outside the supported range {SUPPORTED_SGLANG_SPEC} "
            f"(set AGENTIC_ENGINE_STATE_ALLOW_UNSUPPORTED=1 to try it anyway)"
        )


def missing_request_members(request_cls: Any) -> list[str]:
    """What compute_snapshot reads from requests and ``Req`` does not have.

    The fields are set in ``Req.__init__``, so they are looked up among the
    names its code assigns; ``finished`` is a method.
    """
    missing: list[str] = []
    if not callable(getattr(request_cls, "finished", None)):
        missing.append("Req.finished()")
    assigned = set(getattr(getattr(request_cls.__init__, "__code__", None), "co_names", ()))
    for name in ("origin_input_ids", "output_ids", "kv_committed_len", "extra_key"):
        if name not in assigned:
            missing.append(f"Req.{name}")
    return missing


def missing_scheduler_members(scheduler: Any) -> list[str]:
    """What compute_snapshot needs from a scheduler instance and cannot find."""
    missing: list[str] = []
    for name in ("waiting_queue", "running_batch", "chunked_req", "tree_cache"):
        if not hasattr(scheduler, name):
            missing.append(name)
    if not isinstance(getattr(scheduler, "waiting_queue", None), list):
        missing.append("waiting_queue (a list)")
    if not hasattr(getattr(scheduler, "running_batch", None), "reqs"):
        missing.append("running_batch.reqs")
    if not callable(getattr(getattr(scheduler, "tree_cache", None), "evictable_size", None)):
        missing.append("tree_cache.evictable_size()")
    allocator = getattr(scheduler, "token_to_kv_pool_allocator", None)
    if not callable(getattr(allocator, "available_size", None)):
        missing.append("token_to_kv_pool_allocator.available_size()")
    if not isinstance(getattr(scheduler, "max_total_num_tokens", None), int):
        missing.append("max_total_num_tokens")
    if not missing:
        try:
            kv_tokens(scheduler)
        except Exception as exc:
            missing.append(f"KV usage ({exc!r})")
    return missing


def data_parallel_position(scheduler: Any) -> tuple[int, int]:
    """(data-parallel rank of this scheduler, data-parallel engines of the server)."""
    rank = getattr(scheduler, "dp_rank", None)
    if not isinstance(rank, int):
        rank = getattr(scheduler, "attn_dp_rank", None)  # DP attention
    size = getattr(scheduler, "dp_size", 1)
    return (rank if isinstance(rank, int) else 0), (size if isinstance(size, int) else 1)


def _installed_sglang_version() -> str | None:
    try:
        return importlib.metadata.version("sglang")
    except importlib.metadata.PackageNotFoundError:
        return None


@dataclass
class _Applied:
    cls: type
    originals: dict[str, Any]  # name -> what cls.__dict__ held (or _MISSING)
    wrappers: dict[str, Any]  # name -> the wrapper we installed
    settings: Settings
    version: str


class EngineStateInstrumentor:
    """apply() / revert() of the Scheduler patch. Both idempotent; apply is all-or-nothing.

    ``writer_factory`` opens a StateWriter for a URI (agentic_common.open_writer
    by default); tests pass their own to observe what is published.
    """

    def __init__(self, writer_factory: Callable[[str], StateWriter] | None = None) -> None:
        self.writer_factory = writer_factory
        # The hot-path wrapper's first check: False makes it a plain pass-through.
        self.active = False
        self.refusal: str | None = None  # why the last apply() declined
        self.source: str | None = None  # which path applied it (pth, plugin, api)
        self._applied: _Applied | None = None
        self._publishers: weakref.WeakKeyDictionary[Any, Publisher] = weakref.WeakKeyDictionary()
        self._lock = threading.RLock()
        self._atexit_registered = False

    def is_applied(self) -> bool:
        return self._applied is not None

    def publishers(self) -> list[Publisher]:
        with self._lock:
            return list(self._publishers.values())

    def status(self) -> dict[str, Any]:
        applied = self._applied
        return {
            "applied": applied is not None,
            "active": self.active,
            "source": self.source,
            "refusal": self.refusal,
            "sglang_version": applied.version if applied else None,
            "supported_range": SUPPORTED_SGLANG_SPEC,
            "publishers": [p.engine_id for p in self.publishers()],
        }

    def apply(
        self,
        settings: Settings | None = None,
        scheduler_cls: type | None = None,
        *,
        source: str = "api",
    ) -> bool:
        """Patch the Scheduler class. True if patched (now or before), False if refused.

        A refusal (unsupported version, missing member, bad settings) logs one
        line per reason and leaves SGLang exactly as it was; nothing raises.
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
                    version = _installed_sglang_version() or "not installed"
                    check_version(version, allow_unsupported=settings.allow_unsupported)
                    module = __import__(SCHEDULER_PATH, fromlist=["Scheduler"])
                    scheduler_cls = module.Scheduler
                    from sglang.srt.managers.schedule_batch import Req

                    missing = missing_request_members(Req)
                    if missing:
                        raise UnsupportedSGLangError(
                            f"sglang.srt.managers.schedule_batch lacks {', '.join(missing)}"
                        )
                assert scheduler_cls is not None
                for name in _WRAPPED:
                    if not callable(getattr(scheduler_cls, name, None)):
                        raise UnsupportedSGLangError(f"{scheduler_cls.__qualname__}.{name} missing")
                    if getattr(getattr(scheduler_cls, name), MARKER, False):
                        raise UnsupportedSGLangError(
                            f"{scheduler_cls.__qualname__}.{name} is already wrapped by another "
                            "copy of this plugin"
                        )
            except Exception as exc:  # a refusal, whatever went wrong: SGLang stays as it was
                reason = str(exc) or repr(exc)
                if reason != self.refusal:  # one line per process and reason
                    log.warning("sglang-engine-state: not patching SGLang: %s", reason)
                self.refusal = reason
                return False
            originals = {name: scheduler_cls.__dict__.get(name, _MISSING) for name in _WRAPPED}
            installed: dict[str, Any] = {}
            try:
                for name in _WRAPPED:
                    target = getattr(scheduler_cls, name)
                    wrapper = (
                        self._wrap_init(target) if name == "__init__" else _wrap_step(self, target)
                    )
                    setattr(scheduler_cls, name, wrapper)
                    installed[name] = wrapper
            except Exception as exc:  # all-or-nothing
                for name in installed:
                    self._restore(scheduler_cls, name, originals[name])
                self.refusal = f"patching failed: {exc!r}"
                log.warning("sglang-engine-state: not patching SGLang: %s", self.refusal)
                return False
            self._applied = _Applied(scheduler_cls, originals, installed, settings, version)
            self.active = True
            self.refusal = None
            self.source = source
            if not self._atexit_registered:
                atexit.register(self.stop_all)
                self._atexit_registered = True
            log.info(
                "sglang-engine-state: patched %s.%s (SGLang %s, via %s); publishing to %s "
                "every %g ms",
                scheduler_cls.__module__,
                scheduler_cls.__qualname__,
                version,
                source,
                redact_uri(settings.uri or ""),
                settings.period_s * 1000,
            )
            return True

    def revert(self) -> None:
        """Restore the Scheduler class exactly and stop every publisher. Idempotent."""
        with self._lock:
            applied, self._applied = self._applied, None
            self.active = False
            self.source = None
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
                    "sglang-engine-state: %s.%s was wrapped again after us; left in place, "
                    "our part of it is now a pass-through",
                    applied.cls.__qualname__,
                    name,
                )
        for scheduler, publisher in publishers:
            publisher.stop("revert()")
            with contextlib.suppress(AttributeError):
                delattr(scheduler, LAST_STEP_ATTR)
        log.info("sglang-engine-state: reverted; %d publisher(s) stopped", len(publishers))

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

    def _wrap_init(self, original: Callable[..., Any]) -> Callable[..., Any]:
        @functools.wraps(original)
        def __init__(self_: Any, *args: Any, **kwargs: Any) -> None:
            original(self_, *args, **kwargs)
            if not self.active:
                return
            try:
                self.on_scheduler_init(self_)
            except Exception as exc:
                log.warning("sglang-engine-state: not publishing for this scheduler: %r", exc)

        setattr(__init__, MARKER, True)
        return __init__

    def on_scheduler_init(self, scheduler: Any) -> Publisher | None:
        """Start the publisher of a scheduler that was just built (what ``__init__`` runs)."""
        applied = self._applied
        if applied is None or applied.settings.uri is None:
            return None
        with self._lock:
            if scheduler in self._publishers:
                return self._publishers[scheduler]  # a subclass running __init__ twice
        if not publishing_rank(scheduler):
            return None  # another rank of this engine publishes for it
        missing = missing_scheduler_members(scheduler)
        if missing:
            log.warning(
                "sglang-engine-state: %s lacks %s; not publishing (SGLang is unaffected)",
                type(scheduler).__qualname__,
                ", ".join(missing),
            )
            return None
        dp_rank, dp_size = data_parallel_position(scheduler)
        engine_id = engine_id_for(applied.settings.worker_id, dp_rank, dp_size)
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
        view = prefix_cache_view(scheduler.tree_cache)
        log.info(
            "sglang-engine-state: %s publishes as %r every %g ms; queued requests: %s",
            type(scheduler).__qualname__,
            engine_id,
            applied.settings.period_s * 1000,
            view.reason if view.exact else f"no prefix-cache credit ({view.reason})",
        )
        return publisher


def _wrap_step(
    instrumentor: EngineStateInstrumentor, original: Callable[..., Any]
) -> Callable[..., Any]:
    now = time.time

    @functools.wraps(original)
    def recv_requests(self_: Any, *args: Any, **kwargs: Any) -> Any:
        if instrumentor.active:
            try:
                # Only schedulers with a publisher carry the attribute (set when
                # it starts), so revert() can remove every trace of us.
                state = self_.__dict__
                if LAST_STEP_ATTR in state:
                    state[LAST_STEP_ATTR] = now()
            except Exception as exc:
                log.debug("sglang-engine-state: step hook failed: %r", exc)
        return original(self_, *args, **kwargs)

    setattr(recv_requests, MARKER, True)
    return recv_requests


INSTRUMENTOR: Final = EngineStateInstrumentor()
