"""The router's plugin hooks (pluggy project name ``agentic_router``).

Every built-in scorer, filter and policy is registered through these same
hooks (see `agentic_router.builtin`); there is no private path. Third-party
plugins expose a module or object implementing some of them under the
entry-point group ``agentic_router`` (see docs/plugin-hooks.md and the example
under docs/examples/).

`agentic_router_options` declares the router options (plugin knobs) a plugin
reads, so a misspelt one is refused at start-up instead of ignored.
Registration hooks (`agentic_router_scorers`, `agentic_router_filters`,
`agentic_router_policies`) are called once per Router, when it is built, so a
plugin may return fresh, stateful objects for each Router. Observation hooks
(`agentic_router_decision`, `agentic_router_event`) are called on the routing
path: they must be cheap and must not block; an exception in one is logged and
swallowed, never raised into a request.

This module must not import anything heavy; it only declares signatures.
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from typing import TYPE_CHECKING, Any

import pluggy

if TYPE_CHECKING:
    from agentic_router.decision import Decision
    from agentic_router.policy import Filter, PolicySpec, RouterView, Scorer
    from agentic_router.types import RouterConfig, RouterEvent, RouterOption, RoutingRequest

PROJECT = "agentic_router"
hookspec = pluggy.HookspecMarker(PROJECT)
hookimpl = pluggy.HookimplMarker(PROJECT)


@hookspec
def agentic_router_scorers(config: RouterConfig) -> Sequence[Scorer]:
    """Register scorers.

    When: once per Router, while it is being built.
    Args: ``config`` - the Router's RouterConfig (read plugin knobs from
    ``config.extra``).
    Returns: a sequence of Scorer objects (``name``, ``description``,
    ``score(ctx) -> Sequence[float]``: one cost per candidate, lower is better).
    Names must be unique across all plugins; a duplicate name is an error at
    build time. A scorer that raises while scoring is logged and skipped for
    that request (counted in ``Router.plugin_errors``).
    firstresult: no - every plugin's scorers are collected.
    """
    raise NotImplementedError


@hookspec
def agentic_router_filters(config: RouterConfig) -> Sequence[Filter]:
    """Register candidate filters.

    When: once per Router, while it is being built.
    Args: ``config`` - the Router's RouterConfig.
    Returns: a sequence of Filter objects (``name``, ``description``,
    ``keep(ctx) -> Sequence[bool]``: one flag per candidate). A filter that
    would drop every candidate is ignored for that request; one that raises is
    logged and skipped.
    firstresult: no - every plugin's filters are collected.
    """
    raise NotImplementedError


@hookspec
def agentic_router_policies(config: RouterConfig) -> Sequence[PolicySpec]:
    """Register routing policies (the names accepted by ``--policy``).

    When: once per Router, while it is being built.
    Args: ``config`` - the Router's RouterConfig.
    Returns: a sequence of PolicySpec: a name, filters (by name), weighted
    scorers (by name), tie-break features, and optionally a decode-worker
    selector factory (P/D and Mechanism B policies). Names must be unique.
    firstresult: no - every plugin's policies are collected.
    """
    raise NotImplementedError


@hookspec
def agentic_router_options() -> Sequence[RouterOption]:
    """Declare the router options this plugin reads from ``config.extra``.

    When: once when ``serve`` builds its routing core (to check every
    ``--router-option``, its environment twin ``AGENTIC_ROUTER_OPTIONS`` and
    the YAML ``router_options`` key), and by ``agentic-router plugins``.
    Args: none.
    Returns: a sequence of RouterOption (``name``, ``kind``: bool / int / float
    / str, ``default``, ``help``). A given value is converted to ``kind``
    before it reaches ``config.extra``; a bad one fails start-up naming the
    option. A name that is also a RouterConfig setting, or declared by another
    plugin with another kind, is an error.
    A plugin that does not implement this hook declares nothing: options it
    reads must be given namespaced by its plugin (entry-point) name,
    ``<plugin>.<knob>``, and reach ``config.extra`` under that full key, with
    a warning at start-up. Any other unknown option fails start-up with the
    known names.
    firstresult: no - every plugin's options are collected.
    """
    raise NotImplementedError


@hookspec
def agentic_router_decision(
    router: RouterView, request: RoutingRequest, decision: Decision
) -> None:
    """Observe a routing decision (logging, metrics, learning).

    When: after every ``Router.decide``, before it returns, synchronously.
    Args: the Router, the RoutingRequest, the Decision (``decision.to_log()``
    gives the JSON record with each candidate's score parts and real fields).
    Returns: nothing (return values are ignored). Must be cheap; an exception
    is logged and swallowed.
    firstresult: no - every implementation is called.
    """
    raise NotImplementedError


@hookspec
def agentic_router_event(router: RouterView, event: RouterEvent) -> None:
    """Observe a sequence-state event or a feedback report.

    When: after the write model applied ``add_request`` (kind ``"add"``),
    ``mark_prefill_completed`` (``"prefill_completed"``), ``free``
    (``"free"``), or after ``Router.notify(kind, ...)`` (any other kind, e.g.
    ``"admission"`` from a P/D proxy). A worker joining or leaving at run time
    is ``"worker_added"`` / ``"worker_retired"`` (``worker`` set, no request):
    a policy keeping per-worker state may drop a retired worker's, whose slot
    is never reused. Duplicate and unknown events are not reported.
    Args: the Router and a RouterEvent (kind, request_id, worker, session_id,
    ts, payload mapping).
    Returns: nothing. Must be cheap; an exception is logged and swallowed.
    firstresult: no - every implementation is called.
    """
    raise NotImplementedError


@hookspec(firstresult=True)
def agentic_router_tokenize(body: Mapping[str, Any], config: RouterConfig) -> Sequence[int] | None:
    """Turn a request body into token ids (prefix identity and prompt length).

    When: by ``build_routing_request`` (used by the proxy) for every request
    whose body carries no token ids, before falling back to text chunks.
    Args: ``body`` - the OpenAI request body (chat ``messages`` or completion
    ``prompt``); ``config`` - the RouterConfig.
    Returns: the prompt's token ids, or None to let the next plugin (or the
    text-chunk fallback) decide. The core hashes them into chained blocks.
    firstresult: yes - the first non-None result wins.
    """
    raise NotImplementedError
