"""Which requests the middleware covers, and with which settings.

The middleware's options give the defaults and the path patterns (`include`, `exclude`,
`required_paths`); an endpoint marked with `@idempotent` overrides them for its route. The
mark is found the way the router finds the endpoint, so a request meets the policy of the
route that serves it, and the OpenAPI document (middleware/_openapi.py) says the same. A framework
that routes by its own means (Flask's URL map, Django's resolver) resolves the endpoint
itself and hands the middleware its mark in the scope (`RESOLVED_POLICY`, `policy_of`).

Whether a request is taken at all is decided here, once, for every front door on HTTP (the
ASGI middleware, the WSGI and Flask adapter, Django's middleware): `Routes.may_cover`
before the request's scope is made, then `Routes.covering` with it. A sync adapter decides
in the request's thread and hands its answer to the ASGI middleware in the scope
(`COVERED`), which then takes it as decided.
"""

from __future__ import annotations

import fnmatch
import functools
import logging
import math
import sys
from collections.abc import Callable, Iterable, Sequence
from dataclasses import dataclass, field, replace
from typing import Any, TypeVar, overload

from starlette.routing import Match
from starlette.types import Scope

from . import _options as options
from . import _outcome
from ._outcome import Outcome, OutcomeOption
from ._provider import Provider

__all__ = [
    "COVERED",
    "RESOLVED_POLICY",
    "RoutePolicy",
    "Routes",
    "Settings",
    "idempotent",
    "mark_endpoint",
    "marked_endpoints",
    "policy_of",
]

logger = logging.getLogger("goblin_idem.middleware")

F = TypeVar("F", bound=Callable[..., Any])
_POLICY_ATTR = "__goblin_idem__"

#: The scope key of the mark (a RoutePolicy, or None for none) of the endpoint that the
#: framework serving the request resolved by its own router; the middleware then takes it
#: instead of asking the ASGI app's routes.
RESOLVED_POLICY = "goblin_idem.route_policy"

#: The scope key of the `Settings` of a request a sync adapter has decided to take
#: (`Routes.covering`, made in the request's thread): the middleware does not decide again.
COVERED = "goblin_idem.settings"

# How many endpoints @idempotent has marked in this process. While none has, no request
# needs its route looked up, so a request without a key passes with a header scan only;
# counted at decoration, so a route added after the first request is seen as well.
marked_endpoints = 0


@dataclass(frozen=True, slots=True)
class RoutePolicy:
    """Per-route settings; None means "as the middleware is configured"."""

    enabled: bool = True
    required: bool | None = None
    ttl_seconds: float | None = None
    lease_seconds: float | None = None
    outcome: OutcomeOption = None
    statuses: Outcome | None = field(default=None, init=False, repr=False, compare=False)
    # A webhook route (goblin_idem.webhooks.webhook): the provider that verifies each
    # delivery and names its key, before the claim step.
    webhook: Provider | None = None

    def __post_init__(self) -> None:
        if self.outcome is not None:  # the table, computed once (_outcome)
            table = _outcome.table("@idempotent(outcome=...)", self.outcome)
            object.__setattr__(self, "statuses", table)
        if self.webhook is not None:
            check_provider("webhook(provider)", self.webhook)
        options.flag("@idempotent(enabled=...)", self.enabled)
        if self.required is not None:
            options.flag("@idempotent(required=...)", self.required)
        for name in ("ttl_seconds", "lease_seconds"):
            value = getattr(self, name)
            if value is not None:
                options.seconds(f"@idempotent({name}=...)", value, minimum=1)


@overload
def idempotent(func: F, /) -> F: ...


@overload
def idempotent(
    *,
    enabled: bool = True,
    required: bool | None = None,
    ttl_seconds: float | None = None,
    lease_seconds: float | None = None,
    outcome: OutcomeOption = None,
) -> Callable[[F], F]: ...


def idempotent(
    func: F | None = None,
    /,
    *,
    enabled: bool = True,
    required: bool | None = None,
    ttl_seconds: float | None = None,
    lease_seconds: float | None = None,
    outcome: OutcomeOption = None,
) -> F | Callable[[F], F]:
    """Mark a Starlette/FastAPI endpoint with its own idempotency settings.

    Put it under the route decorator (``@app.post(...)`` then ``@idempotent(required=True)``).
    The middleware finds the route the request will reach and applies its policy;
    ``enabled=False`` exempts the route; ``outcome=`` says which statuses of its responses
    are stored and replayed (the middleware's option, for this route).
    """
    if func is not None and not callable(func):
        raise TypeError(
            "idempotent takes keyword arguments only, as in @idempotent(required=True); "
            f"got a {type(func).__name__} as its first argument"
        )
    policy = RoutePolicy(enabled, required, ttl_seconds, lease_seconds, outcome)

    def mark(f: F) -> F:
        return mark_endpoint(f, policy)

    return mark(func) if func is not None else mark


