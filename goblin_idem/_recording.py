"""What the middleware and `once` ask of a database that records results (``records=``).

They never import SQLAlchemy: `goblin_idem.sql.SqlRecords` implements these protocols, and
any object that does can stand in for it. A run opens one `RunTransaction`; the work's own
writes join it; `commit` inserts the record in it and commits, so the work's effects and
its record exist together or not at all.
"""

from __future__ import annotations

import asyncio
import contextvars
import inspect
import logging
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any, Protocol

from ._closing import free_claim
from ._keys import KeyNames
from ._log import describe
from .exceptions import DatabaseUnavailableError
from .store import CLAIMED, ClaimReply, Store

logger = logging.getLogger("goblin_idem.claim")

__all__ = ["Committed", "Lookup", "RecordRow", "Records", "RunTransaction", "kept", "let_go"]


@dataclass(frozen=True, slots=True)
class RecordRow:
    """What a run commits as its record: one value for the fields every records backend
    writes, passed whole from the run to the row."""

    key: bytes  # the result key's name as the store has it: the row's primary key
    key_hash: str  # the key's hash, as logs show it
    fp: bytes  # the request's fingerprint
    data: bytes  # the record's bytes, as the store gets them (sealed when encryption is on)
    ttl_ms: int  # how long the row is replayed, from its commit


class Committed(Exception):
    """`RunTransaction.commit` found the key's row already committed by another run: this
    run's transaction was rolled back. `data` is that run's record."""

    def __init__(self, data: bytes) -> None:
        super().__init__("another run committed this key first")
        self.data = data


class RunTransaction(Protocol):
    """One run's transaction, opened on first use (by the work, or by `commit`); also the
    transaction of a request without a claimed key (`commit_work`)."""

    def enter(self) -> contextvars.Token[object]:
        """Make this the transaction that ``connection()`` returns in this context."""
        ...

    def leave(self, token: contextvars.Token[object]) -> None: ...

    async def commit(self, row: RecordRow) -> None:
        """Insert `row` and commit, atomically with the work's writes. Raises
        `Committed` if the key's unexpired row exists (nothing of this run is kept), or
        the database's error (nothing of this run is kept either)."""
        ...

    async def commit_work(self) -> None:
        """Commit the work's writes alone (no record): a request without a claimed key,
        before its response is sent. Raises the database's error if nothing committed."""
        ...

    async def rollback(self) -> None:
        """Undo the work's writes and give the connection back; safe to repeat."""
        ...

    def unavailable(self, exc: Exception) -> DatabaseUnavailableError | None:
        """`exc`, raised by the work, as the database unavailable to it (the middleware
        answers 503 database-unavailable), or None for an error of another kind."""
        ...


class Records(Protocol):
    """Where committed records live: the truth, which the store caches."""

    def transaction(self, where: Callable[[], str] | None = None) -> RunTransaction:
        """A new transaction. `where` names the route (or function) of a run under a won
        claim, for the WARNING about commits on the database outside the run; None for a
        request without a claimed key (nothing watched)."""
        ...

    async def lookup(self, key: bytes) -> tuple[bytes, int] | None:
        """The unexpired record of `key` and the milliseconds it has left, or None."""
        ...

    async def check(self) -> str:
        """Raise, saying what to change, unless records can be written; else describe them."""
        ...

    async def forget(self, key: bytes) -> bool:
        """Delete `key`'s record, expired or not (`goblin_idem.forget`); True if there was one."""
        ...


# The transaction a won claim's lookup opened (its connection kept for the run), set in the
# request's context by `Lookup.settle` for the run that follows there: records that keep
# their lookup's connection (`lookup_for_run`) take it in `transaction(where)`.
kept: contextvars.ContextVar[RunTransaction | None] = contextvars.ContextVar(
    "goblin_idem_kept", default=None
)
Looked = tuple[tuple[bytes, int] | None, RunTransaction | None]


