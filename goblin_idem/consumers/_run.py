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
from typing import Any

from redis.exceptions import RedisError

from .._keys import DEFAULT_KEY_PATTERN, KeyNames, key_names
from .._log import describe
from .._recording import Records
from ..exceptions import DatabaseUnavailableError, InFlightError
from ..once import once
from ..store import Store

__all__ = ["Handler", "MessageRun", "Outcome", "Verdict", "identity"]

logger = logging.getLogger("goblin_idem.consumers")

Handler = Callable[..., Awaitable[Any]]

#: The name every consumer's `once` runs under: the scope is in the key, so two consumers
#: share keys only when they share a scope (`identity`).
NAME = "goblin_idem.consumers"
#: A handler's return value is kept up to this many bytes of JSON; a larger one is kept as
#: None (and logged), since a run whose effects happened must still be recorded.
RESULT_LIMIT = 64 * 1024


class Verdict(enum.Enum):
    ACK = "ack"
    RETRY = "retry"
    DEAD = "dead"


@dataclass(frozen=True, slots=True)
class Outcome:
    """What to tell the broker: the verdict, the handler's kept value (ACK) or why (the
    others), and whether another delivery holds the key (RETRY)."""

    verdict: Verdict
    value: Any = None
    reason: str = ""
    in_flight: bool = False


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


def failures_name(names: KeyNames) -> bytes:
    """The failure count's store key: the claim's name with ``:f`` for ``:c``, so it shares
    the claim's hash tag (one cluster slot) and namespace."""
    return names.claim[:-1] + b"f"


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
        self._once: Callable[[Any, bytes, bool], Awaitable[dict[str, Any]]] = once(
            store,
            key=lambda message, raw, redelivered: raw,
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
        outcome = await self._outcome(message, key, scope, redelivered)
        if outcome.verdict is not Verdict.ACK:
            shown = f"message {key!r:.80}" + (f" ({about})" if about else "")
            if outcome.verdict is Verdict.DEAD:
                logger.error("%s: %s to the dead letter: %s", scope, shown, outcome.reason)
            else:
                level = logging.INFO if outcome.in_flight else logging.WARNING
                logger.log(level, "%s: %s left for redelivery: %s", scope, shown, outcome.reason)
        return outcome

    async def _outcome(
        self, message: Any, key: str | bytes | int | None, scope: str, redelivered: bool
    ) -> Outcome:
        raw = identity(scope, key)
        if raw is None:
            what = "no message id" if key is None else "a malformed message id"
            return Outcome(Verdict.DEAD, reason=f"{what} (1 to 255 printable ASCII characters)")
        try:
            kept = await self._once(message, raw, redelivered)
        except InFlightError:
            return Outcome(Verdict.RETRY, reason="in flight in another delivery", in_flight=True)
        except _Failed as exc:
            error = describe(exc.__cause__ or exc)
            return Outcome(Verdict.RETRY, reason=f"the handler raised {error}")
        except Exception as exc:
            database = not isinstance(exc, RedisError) and self._database_unavailable(exc)
            where = "the records' database" if database else "the store"
            return Outcome(Verdict.RETRY, reason=f"nothing ran, {where} failed: {describe(exc)}")
        if "dead" in kept:
            return Outcome(Verdict.DEAD, reason=str(kept["dead"]))
        return Outcome(Verdict.ACK, value=kept.get("value"))

    async def _work(self, message: Any, raw: bytes, redelivered: bool) -> dict[str, Any]:
        """The run under the claim: the dead letter's verdict, or the handler's value."""
        names = key_names(self.namespace, NAME.encode(), raw)
        count, last = 0, ""
        if redelivered:
            count, last = await self._failures(names)
            if count >= self.max_deliveries:
                return {"dead": f"the handler failed {count} times; the last: {last}"}
        try:
            value = await self.handler(message)
        except Exception as exc:
            if self._database_unavailable(exc):
                raise
            if not redelivered:  # a first delivery's count was not read
                count, last = await self._failures(names)
            await self.store.set(
                failures_name(names),
                json.dumps([count + 1, describe(exc)[:1000]]).encode(),
                px=self.ttl_ms,
            )
            raise _Failed from exc
        return {"value": self._kept(value, names)}

    async def _failures(self, names: KeyNames) -> tuple[int, str]:
        data = await self.store.get(failures_name(names))
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
