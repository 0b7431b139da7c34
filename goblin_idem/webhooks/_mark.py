"""`webhook(provider)`: the route mark of a webhook receiver, an `idempotent` mark whose key
the provider takes from what its signature covers, verified before the claim step."""

from __future__ import annotations

from collections.abc import Callable
from typing import Any, TypeVar

from .. import _routes
from .._outcome import OutcomeOption
from .._provider import Provider

__all__ = ["webhook"]

F = TypeVar("F", bound=Callable[..., Any])


def webhook(
    provider: Provider,
    *,
    ttl_seconds: float | None = None,
    lease_seconds: float | None = None,
    outcome: OutcomeOption = None,
) -> Callable[[F], F]:
    """Mark an endpoint as the receiver of `provider`'s webhooks.

    Put it under the route decorator. Each delivery is verified on its raw body before
    anything is claimed (401 or 400 otherwise, nothing stored, the endpoint not run), then
    runs once per delivery (its signed id, or its signed body where the provider signs no
    id): a redelivery, re-signed or not, gets the stored answer. The
    Flask, Django and WSGI adapters read the same mark on their views. The options are
    `idempotent`'s, for this route.
    """
    policy = _routes.RoutePolicy(
        ttl_seconds=ttl_seconds, lease_seconds=lease_seconds, outcome=outcome, webhook=provider
    )

    def mark(func: F) -> F:
        if not callable(func):
            raise TypeError(f"webhook(...) marks an endpoint, not a {type(func).__name__}")
        return _routes.mark_endpoint(func, policy)

    return mark
