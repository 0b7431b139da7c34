"""What both server interceptors share: the options, one run per method, and the answers.

A keyed call is one run of `once`'s core (`_Once.call`, under the key names and the
fingerprint `_identity` gives): the claim step, the lease and its watchdog, the handler run
under `current_claim()`, the outcome rule (`kept`), the records' transaction, the publish or
the release. The interceptors only translate: the call's key, scope and fingerprint in; the
handler's ending as an `Outcome` (`_context`), stored by `OutcomeCodec`; and the core's
answers back into gRPC's statuses:

- in flight (InFlightError): ABORTED, ``retry-after`` (whole seconds) in the trailers;
- key reused (KeyReusedError): FAILED_PRECONDITION;
- a malformed key: INVALID_ARGUMENT; an unreadable stored outcome: INTERNAL;
- the store (or the records' database) unavailable before the handler ran: UNAVAILABLE,
  the handler not run (fail closed, as HTTP's 503);
- a replay: the first call's status, details, trailing metadata and response bytes, plus
  ``idempotent-replayed: true``; one too large to have been kept: ALREADY_EXISTS.
"""

from __future__ import annotations

import asyncio
import logging
import math
from collections.abc import Callable, Collection
from typing import Any

import grpc

from .. import _options as options
from .._claim_step import ClaimStep
from .._events import Counters, Events, log_store_error
from .._keys import KeyNames
from .._lease import Watchdog
from .._log import describe
from .._recording import Records
from .._run import Core
from ..exceptions import DatabaseUnavailableError, InFlightError, KeyReusedError, RecordError
from ..once._once import POLL_SECONDS, _Once
from ..records._sealing import Sealer
from ..store import Store
from ._identity import Identity, Refused
from ._outcome import Outcome, OutcomeCodec, kept_codes

__all__ = ["REPLAYED", "Door", "Keyed"]

logger = logging.getLogger("goblin_idem.grpc")

REPLAYED = ("idempotent-replayed", "true")
_CODEC = OutcomeCodec()


class Keyed:
    """One keyed call: its key names and fingerprint, and whether its handler started (an
    error before it is the store's, after it the handler's own)."""

    __slots__ = ("door", "fp", "method", "names", "ran")

    def __init__(self, door: Door, method: str, names: KeyNames, fp: bytes) -> None:
        self.door, self.method, self.names, self.fp = door, method, names, fp
        self.ran = False

    def started(self) -> None:
        self.ran = True
        self.door.events("claimed", self.names.hash)

    def ended(self, outcome: Outcome) -> Outcome:
        """The handler's outcome, counted (too_large) if it is kept without its responses."""
        if not outcome.replayable and self.door.kept(outcome):
            self.door.events("too_large", self.names.hash)
        return outcome

    def answered(self, outcome: Outcome) -> Outcome | None:
        """What the call answers, given the run's value: None for the handler's own
        outcome (it ran here), else the replay a duplicate gets."""
        return None if self.ran else self.door.replay(outcome, self.names, self.method)


