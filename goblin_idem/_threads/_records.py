"""Records whose transaction lives in the request's thread: Django's ORM, sync SQLAlchemy.

The middleware runs on the loop thread and asks its `Records` for async steps; a sync
app's database work is bound to the thread it runs in (Django's connection is per thread,
a sync Session is not shared across threads). `ThreadedRecords` adapts a `ThreadRecords`
backend, whose methods all run in the request's thread, to the `Records` protocol: every
step crosses to that thread through the request's `Exchange` (`_exchange`), which the
request's thread serves until the middleware is done. So the view's writes, the record's
insert and the COMMIT are one transaction on one connection in one thread, and the
guarantees of `_recording` hold as they do for async records:

- the work (`ThreadWork`) is begun in the request's thread before the app runs
  (`Responder.start`, `_bridge`), and made the thread's current work around every call
  into the app (its body, its streamed chunks, its close);
- the record commits with the work's writes when the middleware's closing step asks
  (`commit`), before any of the response reaches the server; a request without a
  claimed key commits its writes alone (`commit_work`);
- whatever ends the exchange (its end, an error, the request's thread giving up), the
  request's thread rolls back a work not committed (`Exchange.at_end`), so a thread never
  carries an open transaction into its next request.

Only the sync adapters (WSGI, Flask, Django under WSGI) run requests through an exchange:
`transaction` refuses elsewhere, saying what to use.
"""

from __future__ import annotations

import asyncio
import contextvars
from collections.abc import Callable
from typing import Any, Protocol, TypeVar

from .._recording import Committed, RecordRow
from ..exceptions import DatabaseUnavailableError
from ._exchange import Exchange, Raised

__all__ = [
    "ThreadRecords",
    "ThreadWork",
    "ThreadedRecords",
    "ThreadedTransaction",
    "for_sync_apps",
    "outside_requests",
    "pending",
]

T = TypeVar("T")

# The request's ThreadedTransaction on the loop side, between the middleware's enter and
# leave: the bridge hands it to the request's thread with the app's first call.
_pending: contextvars.ContextVar[ThreadedTransaction | None] = contextvars.ContextVar(
    "goblin_idem_threaded", default=None
)


class ThreadWork(Protocol):
    """One request's transaction in its thread. Every method is called in that thread."""

    def begin(self) -> None:
        """Open the transaction, before the app runs (its writes go into it)."""
        ...

    def enter(self) -> object:
        """Make this the thread's current work (what a sync ``session()`` returns); a
        token for `leave`."""
        ...

    def leave(self, token: object) -> None: ...

    def commit(self, row: RecordRow) -> bytes | None:
        """Insert `row` and commit, with the work's writes: None once committed; the
        record another run committed first if the key's unexpired row exists (this run's
        writes rolled back). Raises the database's error if nothing committed."""
        ...

    def commit_work(self) -> None:
        """Commit the work's writes alone: a request without a claimed key."""
        ...

    def rollback(self) -> None:
        """Undo what is not committed and end the transaction; safe to repeat, and does
        nothing after a commit."""
        ...


class ThreadRecords(Protocol):
    """A records backend whose transactions run in the request's thread."""

    where: str

    def work(self, where: Callable[[], str] | None) -> ThreadWork:
        """A new transaction, not begun (`where` as in `Records.transaction`)."""
        ...

    def lookup(self, key: bytes) -> tuple[bytes, int] | None:
        """As `Records.lookup`, called in the request's thread."""
        ...

    def check(self) -> str:
        """As `Records.check`, called in a worker thread at startup."""
        ...

    def forget(self, key: bytes) -> bool: ...

    def unavailable(self, exc: Exception) -> DatabaseUnavailableError | None:
        """`exc` as the database unavailable (answered 503 database-unavailable), or None."""
        ...


def _exchange(what: str) -> Exchange:
    exchange = Exchange.running()
    if exchange is None:
        raise RuntimeError(
            f"{what}: these records keep their transaction in the request's thread, which "
            "only the WSGI, Flask and Django (under WSGI) middlewares run; under ASGI, or "
            "with once(), use goblin_idem.sql.SqlRecords with an AsyncEngine"
        )
    return exchange


async def _in_thread(exchange: Exchange, fn: Callable[..., T], *args: Any) -> T:
    """`fn(*args)` in the request's thread; its exception raised here as it was raised."""
    try:
        return await exchange.call(fn, *args)
    except Raised as exc:
        raise exc.error from None


