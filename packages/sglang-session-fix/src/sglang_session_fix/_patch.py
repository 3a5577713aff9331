"""The patch object: guards, wrappers, apply/revert.

Owns the two wrappers put on SGLang classes, ``ScheduleBatch.prepare_for_extend``
and ``Scheduler._get_new_batch_prefill_raw``, and the checks made before either
is touched: the installed SGLang version, the capabilities we rely on, and a
fingerprint of each wrapped method's source. It must not change anything when
a check fails, and must not import SGLang before ``apply()`` is called.
"""

from __future__ import annotations

import functools
import hashlib
import importlib.metadata
import inspect
import logging
import re
import textwrap
import threading
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any

from ._core import AllRequestsDeferred, BatchScreener
from ._events import EVENT_LIFECYCLE, Counters, emit, logger
from ._settings import Settings, SettingsError

__all__ = [
    "KNOWN_FINGERPRINTS",
    "MARKER_ATTR",
    "PATCH",
    "SUPPORTED_RANGE",
    "ApplyResult",
    "SessionFixPatch",
    "fingerprint",
]

MIN_VERSION = (0, 5, 9)
MAX_VERSION_EXCLUSIVE = (0, 5, 13)
SUPPORTED_RANGE = ">=0.5.9,<0.5.13"

MARKER_ATTR = "__sglang_session_fix_original__"
"""Set on each wrapper; holds the upstream function it wraps."""

BATCH_METHOD = "ScheduleBatch.prepare_for_extend"
SCHEDULER_METHOD = "Scheduler._get_new_batch_prefill_raw"

# sha256 of the dedented source, first 16 hex digits. A release that changes
# one of these methods refuses the patch until the new source is reviewed.
KNOWN_FINGERPRINTS: dict[str, dict[str, str]] = {
    BATCH_METHOD: {
        "53c7298846772cba": "0.5.9",
        "37eff7010693192f": "0.5.10",
        "8df7e7d039d475e1": "0.5.11, 0.5.12",
    },
    SCHEDULER_METHOD: {
        "8a1841c29de577b7": "0.5.9",
        "26c3baf3c23dbb80": "0.5.10",
        "fdbb6ac5e74d9763": "0.5.11",
        "9b8d4924498cc63b": "0.5.12",
    },
}


def fingerprint(func: Callable[..., Any]) -> str:
    """First 16 hex digits of the sha256 of ``func``'s dedented source."""
    source = textwrap.dedent(inspect.getsource(func))
    return hashlib.sha256(source.encode()).hexdigest()[:16]


def parse_version(text: str) -> tuple[int, int, int] | None:
    match = re.match(r"(\d+)\.(\d+)\.(\d+)", text)
    if match is None:
        return None
    major, minor, micro = (int(part) for part in match.groups())
    return major, minor, micro


@dataclass(frozen=True)
class ApplyResult:
    applied: bool
    reason: str
    sglang_version: str | None = None
    fingerprints: dict[str, str] = field(default_factory=dict)


class _Declined(Exception):
    def __init__(self, reason: str, **details: Any) -> None:
        super().__init__(reason)
        self.reason = reason
        self.details = details


