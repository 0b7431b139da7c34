"""OpenTelemetry for the middleware (``otel=True``, the ``otel`` extra).

Three instruments on the ``goblin_idem`` meter, and attributes on the current span:

- ``goblin_idem.requests`` (counter), by ``goblin_idem.outcome``: each event the middleware
  counts, named as the fields of `Counters` (a claimed run that failed counts ``claimed``,
  then ``released``);
- ``goblin_idem.store.duration`` (histogram, seconds), by ``goblin_idem.operation``
  (``claim``, ``publish``, ``release``, ``retake``, ``read``): the middleware's store
  round trips, failed ones included;
- ``goblin_idem.leases`` (up-down counter, observed when metrics are collected): the
  leases the store's watchdog holds now;
- on the span that is current when the middleware counts an event (the server span of an
  instrumented ASGI server or app): ``goblin_idem.outcome`` and ``goblin_idem.key_hash``,
  the key's hash as the logs show it, never the key.

Nothing here is imported unless asked for: with ``otel=False`` (the default) a request
costs what it costs without OpenTelemetry installed.
"""

from __future__ import annotations

import time
from collections.abc import Awaitable, Callable, Iterable
from typing import TYPE_CHECKING, Any, TypeVar, cast

try:
    from opentelemetry import metrics, trace
except ImportError as exc:  # pragma: no cover - the message is the point
    raise ImportError("otel=True needs OpenTelemetry: pip install 'goblin-idem[otel]'") from exc

from . import __version__
from .store import Store

if TYPE_CHECKING:
    from .middleware import IdempotencyMiddleware

__all__ = ["TimedStore", "instrument"]

T = TypeVar("T")
_SECONDS = [
    0.0001,
    0.00025,
    0.0005,
    0.001,
    0.0025,
    0.005,
    0.01,
    0.025,
    0.05,
    0.1,
    0.25,
    0.5,
    1.0,
    2.5,
    5.0,
]
_OPERATIONS = {
    "claim_unless_done": "claim",
    "publish": "publish",
    "cad": "release",
    "set": "retake",
    "get": "read",
}


def instrument(mw: IdempotencyMiddleware) -> None:
    """Count `mw`'s events, time its store calls and observe its leases."""
    meter = metrics.get_meter("goblin_idem", __version__)
    requests = meter.create_counter(
        "goblin_idem.requests",
        unit="{event}",
        description="What the idempotency middleware did, by outcome",
    )
    duration = meter.create_histogram(
        "goblin_idem.store.duration",
        unit="s",
        description="Round-trip time of the idempotency middleware's store calls",
        # round trips take from tens of microseconds to seconds, not the SDK's default
        # buckets (0 to 10000, meant for milliseconds)
        explicit_bucket_boundaries_advisory=_SECONDS,
    )
    watchdog = mw.watchdog

    def leases(options: metrics.CallbackOptions) -> Iterable[metrics.Observation]:
        return [metrics.Observation(len(watchdog))]

    meter.create_observable_up_down_counter(
        "goblin_idem.leases",
        callbacks=[leases],
        unit="{lease}",
        description="Leases the store's watchdog holds and renews",
    )
    outcomes: dict[str, dict[str, str]] = {}  # one attribute mapping per outcome, made once

    def on_event(event: str, key_hash: str) -> None:
        attributes = outcomes.get(event)
        if attributes is None:
            attributes = outcomes[event] = {"goblin_idem.outcome": event}
        requests.add(1, attributes)
        span = trace.get_current_span()
        if span.is_recording():
            span.set_attribute("goblin_idem.outcome", event)
            if key_hash:
                span.set_attribute("goblin_idem.key_hash", key_hash)

    user = mw.on_event
    if user is None:
        mw.on_event = on_event
    else:

        def both(event: str, key_hash: str) -> None:
            on_event(event, key_hash)
            user(event, key_hash)

        mw.on_event = both
    mw.store = cast(Store, TimedStore(mw.store, duration.record))


class TimedStore:
    """`store`, with the calls the middleware makes timed; anything else passes through
    (`wrapped` is the store itself)."""

    def __init__(self, store: Store, record: Callable[[float, dict[str, str]], None]) -> None:
        self.wrapped = store
        for method, operation in _OPERATIONS.items():
            setattr(self, method, _timed(getattr(store, method), operation, record))

    def __getattr__(self, name: str) -> Any:
        return getattr(self.wrapped, name)


def _timed(
    call: Callable[..., Awaitable[T]],
    operation: str,
    record: Callable[[float, dict[str, str]], None],
) -> Callable[..., Awaitable[T]]:
    attributes = {"goblin_idem.operation": operation}

    async def timed(*args: Any, **kwargs: Any) -> T:
        start = time.perf_counter()
        try:
            return await call(*args, **kwargs)
        finally:
            record(time.perf_counter() - start, attributes)

    return timed