class InWorkerThread:
    """A `ThreadRecords` backend's lookup and forget for code outside any request (an
    operator's `forget`): each call in a worker thread of the running loop, on a connection
    of its own. No transaction: a run's commit belongs to its request's thread."""

    def __init__(self, backend: ThreadRecords) -> None:
        self.backend = backend

    def transaction(self, where: Callable[[], str] | None = None) -> ThreadedTransaction:
        return ThreadedTransaction(self.backend, where, _exchange("records"))

    async def lookup(self, key: bytes) -> tuple[bytes, int] | None:
        return await asyncio.to_thread(self.backend.lookup, key)

    async def check(self) -> str:
        return await asyncio.to_thread(self.backend.check)

    async def forget(self, key: bytes) -> bool:
        return await asyncio.to_thread(self.backend.forget, key)


class ThreadedRecords(InWorkerThread):
    """`backend` as the middleware's `Records` (`goblin_idem._recording`)."""

    def __init__(self, backend: ThreadRecords) -> None:
        super().__init__(backend)
        self.where = backend.where
        self.keeping: Callable[..., tuple[bytes, int] | None] | None = getattr(
            backend, "lookup_for_work", None
        )

    def __repr__(self) -> str:
        return repr(self.backend)

    async def lookup(self, key: bytes) -> tuple[bytes, int] | None:
        """Asked in the request's thread while the loop thread sends the claim; by a
        backend that keeps the lookup's connection for the request's work
        (``lookup_for_work(key, at_end)``: `goblin_idem.sql.SyncSqlRecords`), with the
        request's `Exchange.at_end`, through which it gives the connection back if no work
        took it."""
        exchange = _exchange("records")
        if self.keeping is None:
            return await _in_thread(exchange, self.backend.lookup, key)
        return await _in_thread(exchange, self.keeping, key, exchange.at_end)


class ThreadedTransaction:
    """The loop side of one request's `ThreadWork` (the `RunTransaction` protocol)."""

    __slots__ = ("backend", "exchange", "where", "work")

    def __init__(
        self, backend: ThreadRecords, where: Callable[[], str] | None, exchange: Exchange
    ) -> None:
        self.backend = backend
        self.where = where
        self.exchange = exchange
        self.work: ThreadWork | None = None  # begun in the request's thread

    # -- the loop thread --

    def enter(self) -> contextvars.Token[Any]:
        return _pending.set(self)

    def leave(self, token: contextvars.Token[Any]) -> None:
        _pending.reset(token)

    async def commit(self, row: RecordRow) -> None:
        other = await _in_thread(self.exchange, self._commit, row)
        if other is not None:
            raise Committed(other)

    async def commit_work(self) -> None:
        if self.work is not None:
            await _in_thread(self.exchange, self.work.commit_work)

    async def rollback(self) -> None:
        # Once the request's thread has stopped serving, it rolled back itself (`_ended`).
        if self.work is not None and not self.exchange.abandoned and self.exchange.done is None:
            await _in_thread(self.exchange, self.work.rollback)

    def unavailable(self, exc: Exception) -> DatabaseUnavailableError | None:
        error = exc.error if isinstance(exc, Raised) else exc
        if not isinstance(error, Exception):
            return None
        failure: DatabaseUnavailableError | None
        lost = getattr(self.work, "unavailable", None)  # a work that can tell (`SyncRun`)
        if lost is not None:
            failure = lost(error, "for the run's writes")
        else:
            failure = self.backend.unavailable(error)
        if failure is not None and failure is not error:
            failure.__cause__ = error
        return failure

    # -- the request's thread --

    def begin(self) -> ThreadWork:
        """The work, begun on the first call into the app (or at a commit before any)."""
        work = self.work
        if work is None:
            work = self.backend.work(self.where)
            work.begin()
            self.work = work
            self.exchange.at_end(work.rollback)
        return work

    def _commit(self, row: RecordRow) -> bytes | None:
        return self.begin().commit(row)


def pending() -> ThreadedTransaction | None:
    """The current request's transaction in the request's thread, on the loop side (read by
    the bridge before it calls into the app)."""
    return _pending.get()


def outside_requests(records: object) -> object:
    """`records` for code that runs outside any request (`goblin_idem.forget`): a backend
    that keeps its transaction in the request's thread, called in worker threads."""
    return InWorkerThread(records) if _is_thread_backend(records) else records  # type: ignore[arg-type]


def _is_thread_backend(records: object) -> bool:
    return callable(getattr(records, "work", None)) and not callable(
        getattr(records, "transaction", None)
    )


def for_sync_apps(records: object) -> object:
    """`records` as the sync adapters give them to the middleware: a backend that keeps
    its transaction in the request's thread (it has `work`), adapted; else as given."""
    return ThreadedRecords(records) if _is_thread_backend(records) else records  # type: ignore[arg-type]