class SessionFixPatch:
    """Keeps zero-extend requests out of SGLang's ``prepare_for_extend``.

    ``apply()`` and ``revert()`` are idempotent and thread-safe; ``apply()``
    changes both methods or neither.
    """

    def __init__(self) -> None:
        self.counters = Counters()
        self._lock = threading.RLock()
        self._context = threading.local()
        self._settings = Settings()
        self._screener = BatchScreener(self._settings, self.counters, {})
        self._originals: dict[str, tuple[type, str, Callable[..., Any]]] = {}
        self._applied = False
        self._enabled = True
        self._source: str | None = None
        self._last_result: ApplyResult | None = None

    # -- public surface ----------------------------------------------------------

    @property
    def active(self) -> bool:
        """Read first by every wrapper: applied and not switched off at run time."""
        return self._applied and self._enabled

    def is_applied(self) -> bool:
        with self._lock:
            if not self._applied:
                return False
            return all(
                getattr(getattr(owner, name), MARKER_ATTR, None) is original
                for owner, name, original in self._originals.values()
            )

    def set_enabled(self, enabled: bool) -> None:
        """Run-time kill switch: off, both wrappers call upstream and nothing else."""
        if enabled == self._enabled:
            return
        self._enabled = enabled
        emit(EVENT_LIFECYCLE, logging.WARNING, action="enabled" if enabled else "disabled")

    def stats(self) -> dict[str, int]:
        return self.counters.snapshot()

    def status(self) -> dict[str, Any]:
        result = self._last_result
        return {
            "applied": self.is_applied(),
            "enabled": self._enabled,
            "source": self._source,
            "reason": result.reason if result else None,
            "sglang_version": result.sglang_version if result else None,
            "fingerprints": dict(result.fingerprints) if result else {},
            "action": self._settings.action.value,
            "max_defers": self._settings.max_defers,
            "supported_range": SUPPORTED_RANGE,
        }

    def apply(self, source: str = "api") -> ApplyResult:
        with self._lock:
            if self._applied:
                return self._last_result or ApplyResult(True, "already applied")
            try:
                result = self._apply_locked(source)
            except _Declined as declined:
                result = ApplyResult(
                    False,
                    declined.reason,
                    declined.details.get("sglang_version"),
                    declined.details.get("fingerprints", {}),
                )
                previous = self._last_result
                self._last_result = result
                if previous is None or previous.reason != result.reason:
                    # One line per process and reason, however often we are asked.
                    emit(
                        EVENT_LIFECYCLE,
                        logging.WARNING,
                        action="declined",
                        source=source,
                        supported_range=SUPPORTED_RANGE,
                        **declined.details,
                        reason=declined.reason,
                    )
                return result
            self._last_result = result
            return result

    def revert(self) -> bool:
        """Put upstream back. True if something was reverted."""
        with self._lock:
            if not self._applied:
                return False
            for owner, name, original in self._originals.values():
                current = owner.__dict__.get(name)
                if getattr(current, MARKER_ATTR, None) is original:
                    setattr(owner, name, original)
                # else: someone wrapped on top of us; our wrapper stays in their
                # chain but is inert because ``active`` is now False.
            self._originals.clear()
            self._applied = False
            self._last_result = None
            emit(EVENT_LIFECYCLE, logging.INFO, action="reverted")
            return True

    # -- apply -------------------------------------------------------------------

    def _apply_locked(self, source: str) -> ApplyResult:
        try:
            settings = Settings.from_env()
        except SettingsError as err:
            raise _Declined(f"bad setting: {err}") from None
        if not settings.enabled:
            raise _Declined("disabled by SGLANG_SESSION_FIX=0")

        version = _installed_sglang_version()
        if version is None:
            raise _Declined("sglang is not installed")
        parsed = parse_version(version)
        if parsed is None or not MIN_VERSION <= parsed < MAX_VERSION_EXCLUSIVE:
            raise _Declined("unsupported sglang version", sglang_version=version)

        try:
            from sglang.srt.managers.schedule_batch import ScheduleBatch
            from sglang.srt.managers.scheduler import Scheduler
        except Exception as err:
            raise _Declined(f"cannot import the sglang scheduler: {err!r}") from None
        if self._applied and self._last_result is not None:
            # Importing the scheduler just now let the import hook apply it.
            return self._last_result

        targets = {
            BATCH_METHOD: (ScheduleBatch, "prepare_for_extend"),
            SCHEDULER_METHOD: (Scheduler, "_get_new_batch_prefill_raw"),
        }
        originals: dict[str, Callable[..., Any]] = {}
        for label, (owner, name) in targets.items():
            func = owner.__dict__.get(name)
            if not callable(func):
                raise _Declined(f"missing capability {label}", sglang_version=version)
            if getattr(func, MARKER_ATTR, None) is not None:
                raise _Declined(f"{label} is already wrapped by another copy of this fix")
            originals[label] = func
        _check_capabilities(ScheduleBatch, Scheduler, version)

        fingerprints: dict[str, str] = {}
        for label, func in originals.items():
            try:
                fingerprints[label] = fingerprint(func)
            except (OSError, TypeError):
                raise _Declined(f"no source for {label}", sglang_version=version) from None
        unknown = {
            label: fp
            for label, fp in fingerprints.items()
            if fp not in KNOWN_FINGERPRINTS[label] and fp not in settings.trusted_fingerprints
        }
        if unknown:
            raise _Declined(
                "unknown fingerprint of a wrapped method (review it, then trust it with "
                "SGLANG_SESSION_FIX_TRUSTED_FINGERPRINTS)",
                sglang_version=version,
                fingerprints=fingerprints,
                unknown=unknown,
            )

        wrappers = {
            BATCH_METHOD: self._wrap_prepare_for_extend(originals[BATCH_METHOD]),
            SCHEDULER_METHOD: self._wrap_scheduler_entry(originals[SCHEDULER_METHOD]),
        }
        self._settings = settings
        self._screener = BatchScreener(settings, self.counters, {"sglang_version": version})
        done: list[str] = []
        try:
            for label, (owner, name) in targets.items():
                setattr(owner, name, wrappers[label])
                done.append(label)
        except Exception:
            for label in done:
                owner, name = targets[label]
                setattr(owner, name, originals[label])
            raise
        self._originals = {
            label: (owner, name, originals[label]) for label, (owner, name) in targets.items()
        }
        self._applied = True
        self._enabled = True
        self._source = source
        emit(
            EVENT_LIFECYCLE,
            logging.INFO,
            action="applied",
            source=source,
            sglang_version=version,
            fingerprints=fingerprints,
            fix_action=settings.action.value,
            max_defers=settings.max_defers,
        )
        return ApplyResult(True, "applied", version, fingerprints)

    # -- wrappers ----------------------------------------------------------------

    def _wrap_prepare_for_extend(self, original: Callable[..., Any]) -> Callable[..., Any]:
        patch = self

        @functools.wraps(original)
        def prepare_for_extend(batch: Any, *args: Any, **kwargs: Any) -> Any:
            if not patch.active:
                return original(batch, *args, **kwargs)
            all_deferred = False
            try:
                scheduler = getattr(patch._context, "scheduler", None)
                all_deferred = patch._screener.screen(batch, scheduler)
            except Exception:
                patch.counters.inc("internal_errors")
                logger.exception("sglang_session_fix: screening failed; batch left as it was")
            if all_deferred:
                raise AllRequestsDeferred
            return original(batch, *args, **kwargs)

        setattr(prepare_for_extend, MARKER_ATTR, original)
        return prepare_for_extend

    def _wrap_scheduler_entry(self, original: Callable[..., Any]) -> Callable[..., Any]:
        patch = self

        @functools.wraps(original)
        def _get_new_batch_prefill_raw(scheduler: Any, *args: Any, **kwargs: Any) -> Any:
            if not patch.active:
                return original(scheduler, *args, **kwargs)
            # Lets prepare_for_extend find the queue to put requests back into.
            previous = getattr(patch._context, "scheduler", None)
            patch._context.scheduler = scheduler
            try:
                return original(scheduler, *args, **kwargs)
            except AllRequestsDeferred:
                # Only our own signal is caught: every request went back to the
                # queue before any allocation, so this round has no prefill batch.
                return None
            finally:
                patch._context.scheduler = previous

        setattr(_get_new_batch_prefill_raw, MARKER_ATTR, original)
        return _get_new_batch_prefill_raw


def _installed_sglang_version() -> str | None:
    try:
        return importlib.metadata.version("sglang")
    except importlib.metadata.PackageNotFoundError:
        return None


def _check_capabilities(schedule_batch: type, scheduler: type, version: str) -> None:
    """Everything the fix reads or calls beyond the two wrapped methods."""
    from sglang.srt.managers.schedule_batch import Req

    params = list(inspect.signature(schedule_batch.__dict__["prepare_for_extend"]).parameters)
    if params != ["self"]:
        raise _Declined("prepare_for_extend takes arguments", sglang_version=version)
    entry = scheduler.__dict__.get("get_new_batch_prefill")
    if entry is None or list(inspect.signature(entry).parameters) != ["self"]:
        # From 0.5.16 the scheduler plans batches (NextBatchPlan): not this API.
        raise _Declined("get_new_batch_prefill is not (self) -> batch", sglang_version=version)
    for needed in ("set_finish_with_abort", "init_next_round_input"):
        if not callable(getattr(Req, needed, None)):
            raise _Declined(f"missing capability Req.{needed}", sglang_version=version)


PATCH = SessionFixPatch()
"""The one patch object of this process."""
