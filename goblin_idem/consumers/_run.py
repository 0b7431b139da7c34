"""One broker message's run, on `once`: what every consumer shares, broker-neutral.

A message becomes a `once` call keyed by (scope, message id); the consumer only says what
the outcome means to its broker:

- ACK: the work is done and kept (now, or by an earlier delivery: the stored value is
  returned without running). With records, the run's transaction committed first.
- RETRY: nothing is kept; the broker must deliver the message again (nack with a delay,
  or leave it pending). Said for a key in flight in another delivery (which acks it when
  it ends; this delivery is not counted), for a handler that raised (counted), and for a
  store or records' database that is unavailable (nothing ran; not counted).
- DEAD: the message is given to the dead letter and acked, never run: it has no id or a
  malformed one, or its handler failed `max_deliveries` times (the reason names the last
  error). Stored like a result, so a redelivery of a dead message is dead-lettered again
  rather than run (a dead letter may then hold it twice: it is at least once).

The failures of a key are counted in the store beside its claim (``<ns>:{hash}:f``: the
count and the last error, with the result's TTL), written only while this delivery holds
the claim, so no two deliveries count at once. The count is read only when the broker says
the message is a redelivery: a first delivery costs no round trip more than `once`.
Broker-side delivery counts are not used: Redis counts a delivery that found the key in
flight, RabbitMQ keeps a boolean, and NATS stops at its own `max_deliver`.
"""

from __future__ import annotations

import enum
import json
import logging
from collections.abc import Awaitable, Callable
from dataclasses import dataclass
from typing import Any, Literal

from redis.exceptions import RedisError

from .._keys import DEFAULT_KEY_PATTERN, KeyNames, failures_key, key_names
from .._log import describe
from .._recording import Records
from ..exceptions import DatabaseUnavailableError, InFlightError
from ..once import once
from ..store import Store

__all__ = ["Event", "Handler", "MessageRun", "OnEvent", "Outcome", "Verdict", "identity"]

logger = logging.getLogger("goblin_idem.consumers")

Handler = Callable[..., Awaitable[Any]]

#: The name every consumer's `once` runs under: the scope is in the key, so two consumers
#: share keys only when they share a scope (`identity`).
NAME = "goblin_idem.consumers"
#: A handler's return value is kept up to this many bytes of JSON; a larger one is kept as
#: None (and logged), since a run whose effects happened must still be recorded.
RESULT_LIMIT = 64 * 1024


class Verdict(enum.Enum):
    """What the adapter tells the broker: ack, put back for a retry, or dead-letter."""

    ACK = "ack"
    RETRY = "retry"
    DEAD = "dead"


#: What a delivery came to, told to `on_event(event, key_hash)`: the middleware's names where
#: the outcome is the same (a run, a replay, a key in flight, a handler that raised, the store
#: or database unavailable, a missing or malformed key), and the dead letter's own.
Event = Literal[
    "claimed",
    "replayed",
    "in_flight",
    "released",
    "store_errors",
    "database_errors",
    "missing_key",
    "invalid_key",
    "dead_lettered",
]
OnEvent = Callable[[str, str], None]


@dataclass(frozen=True, slots=True)
class Outcome:
    """What to tell the broker: the verdict, the handler's kept value (ACK) or why (the
    others), and what it came to (`Event`)."""

    verdict: Verdict
    event: Event
    value: Any = None
    reason: str = ""

    @property
    def in_flight(self) -> bool:
        return self.event == "in_flight"


@dataclass(slots=True)
class _Delivery:
    """One delivery's names, and whether its handler ran (a fresh run, not a replay)."""

    names: KeyNames
    ran: bool = False


class _Failed(Exception):
    """The handler raised (its error is the cause); counted, nothing kept."""