@dataclass(frozen=True, slots=True)
class Settings:
    """What applies to one covered request, in the store's units: the claim's lease in
    whole seconds (GOBLIN.CLAIM's EX, rounded up; the watchdog's first renewal, at a third
    of the lease, makes it exact), the lease and the result's TTL in ms; which statuses are
    stored (`_outcome`)."""

    required: bool
    ttl_ms: int
    lease_ms: int
    claim_seconds: int
    outcome: Outcome
    webhook: Provider | None = None  # verified and keyed by the provider, not a key header

    @classmethod
    def of(
        cls, required: bool, ttl_seconds: float, lease_seconds: float, outcome: Outcome
    ) -> Settings:
        return cls(
            required,
            round(ttl_seconds * 1000),
            round(lease_seconds * 1000),
            math.ceil(lease_seconds),
            outcome,
        )


class Routes:
    """The settings of each request: None for a request the middleware does not cover."""

    def __init__(
        self,
        defaults: Settings,
        include: tuple[str, ...] | None,
        exclude: tuple[str, ...],
        required_paths: tuple[str, ...],
        webhooks: dict[str, Provider] | None = None,
    ) -> None:
        self.defaults = defaults
        self.webhooks = webhooks or {}
        self.include = include
        self.exclude = exclude
        self.required_paths = required_paths
        # Can a request without a key be refused (400) by the options? Route marks are
        # looked up for each request while any endpoint is marked (marked_endpoints).
        self.may_require = defaults.required or bool(required_paths) or bool(self.webhooks)
        self._for_path = functools.lru_cache(maxsize=4096)(self._settings_for_path)
        self._hidden_warned = False  # logged that a route hides its endpoint
        # The app the middleware wraps: its routes are the marks' when the middleware wraps
        # a Starlette or FastAPI app from outside, before the app put itself in the scope.
        self.wrapped: object = None

    @classmethod
    def from_options(
        cls,
        *,
        required: bool,
        ttl_seconds: float,
        lease_seconds: float,
        include: Sequence[str] | None,
        exclude: Sequence[str],
        required_paths: Sequence[str],
        outcome: OutcomeOption = None,
        store_server_errors: bool = False,
        webhooks: dict[str, Provider] | None = None,
    ) -> Routes:
        """The middleware's options, checked (a wrong one raises, naming it)."""
        lease = options.seconds("lease_seconds", lease_seconds, minimum=1)
        ttl = options.seconds("ttl_seconds", ttl_seconds, minimum=1)
        server_errors = options.flag("store_server_errors", store_server_errors)
        statuses = _outcome.table("outcome", outcome, server_errors)
        return cls(
            Settings.of(options.flag("required", required), ttl, lease, statuses),
            options.patterns("include", include) if include is not None else None,
            options.patterns("exclude", exclude),
            options.patterns("required_paths", required_paths),
            webhook_paths(webhooks),
        )

    def may_cover(self, keyed: bool, marked: bool) -> bool:
        """Whether a request of a covered method can be taken at all, told before its scope
        is made: it has a key, its endpoint's mark is to be looked up (`marked`), or the
        options can require a key (a required route, a webhook path). False, the common
        case, sends it to the app at once."""
        return keyed or marked or self.may_require

    def covering(self, scope: Scope, keyed: bool) -> Settings | None:
        """The settings of a request the middleware takes: a webhook delivery, a request
        with a key, or one without on a route that requires a key (answered 400); None for
        a request that goes to the app as it is. A sync adapter's decision, made in the
        request's thread, is taken as it stands (`COVERED`)."""
        settings: Settings | None = scope.get(COVERED) or self.settings(scope)
        if settings is None or keyed or settings.required or settings.webhook is not None:
            return settings
        return None

    def settings(self, scope: Scope) -> Settings | None:
        settings = self._for_path(scope["path"])
        policy = self._policy(scope) if marked_endpoints else None
        if policy is None:
            return settings
        if not policy.enabled:
            return None
        base = settings or self.defaults
        ttl, lease = policy.ttl_seconds, policy.lease_seconds
        return Settings(
            base.required if policy.required is None else policy.required,
            base.ttl_ms if ttl is None else round(ttl * 1000),
            base.lease_ms if lease is None else round(lease * 1000),
            base.claim_seconds if lease is None else math.ceil(lease),
            base.outcome if policy.statuses is None else policy.statuses,
            base.webhook if policy.webhook is None else policy.webhook,
        )

    def _policy(self, scope: Scope) -> RoutePolicy | None:
        """The mark of the endpoint that will serve the request, if it has one."""
        if RESOLVED_POLICY in scope:
            resolved: RoutePolicy | None = scope[RESOLVED_POLICY]
            return resolved
        routes = getattr(scope.get("app", self.wrapped), "routes", None)
        if not routes:
            return None
        try:
            return _route_policy(routes, dict(scope))  # a copy: matching must change nothing
        except _EndpointHidden as exc:
            self._warn_hidden(exc.args[0])
            return None

    def _settings_for_path(self, path: str) -> Settings | None:
        provider = self.webhooks.get(path)
        if provider is not None:  # named by its exact path: include and exclude do not apply
            return replace(self.defaults, webhook=provider)

        def any_match(patterns: Sequence[str]) -> bool:
            return any(fnmatch.fnmatchcase(path, p) for p in patterns)

        if self.include is not None and not any_match(self.include):
            return None
        if any_match(self.exclude):
            return None
        if any_match(self.required_paths):
            return replace(self.defaults, required=True)
        return self.defaults

    def _warn_hidden(self, route: str) -> None:
        if self._hidden_warned:
            return
        self._hidden_warned = True
        logger.warning(
            "the route %r matched a request but does not say which endpoint it "
            "serves, so the @idempotent marks behind it are not applied (the "
            "middleware's own options are); FastAPI 0.137.0 and 0.137.1 do this for "
            "included routers: upgrade FastAPI",
            route,
        )


