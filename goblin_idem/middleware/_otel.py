"""OpenTelemetry for the middleware (``otel=True``, the ``otel`` extra).

Three instruments on the ``goblin_idem`` meter, and attributes on the current span:

- ``goblin_idem.requests`` (counter, observed when metrics are collected), by
  ``goblin_idem.outcome``: the middleware's `Counters`, by field (a claimed run that failed
  counts ``claimed``, then ``released``);
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

import collections
import time
import weakref
from collections.abc import Awaitable, Callable, Iterable
from typing import Any, TypeVar, cast

try:
    from opentelemetry import metrics, trace
except ImportError as exc:  # pragma: no cover - the message is the point
    raise ImportError("otel=True needs OpenTelemetry: pip install 'goblin-idem[otel]'") from exc

from .._events import Counters
from .._lease import Watchdog
from .._version import __version__
from ..store import Store

__all__ = ["TimedStore", "instrumented"]

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


def instrumented(
    store: Store,
    on_event: Callable[[str, str], None] | None,
    counters: Counters,
    watchdog: Watchdog,
) -> tuple[Store, Callable[[str, str], None]]:
    """A middleware's store and event hook, instrumented: its store calls timed, its
    outcome set on the current span (before `on_event`, the application's own hook); its
    counters and leases observed when metrics are collected."""
    duration = _instruments()
    _counters.append(weakref.ref(counters))
    _watchdogs.add(watchdog)

    def outcome(event: str, key_hash: str) -> None:
        span = trace.get_current_span()
        if span.is_recording():
            span.set_attribute("goblin_idem.outcome", event)
            if key_hash:
                span.set_attribute("goblin_idem.key_hash", key_hash)

    timed = cast(Store, TimedStore(store, duration.record))
    if on_event is None:
        return timed, outcome
    user = on_event

    def both(event: str, key_hash: str) -> None:
        outcome(event, key_hash)
        user(event, key_hash)

    return timed, both


# The counters and watchdogs of every instrumented middleware of the process, read when
# metrics are collected, not counted again on each request (the SDK's add() costs about
# 10 us a call, which a counter the middleware keeps anyway need not pay).
_counters: list[weakref.ref[Counters]] = []  # Counters compare by value: no WeakSet
_watchdogs: weakref.WeakSet[Watchdog] = weakref.WeakSet()
_duration: list[metrics.Histogram] = []  # the one histogram, made with the first middleware


def _instruments() -> metrics.Histogram:
    if _duration:
        return _duration[0]
    meter = metrics.get_meter("goblin_idem", __version__)
    meter.create_observable_counter(
        "goblin_idem.requests",
        callbacks=[_outcomes],
        unit="{event}",
        description="What the idempotency middleware did, by outcome",
    )
    meter.create_observable_up_down_counter(
        "goblin_idem.leases",
        callbacks=[_leases],
        unit="{lease}",
        description="Leases the idempotency stores' watchdogs hold and renew",
    )
    _duration.append(
        meter.create_histogram(
            "goblin_idem.store.duration",
            unit="s",
            description="Round-trip time of the idempotency middleware's store calls",
            # round trips take from tens of microseconds to seconds, not the SDK's default
            # buckets (0 to 10000, meant for milliseconds)
            explicit_bucket_boundaries_advisory=_SECONDS,
        )
    )
    return _duration[0]


def _outcomes(options: metrics.CallbackOptions) -> Iterable[metrics.Observation]:
    totals: collections.Counter[str] = collections.Counter()
    _counters[:] = [ref for ref in _counters if ref() is not None]
    for ref in _counters:
        counters = ref()
        if counters is not None:
            totals.update(counters.as_dict())
    return [
        metrics.Observation(count, {"goblin_idem.outcome": outcome})
        for outcome, count in totals.items()
    ]


def _leases(options: metrics.CallbackOptions) -> Iterable[metrics.Observation]:
    return [metrics.Observation(sum(len(w) for w in list(_watchdogs)))]


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