class Door:
    """The options of one interceptor, checked once; the runs of its methods."""

    def __init__(
        self,
        store: Store,
        *,
        records: Records | None,
        key_field: str,
        key_metadata: str,
        methods: Collection[str] | None,
        ttl_seconds: float,
        lease_seconds: float,
        outcome: Callable[[grpc.StatusCode], bool] | Collection[grpc.StatusCode] | None,
        scope: Callable[[Any], bytes | str] | None,
        wait_seconds: float,
        retry_after_seconds: float,
        max_response_bytes: int,
        namespace: str,
        encryption_keys: Any,
        require_sealed: bool,
        on_event: Callable[[str, str], None] | None,
    ) -> None:
        self.store = options.store(store)
        if not isinstance(key_field, str) or not key_field.isidentifier():
            raise TypeError(
                f"key_field must name a message field, as 'request_id', not {key_field!r}"
            )
        self.identity = Identity(
            options.namespace(namespace),
            key_field,
            options.http_tokens("key_metadata", [key_metadata], "metadata name")[0].lower(),
            options.callable_or_none(
                "scope", scope, "a function of the call's context returning the caller's identity"
            ),
        )
        self.methods = _methods(methods)
        self.codes = kept_codes(outcome)
        self.ttl_ms = round(options.seconds("ttl_seconds", ttl_seconds, minimum=1) * 1000)
        lease = options.seconds("lease_seconds", lease_seconds, minimum=1)
        self.lease_ms, self.claim_seconds = round(lease * 1000), math.ceil(lease)
        self.wait_seconds, _ = options.polling(wait_seconds, POLL_SECONDS)
        retry_after = options.seconds("retry_after_seconds", retry_after_seconds, minimum=0)
        self.retry_after = str(math.ceil(retry_after))
        self.max_response_bytes = options.whole_number(
            "max_response_bytes", max_response_bytes, minimum=0
        )
        self.sealer: Sealer | None = options.sealer(encryption_keys)
        self.require_sealed = options.require_sealed(require_sealed, self.sealer)
        self.records = options.records(records)
        self.counters = Counters()
        self.events = Events(
            self.counters,
            options.callable_or_none(
                "on_event", on_event, "a function (event, key_hash) called on every count"
            ),
        )
        self.watchdog = Watchdog.for_store(self.store)
        # The runs' core: its events (released, lease_lost, ...) counted as HTTP's.
        self.core = Core(self.store, self.watchdog, self.events, self.records)
        self.claim_step = ClaimStep(self.store, self.wait_seconds, POLL_SECONDS, self.records)
        self._runs: dict[str, _Once] = {}
        self.warned: set[str] = set()  # the stream-stream methods already warned about

    def covers(self, method: str) -> bool:
        return self.methods is None or method in self.methods

    def run(self, method: str, func: Callable[..., Any]) -> _Once:
        """The method's run: its log lines name the method (built at its first call)."""
        run = self._runs.get(method)
        if run is None:
            run = self._runs[method] = _Once(
                self.core,
                func,
                _named_by_the_door,
                method.encode(),
                self.identity.namespace,
                _CODEC,
                self.ttl_ms,
                self.lease_ms,
                self.claim_seconds,
                self.sealer,
                self.require_sealed,
                self.claim_step,
                None,  # the fingerprint is the door's (`Identity.fingerprint`)
                kept=self.kept,
            )
        return run

    def kept(self, outcome: Outcome) -> bool:
        """The outcome rule: a finished call whose status says what it did."""
        return outcome.finished and outcome.code in self.codes

    def warn_streams(self, method: str) -> None:
        if method not in self.warned:
            self.warned.add(method)
            logger.warning(
                "%s is a bidirectional streaming method: its calls pass through without "
                "idempotency (only unary responses and one-way streams are kept and "
                "replayed). Logged once.",
                method,
            )

    def replay(self, outcome: Outcome, names: KeyNames, method: str) -> Outcome:
        """A stored outcome as a duplicate gets it."""
        self.events("replayed", names.hash)
        if not outcome.replayable:
            self.events("not_replayable", names.hash)
            return Outcome(
                grpc.StatusCode.ALREADY_EXISTS,
                f"the call to {method} with this request id completed, but its response "
                "was too large to keep, so it cannot be replayed",
                (REPLAYED,),
            )
        return Outcome(
            outcome.code,
            outcome.details,
            (*outcome.trailing, REPLAYED),
            outcome.messages,
        )

    def keyed(self, method: str, requests: list[Any], context: Any) -> Keyed | Outcome | None:
        """The call's key names and fingerprint; INVALID_ARGUMENT for a key that cannot be
        used; None for a call without a key."""
        metadata = context.invocation_metadata() or ()
        try:
            key = self.identity.key(requests, metadata)
            if key is None:
                return None
            names = self.identity.names(method, key, context, metadata)
        except Refused as exc:
            self.events("invalid_key")
            return Outcome(grpc.StatusCode.INVALID_ARGUMENT, str(exc))
        return Keyed(self, method, names, self.identity.fingerprint(requests))

    def failed(self, exc: BaseException, keyed: Keyed) -> Outcome | None:
        """The answer to an error of `keyed`'s run; None for the handler's own errors (and
        cancellations), which the caller raises again for gRPC to answer as it does."""
        names, method = keyed.names, keyed.method
        if isinstance(exc, InFlightError):
            self.events("in_flight", names.hash)
            return Outcome(
                grpc.StatusCode.ABORTED,
                f"the first call to {method} with this request id is still running; retry "
                f"after {self.retry_after} s",
                (("retry-after", self.retry_after),),
            )
        if isinstance(exc, KeyReusedError):
            self.events("mismatch", names.hash)
            return Outcome(
                grpc.StatusCode.FAILED_PRECONDITION,
                f"key reused: this request id was first used with another request to {method}; "
                "nothing ran. Use a new request id for other work",
            )
        if isinstance(exc, RecordError):
            self.events("unreadable", names.hash)
            logger.error("key %s: the stored outcome cannot be read: %s", names.hash, exc)
            return Outcome(
                grpc.StatusCode.INTERNAL, "the stored outcome of this request id cannot be read"
            )
        if isinstance(exc, DatabaseUnavailableError) and not keyed.ran:
            self.events("database_errors", names.hash)
            logger.error("key %s: %s, answering UNAVAILABLE", names.hash, describe(exc))
            return Outcome(
                grpc.StatusCode.UNAVAILABLE,
                "the records' database is unavailable; the call was not run",
            )
        if keyed.ran or not isinstance(exc, Exception) or isinstance(exc, asyncio.CancelledError):
            return None
        self.events("store_errors", names.hash)
        log_store_error(
            self.store,
            logging.ERROR,
            exc,
            f"store error for key %s of {method}, answering UNAVAILABLE",
            names.hash,
        )
        return Outcome(
            grpc.StatusCode.UNAVAILABLE,
            "the idempotency store is unavailable; the call was not run",
        )


def _named_by_the_door(*args: Any, **kwargs: Any) -> str:  # pragma: no cover - never called
    raise AssertionError("a gRPC call's key names come from its request (`Identity`)")


def _methods(value: object) -> frozenset[str] | None:
    if value is None:
        return None
    if isinstance(value, (str, bytes)) or not isinstance(value, Collection):
        raise TypeError(
            "methods must be a collection of full method names ('/pkg.Service/Method'), "
            f"not {type(value).__name__}"
        )
    bad = [m for m in value if not isinstance(m, str) or m.count("/") != 2 or m[:1] != "/"]
    if bad:
        raise ValueError(
            f"methods must be full method names, as '/pkg.Service/Method', not {bad[0]!r}"
        )
    return frozenset(value)