def policy_of(*candidates: object) -> RoutePolicy | None:
    """The mark of the first candidate that has one: for a framework's own resolver, the
    handler of the request's method first, then the view, then the view's class."""
    for candidate in candidates:
        policy = getattr(candidate, _POLICY_ATTR, None)
        if isinstance(policy, RoutePolicy):
            return policy
    return None


def mark_endpoint(func: F, policy: RoutePolicy) -> F:
    """`func` marked with `policy`, and counted (marked_endpoints)."""
    global marked_endpoints
    setattr(func, _POLICY_ATTR, policy)
    marked_endpoints += 1
    return func


def check_provider(name: str, provider: object) -> None:
    """A webhook provider: a `name`, the `headers` it reads and a `verify` method."""
    if not isinstance(provider, Provider) or not callable(provider.verify):
        raise TypeError(
            f"{name} takes a webhook provider (goblin_idem.webhooks: StandardWebhooks, "
            f"Stripe, GitHub, Shopify, or a Provider of your own), not a {type(provider).__name__}"
        )


def webhook_paths(webhooks: object) -> dict[str, Provider]:
    """The middleware's `webhooks` option: exact request paths, each with its provider."""
    if webhooks is None:
        return {}
    if not isinstance(webhooks, dict):
        raise TypeError(
            "webhooks must be a dict of request paths to providers, as in "
            f"webhooks={{'/hooks/github': GitHub(secrets=[...])}}, not {type(webhooks).__name__}"
        )
    for path, provider in webhooks.items():
        if not isinstance(path, str) or not path.startswith("/"):
            raise ValueError(
                f"webhooks: a path is an exact request path starting with '/', not {path!r}"
            )
        check_provider(f"webhooks[{path!r}]", provider)
    return dict(webhooks)


class _EndpointHidden(Exception):
    """A route matched but named no endpoint, and no public way lists what it routes to."""


def _route_policy(
    routes: Iterable[Any], scope: Scope, listed_from: Any = None
) -> RoutePolicy | None:
    """The policy of the endpoint the router will pick for this request, found the way the
    router finds it: each route's `matches(scope)`, in order, and the endpoint that the
    first full match's child scope names. A Mount (or Host) names the mounted app, whose
    routes are asked in turn with the child scope merged in, as the router hands it on.
    An included router of FastAPI >= 0.137 matches for its routes but keeps their child
    scope to itself; FastAPI's public `iter_route_contexts` lists those routes with the
    include prefixes applied, each answering `matches` the same way."""
    for route in routes:
        match, child = route.matches(scope)
        if match is not Match.FULL:
            continue
        if "endpoint" not in child:
            if listed_from is not None:  # its listing names no endpoint either
                raise _EndpointHidden(type(listed_from).__name__)
            return _route_policy(_included_routes(route), scope, route)
        endpoint = child["endpoint"]
        policy: RoutePolicy | None = getattr(endpoint, _POLICY_ATTR, None)
        if policy is not None:
            return policy
        inner = getattr(endpoint, "routes", None)
        return _route_policy(inner, {**scope, **child}) if inner else None
    return None


def _included_routes(route: Any) -> Iterable[Any]:
    # A route object of FastAPI's is there only if FastAPI is imported: no import here.
    expand = getattr(sys.modules.get("fastapi.routing"), "iter_route_contexts", None)
    if expand is None:
        raise _EndpointHidden(type(route).__name__)
    contexts: Iterable[Any] = expand([route])
    return contexts
