"""Route marks (`@idempotent`) found by a sync framework's own router, for the ASGI
middleware's route lookup.

The request's thread resolves the endpoint the way its framework will (Flask's URL map,
Django's resolver) and puts the endpoint's policy in the scope; the scope's app is then
`RESOLVED`, whose one route matches with an endpoint that carries that policy, which is
what the ASGI middleware's lookup reads (Starlette's route protocol: `matches(scope)`).
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any, TypeAlias

from starlette.routing import Match
from starlette.types import Scope

from .._routes import RoutePolicy

__all__ = ["RESOLVED", "PolicyOf", "policy_of"]

PolicyOf: TypeAlias = Callable[[dict[str, Any]], RoutePolicy | None]
_POLICY_ATTR = "__goblin_idem__"


def policy_of(*candidates: object) -> RoutePolicy | None:
    """The mark of the first candidate that has one (a view, then its class, then the
    class's handler for the request's method)."""
    for candidate in candidates:
        policy = getattr(candidate, _POLICY_ATTR, None)
        if isinstance(policy, RoutePolicy):
            return policy
    return None


class _Marked:
    __slots__ = ("__goblin_idem__",)

    def __init__(self, policy: RoutePolicy) -> None:
        self.__goblin_idem__ = policy


class _Resolved:
    """The app of a scope whose policy was resolved in the request's thread."""

    key = "goblin_idem.policy"

    def __init__(self) -> None:
        self.routes = [self]

    def matches(self, scope: Scope) -> tuple[Match, Scope]:
        policy = scope.get(self.key)
        if policy is None:
            return Match.NONE, {}
        return Match.FULL, {"endpoint": _Marked(policy)}


RESOLVED = _Resolved()
