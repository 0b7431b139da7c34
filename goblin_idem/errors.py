"""Exceptions and the exact reply texts of the GOBLIN command spec.

Store errors are `redis.exceptions.ResponseError` whatever the store, so one `except`
clause serves MemoryStore and RedisStore in every mode, and the texts are the ones a
Goblin server replies (redis-py strips the leading ``ERR `` as it does for any server).
"""

from __future__ import annotations

import os

from redis.exceptions import NoPermissionError, RedisError, ResponseError

__all__ = [
    "NOT_INTEGER",
    "VALUE_TOO_LARGE",
    "WRONGTYPE",
    "ClaimLostError",
    "GoblinError",
    "InFlightError",
    "LockError",
    "LockNotOwnedError",
    "NotReplicatedError",
    "ResponseError",
    "StorePermissionError",
    "describe",
    "invalid_expire",
]

WRONGTYPE = "WRONGTYPE Operation against a key holding the wrong kind of value"
NOT_INTEGER = "value is not an integer or out of range"
VALUE_TOO_LARGE = (
    "new cannot fit the configured value encoding (larger values belong in a blob store)"
)


def invalid_expire(command: str) -> str:
    return f"invalid expire time in '{command}' command"


def describe(exc: BaseException) -> str:
    """`TypeName: message` for a log line or an error message (redis-py's repr of its
    errors drops the message), and the system's words for an OS error behind it
    (redis-py says "Error 111 connecting to ...", not "Connection refused")."""
    text = f"{type(exc).__name__}: {exc}"
    cause: BaseException | None = exc
    seen: set[int] = set()  # a chain can loop back on itself
    while cause is not None and id(cause) not in seen:
        if isinstance(cause, OSError) and cause.errno:
            words = os.strerror(cause.errno)
            return text if words in text else f"{text} ({words})"
        seen.add(id(cause))
        cause = cause.__cause__ or cause.__context__
    return text


class GoblinError(Exception):
    """Base of the errors goblin-idem raises itself (store replies are ResponseError)."""


class LockError(GoblinError):
    """A Lock could not be acquired or released as asked."""


class LockNotOwnedError(LockError):
    """The lock's lease was lost (expired or taken) while the caller believed it held it."""


class InFlightError(GoblinError):
    """Another run of a `once` function holds the claim of this key (or its worker died and
    the lease has not run out yet): nothing ran. Retry after `retry_after` seconds; a
    message consumer leaves the message unacknowledged, to be delivered again."""

    def __init__(self, message: str, *, key_hash: str, retry_after: float) -> None:
        super().__init__(message)
        self.key_hash = key_hash
        self.retry_after = retry_after


class ClaimLostError(GoblinError):
    """The store no longer holds this run's claim (its lease lapsed, or the key was taken or
    deleted): another run may be doing the same work, so commit no side effect."""

    def __init__(self, message: str, *, key_hash: str) -> None:
        super().__init__(message)
        self.key_hash = key_hash


class NotReplicatedError(GoblinError, RedisError):
    """Fewer replicas than a RedisStore's ``wait_replicas`` acknowledged a write in time.

    A RedisError, so the middleware treats it as any store failure (503, nothing run); the
    write itself stays on the primary (a won claim until its lease expires).
    """

    def __repr__(self) -> str:  # redis-py's RedisError.__repr__ drops the message
        return f"{type(self).__name__}({str(self)!r})"


class StorePermissionError(GoblinError, NoPermissionError):
    """The store's user may not run a command, or use a key, that goblin-idem needs.

    A configuration error, not an outage: `RedisStore.detect()` raises it naming every
    command the server refused and the ACL rule that allows them; a command refused later
    raises it for that one command. A NoPermissionError (so a RedisError), so the middleware
    treats it as any store failure (503, nothing run), and logs it once per store.
    """

    def __init__(self, message: str, *, denied: tuple[str, ...] = (), keys: bool = False) -> None:
        super().__init__(message)
        self.denied = denied  # the refused commands, as the server names them ("set", "config|get")
        self.keys = keys  # a key was refused (the user's ~pattern), not a command

    def __repr__(self) -> str:
        return f"{type(self).__name__}({str(self)!r})"