def identity(scope: str, key: str | bytes | int | None) -> bytes | None:
    """The raw `once` key of message id `key` in `scope` (length-prefixed, so no scope and
    id pair spells another's); None for an id that is missing or malformed (1 to 255
    printable ASCII characters, as HTTP keys)."""
    if key is None or isinstance(key, bool):
        return None
    raw = (
        key.encode() if isinstance(key, str) else str(key).encode() if isinstance(key, int) else key
    )
    if not isinstance(raw, bytes) or DEFAULT_KEY_PATTERN.fullmatch(raw) is None:
        return None
    tag = scope.encode()
    return len(tag).to_bytes(4, "big") + tag + raw


def checked_options(key: object, requeue_delay_seconds: object) -> float:
    """The requeue delay in seconds, once `key` (None, or a function of the message
    returning its id) and the delay are checked: a decorator's options, refused at import."""
    if key is not None and not callable(key):
        raise TypeError("key must be a function of the message returning its id")
    if isinstance(requeue_delay_seconds, bool) or not isinstance(
        requeue_delay_seconds, (int, float)
    ):
        raise TypeError("requeue_delay_seconds must be a number of seconds")
    if not 0 <= requeue_delay_seconds < float("inf"):
        raise ValueError(
            f"requeue_delay_seconds must be >= 0 and finite, got {requeue_delay_seconds}"
        )
    return float(requeue_delay_seconds)


