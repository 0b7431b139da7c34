"""Every exception goblin-idem raises, in one tree.

    GoblinError
    ├── LockError                  a Lock could not be acquired or released as asked
    │   └── LockNotOwnedError      its lease was lost while the caller believed it held it
    ├── InFlightError              `once`: another run holds the key; nothing ran
    ├── KeyReusedError             `once`: the key was first used with other arguments
    ├── ClaimLostError             the running work no longer holds its claim
    ├── RecordError (ValueError)   stored bytes this reader cannot read or open
    ├── SealError (ValueError)     a sealed value that does not open
    ├── WebhookRefusedError        a webhook delivery that is not verified or is malformed
    ├── SqlRecordsError            SQL records that cannot be used (table, URL, driver)
    │   ├── NotInRunError          connection()/session() outside a claimed run
    │   ├── CommitRefusedError     a commit of the run's transaction by the work itself
    │   └── DatabaseUnavailableError
    │                              the records' database unreachable, its pool exhausted
    ├── NotReplicatedError (redis.exceptions.RedisError)
    │                              fewer replicas than asked acknowledged a write
    └── StorePermissionError (redis.exceptions.NoPermissionError)
                                   the store's ACL user may not run a command it needs

The two store errors are also redis-py errors, so the middleware answers them as any store
failure (503, nothing run). A store's own error replies (a wrong type, a value too large,
memory) are redis-py's `ResponseError`, whatever the store, with the spec's texts
(`goblin_idem.store`); configuration mistakes are `TypeError` and `ValueError` raised at
construction, with what to change.
"""

from __future__ import annotations

from redis.exceptions import NoPermissionError, RedisError

__all__ = [
    "ClaimLostError",
    "CommitRefusedError",
    "DatabaseUnavailableError",
    "GoblinError",
    "InFlightError",
    "KeyReusedError",
    "LockError",
    "LockNotOwnedError",
    "NotInRunError",
    "NotReplicatedError",
    "RecordError",
    "SealError",
    "SqlRecordsError",
    "StorePermissionError",
    "WebhookRefusedError",
]


class GoblinError(Exception):
    """Base of the errors goblin-idem raises itself (a store's own replies are
    redis-py's ResponseError, whatever the store)."""


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


class KeyReusedError(GoblinError):
    """A `once` call's key was first used with other arguments (its stored value came from
    a call that differs): nothing ran, and the stored value is not returned. The HTTP
    middleware answers the same mistake 422 ``key-reused``; a call with other arguments
    needs a new key, or ``fingerprint=False`` for a function whose arguments are not the
    request."""

    def __init__(self, message: str, *, key_hash: str) -> None:
        super().__init__(message)
        self.key_hash = key_hash


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


class RecordError(GoblinError, ValueError):
    """Stored bytes that this reader cannot read: a newer release's format, a sealed record
    no configured key opens, a record in the clear where sealed ones are required, or
    damaged bytes. The work they record happened: it is never run again because of this."""


class SealError(GoblinError, ValueError):
    """A sealed value that does not open: unknown key id, altered, truncated, or stored
    under another name than the one it was sealed for."""


class SqlRecordsError(GoblinError):
    """`goblin_idem.sql` records that cannot be used: the database cannot be reached, its
    driver is not installed, or the table is missing or of another shape. The middleware's
    startup check raises it with what to change."""


class NotInRunError(SqlRecordsError):
    """``connection()`` or ``session()`` called outside a run under a won claim (a request
    with a key under ``IdempotencyMiddleware(records=...)``, a ``once(..., records=...)``
    call): there is no transaction to commit the work with its record."""


class CommitRefusedError(SqlRecordsError):
    """The work committed the run's transaction itself: refused, since its effects must
    commit with the run's record, which the run commits when it ends."""


class WebhookRefusedError(GoblinError):
    """A webhook provider's refusal of a delivery (goblin_idem.webhooks): answered 401 (its
    signature is missing or wrong, or its timestamp outside the tolerance) or, with
    `malformed`, 400 (a verified delivery that names no id), before anything is claimed.

    The message is logged and sent as the problem's detail: a custom provider words it
    without the secret, the signature or the body."""

    def __init__(self, message: str, *, malformed: bool = False) -> None:
        super().__init__(message)
        self.malformed = malformed


class DatabaseUnavailableError(SqlRecordsError):
    """The records' database could not serve a run (unreachable, its pool exhausted, a
    connection lost, SQLite busy past its timeout) at the claim step's lookup, at
    ``connection()`` or at the commit; the error it met is its ``__cause__``. Nothing of the
    run committed: the middleware answers 503 ``database-unavailable`` with Retry-After
    and counts it as ``database_errors`` (never as the store's, and never a reason for
    ``fail_open`` to run the request unprotected)."""