class Lookup:
    """The database's record of a key, asked for alongside the claim step. Records with a
    ``lookup_for_run(key)`` (`goblin_idem.sql.SqlRecords`) ask it on the connection a run of
    the key would use, and keep that connection for the run (one pooled connection per
    run, not two): handed to the run by `settle`, given back otherwise."""

    __slots__ = ("coro", "key", "records", "task")

    def __init__(self, records: Records, key: bytes) -> None:
        self.records, self.key = records, key
        keeping = getattr(records, "lookup_for_run", None)
        coro = keeping(key) if keeping else _alone(records, key)
        self.coro: object = coro
        self.task: asyncio.Future[Looked] = asyncio.ensure_future(coro)

    def forget(self) -> None:
        """Not needed (the claim step answered without a won claim, or failed). A lookup
        not yet started (the store answered without waiting: a replay from its replay
        cache) is cancelled before it runs, so it sends nothing; one under way is left to
        end, not cancelled: a query cut off midway can leave its connection in a
        transaction (on SQLite, holding a lock that stops every writer)."""
        coro = self.coro
        if inspect.iscoroutine(coro) and inspect.getcoroutinestate(coro) == inspect.CORO_CREATED:
            self.task.cancel()  # its first step throws at its first line: nothing ran
            return
        _forgotten.add(self.task)
        self.task.add_done_callback(_quiet)

    async def settle(
        self, reply: ClaimReply, store: Store, names: KeyNames, token: bytes
    ) -> ClaimReply:
        """The claim step's reply, with the database's word on a won claim: its committed
        record (published to the store for the duplicates that follow, under this claim's
        token, for the time the row has left) instead of CLAIMED. A lookup that fails frees
        the claim and raises DatabaseUnavailableError, whatever it met: the middleware
        answers 503 database-unavailable and nothing runs, even with fail_open."""
        if reply is not CLAIMED:
            self.forget()
            return reply
        try:
            found, run = await self.task
        except BaseException as exc:
            self.forget()  # cancelled here: a kept connection is given back when it ends
            await free_claim(store, names, token)
            if isinstance(exc, Exception) and not isinstance(exc, DatabaseUnavailableError):
                # Any failure of the database's answer (a table gone, a bug) is the
                # database's: the key may have a committed record, so nothing runs, and
                # never as a store that is down (which fail_open would run unprotected).
                raise DatabaseUnavailableError(
                    f"the records' lookup failed: {describe(exc)}"
                ) from exc
            raise
        if found is None:
            if run is not None:
                kept.set(run)  # for this request's run, which begins next in this context
            return CLAIMED
        if run is not None:
            await run.rollback()  # nothing runs: its connection goes back
        data, ttl_ms = found
        try:
            await store.publish(names.result, data, ttl_ms, names.claim, token)
        except Exception as exc:  # the database answers the next duplicate as well
            logger.warning(
                "key %s: could not publish the committed record back: %s", names.hash, describe(exc)
            )
        return data


async def _alone(records: Records, key: bytes) -> Looked:
    return await records.lookup(key), None


_forgotten: set[asyncio.Future[Any]] = set()  # lookups left to end, kept from the collector


def _quiet(task: asyncio.Future[Looked]) -> None:
    """A forgotten lookup ended: its kept connection (if any) given back."""
    _forgotten.discard(task)
    if task.cancelled() or task.exception() is not None:
        return  # retrieved: never "exception was never retrieved"
    run = task.result()[1]
    if run is not None:
        let_go(run)


def let_go(run: RunTransaction) -> None:
    """Roll `run` back in the background, which gives its connection back."""
    rolled = asyncio.ensure_future(run.rollback())
    _forgotten.add(rolled)
    rolled.add_done_callback(_quiet_rollback)


def _quiet_rollback(task: asyncio.Future[None]) -> None:
    _forgotten.discard(task)
    if not task.cancelled():
        task.exception()