class MessageRun:
    """Built once per consumer; called once per delivery."""

    def __init__(
        self,
        store: Store,
        handler: Handler,
        *,
        records: Records | None,
        max_deliveries: int,
        lease_seconds: float,
        ttl_seconds: float,
        namespace: str,
        on_event: OnEvent | None = None,
    ) -> None:
        if not callable(handler):
            raise TypeError(f"handler must be an async function, not {type(handler).__name__}")
        if isinstance(max_deliveries, bool) or not isinstance(max_deliveries, int):
            raise TypeError("max_deliveries must be an int (the failed runs a message may have)")
        if max_deliveries < 1:
            raise ValueError(f"max_deliveries must be >= 1, got {max_deliveries}")
        self.store = store
        self.handler = handler
        self.records = records
        self.max_deliveries = max_deliveries
        self.lease_seconds = float(lease_seconds)
        self.ttl_ms = round(ttl_seconds * 1000)
        self.namespace = namespace.encode()
        if on_event is not None and not callable(on_event):
            raise TypeError("on_event must be a function of (event, key_hash)")
        self.on_event = on_event
        self._once: Callable[[Any, bytes, bool, _Delivery], Awaitable[dict[str, Any]]] = once(
            store,
            key=lambda message, raw, redelivered, delivery: raw,
            ttl_seconds=ttl_seconds,
            lease_seconds=lease_seconds,
            namespace=namespace,
            name=NAME,
            records=records,
            fingerprint=False,  # the message is the delivery, not the request: any copy replays
        )(self._work)

    async def __call__(
        self,
        message: Any,
        key: str | bytes | int | None,
        scope: str,
        *,
        redelivered: bool,
        about: str = "",
    ) -> Outcome:
        """The outcome of one delivery of `message` (id `key`, in `scope`; `about` names
        the delivery in the broker's terms), logged here, the one place; never raises but
        for a cancellation."""
        outcome, key_hash = await self._outcome(message, key, scope, redelivered)
        if self.on_event is not None:
            try:
                self.on_event(outcome.event, key_hash)
            except Exception:  # a metrics hook must never fail a delivery
                logger.exception("on_event hook failed")
        if outcome.verdict is not Verdict.ACK:
            # the id as the producer wrote it (Streams' fields are bytes), and the hash that
            # `inspect --hash` and `forget --hash` take
            text = key.decode("latin-1") if isinstance(key, bytes) else key
            shown = f"message {text!r:.80}" + (f" (key hash {key_hash})" if key_hash else "")
            shown += f" ({about})" if about else ""
            if outcome.verdict is Verdict.DEAD:
                logger.error("%s: %s to the dead letter: %s", scope, shown, outcome.reason)
            else:
                level = logging.INFO if outcome.in_flight else logging.WARNING
                logger.log(level, "%s: %s left for redelivery: %s", scope, shown, outcome.reason)
        return outcome

    async def _outcome(
        self, message: Any, key: str | bytes | int | None, scope: str, redelivered: bool
    ) -> tuple[Outcome, str]:
        """The outcome, and the key's hash (empty without a key)."""
        raw = identity(scope, key)
        if raw is None:
            if key is None:
                return Outcome(Verdict.DEAD, "missing_key", reason="no message id"), ""
            why = "a malformed message id (1 to 255 printable ASCII characters)"
            return Outcome(Verdict.DEAD, "invalid_key", reason=why), ""
        delivery = _Delivery(key_names(self.namespace, NAME.encode(), raw))
        return await self._claimed(message, raw, redelivered, delivery), delivery.names.hash

    async def _claimed(
        self, message: Any, raw: bytes, redelivered: bool, delivery: _Delivery
    ) -> Outcome:
        try:
            kept = await self._once(message, raw, redelivered, delivery)
        except InFlightError:
            return Outcome(Verdict.RETRY, "in_flight", reason="in flight in another delivery")
        except _Failed as exc:
            error = describe(exc.__cause__ or exc)
            return Outcome(Verdict.RETRY, "released", reason=f"the handler raised {error}")
        except Exception as exc:
            if not isinstance(exc, RedisError) and self._database_unavailable(exc):
                why = f"nothing ran, the records' database failed: {describe(exc)}"
                return Outcome(Verdict.RETRY, "database_errors", reason=why)
            why = f"nothing ran, the store failed: {describe(exc)}"
            return Outcome(Verdict.RETRY, "store_errors", reason=why)
        if "dead" in kept:
            return Outcome(Verdict.DEAD, "dead_lettered", reason=str(kept["dead"]))
        return Outcome(Verdict.ACK, "claimed" if delivery.ran else "replayed", kept.get("value"))

    async def _work(
        self, message: Any, raw: bytes, redelivered: bool, delivery: _Delivery
    ) -> dict[str, Any]:
        """The run under the claim: the dead letter's verdict, or the handler's value."""
        names = delivery.names
        count, last = 0, ""
        if redelivered:
            count, last = await self._failures(names)
            if count >= self.max_deliveries:
                return {"dead": f"the handler failed {count} times; the last: {last}"}
        delivery.ran = True
        try:
            value = await self.handler(message)
        except Exception as exc:
            if self._database_unavailable(exc):
                raise
            if not redelivered:  # a first delivery's count was not read
                count, last = await self._failures(names)
            await self.store.set(
                failures_key(names),
                json.dumps([count + 1, describe(exc)[:1000]]).encode(),
                px=self.ttl_ms,
            )
            raise _Failed from exc
        return {"value": self._kept(value, names)}

    async def _failures(self, names: KeyNames) -> tuple[int, str]:
        data = await self.store.get(failures_key(names))
        if data is None:
            return 0, ""
        try:
            count, last = json.loads(data)
            return int(count), str(last)
        except (ValueError, TypeError):
            return 0, ""  # not a count this version wrote: counted again from zero

    def _database_unavailable(self, exc: Exception) -> bool:
        """Whether the handler's error is the records' database unavailable (not counted:
        the message waits for the database, as a request gets 503)."""
        if isinstance(exc, DatabaseUnavailableError):
            return True
        return self.records is not None and self.records.transaction().unavailable(exc) is not None

    def _kept(self, value: Any, names: KeyNames) -> Any:
        """The value to store: the handler's, if it is JSON of at most RESULT_LIMIT bytes;
        else None, logged (its effects happened and are recorded either way)."""
        try:
            size = len(json.dumps(value, allow_nan=False, separators=(",", ":")))
        except (TypeError, ValueError) as exc:
            logger.warning("key %s: the handler's value is not kept (%s)", names.hash, exc)
            return None
        if size > RESULT_LIMIT:
            logger.warning(
                "key %s: the handler's value (%d bytes of JSON) is over %d and not kept",
                names.hash,
                size,
                RESULT_LIMIT,
            )
            return None
        return value
