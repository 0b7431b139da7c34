"""SQL records in the middleware (``records=``): the database is the truth, the store its cache.

Two steps, each with its guarantee:

- the claim step (`goblin_idem._recording.Lookup`): a won claim with no result in the
  store asks the database, asked concurrently with the claim (a new key waits for the
  slower of the two, not both). A committed record is published back to the store and
  replayed; nothing runs.
- `Recorded` (the run): the response start and body are held back while the app runs, its
  record inserted in the run's transaction and committed, then the held messages sent. So a
  client never sees a response whose effects did not commit; a commit that fails answers
  503 (the effects did not happen: ``database-unavailable`` if the database could not be
  reached, else ``not-committed``), and a commit refused by the key's row (another run got
  there first) answers that run's record.

A request that runs without a claimed key (none sent, a route not covered, a store down
under ``fail_open``) gets a transaction too (`Unkeyed`), so that ``connection()`` and
``session()`` work on every route: committed when the response starts, before it is sent.
"""

from __future__ import annotations

import asyncio
import contextlib
import functools
import logging
from dataclasses import dataclass, field

from starlette.types import ASGIApp, Message, Receive, Scope, Send

from .. import _problems as problems
from .._keys import KeyNames
from .._log import describe
from .._recording import Records, RunTransaction
from .._run import Held
from ..exceptions import DatabaseUnavailableError
from ._responses import Answers

__all__ = ["Recorded", "Recording", "Unkeyed"]

logger = logging.getLogger("goblin_idem.middleware")

HOLDING, PASSING, FAILED, ELSEWHERE = "holding", "passing", "failed", "elsewhere"


@dataclass(frozen=True, slots=True)
class Recording:
    """What the runs of one middleware with ``records=`` share."""

    records: Records
    answers: Answers

    def recorded(self, run: Held, send: Send, fp: bytes, scope: Scope) -> Recorded:
        """`run`'s response held, its transaction begun (named by the request's route)."""
        run.begin(functools.partial(route_of, scope))
        return Recorded(run, send, self.answers, run.names, fp)


def route_of(scope: Scope) -> str:
    """The request's method and route, as the router matched it (its path template, once
    routing has run: one name for all of a route's requests), else its path."""
    path = getattr(scope.get("route"), "path", None)
    return f"{scope['method']} {path if isinstance(path, str) else scope['path']}"


@dataclass(eq=False, slots=True)
class Recorded:
    """One run's response, held back until its record commits in the run's transaction.
    The whole response is held up to the point it commits (its end, or the run's
    `max_response_bytes` for one too large to hold), so a commit refused or failed is
    always answered before any of this run's response went out."""

    run: Held  # its transaction, and the commit of the record with it
    send: Send  # the server's
    answers: Answers
    names: KeyNames
    fp: bytes
    held: list[Message] = field(default_factory=list)
    state: str = HOLDING
    answered: bool = False  # FAILED or ELSEWHERE answered; the app's messages are dropped
    data: bytes = b""  # the record committed (this run's, or another run's: ELSEWHERE)
    sent: bool = False  # some of the app's response went out
    unavailable: DatabaseUnavailableError | None = None  # why FAILED, if the database was
    _commit: asyncio.Future[bytes] | None = None

    async def commit(self, data: bytes) -> bytes | None:
        """Insert the record and commit, once: a closing step repeated after a cancel, or
        the end of a response committed early, gets the first call's outcome. What to
        publish: the record committed (this run's, or the one another run committed first);
        None if the commit failed, so that nothing of this run happened."""
        if self._commit is None:
            self._commit = asyncio.ensure_future(self.run.commit(data, self.fp))
        try:
            self.data = await asyncio.shield(self._commit)
        except DatabaseUnavailableError as exc:
            self.state, self.unavailable = FAILED, exc  # answered (and logged) by pass_on
            return None
        except Exception as exc:
            if self.state != FAILED:
                logger.error(
                    "key %s: the record did not commit, so neither did the work (if only "
                    "the commit's answer was lost, the retry finds the row and replays it): "
                    "answering 503 (%s)",
                    self.names.hash,
                    describe(exc),
                )
            self.state = FAILED
            return None
        if self.run.refused:
            self.state = ELSEWHERE
        elif self.state == HOLDING:
            self.state = PASSING
        return self.data

    async def settled(self) -> None:
        """Once a commit under way has ended (before the run's writes are rolled back)."""
        if self._commit is not None and not self._commit.done():
            with contextlib.suppress(BaseException):
                await asyncio.shield(self._commit)

    async def pass_on(self, message: Message, finished: bool) -> None:
        """`message` from the app: held until the record commits, then sent; replaced by
        the answer that a commit refused or failed calls for. `finished`: no commit is to
        come (the closing step ran, or the response is not one to record), so what is held
        goes out as it came."""
        if self.answered:
            return
        if self.state == HOLDING:
            self.held.append(message)
            if finished:
                await self.flush()
            return
        if self.state == PASSING:
            await self.flush()
            self.sent = True
            await self.send(message)
            return
        self.held.clear()
        self.answered = True
        if self.state == ELSEWHERE:
            await self.answers.stored(self.data, self.fp, self.send, self.names)
            return
        if self.unavailable is not None:
            await self.answers.database_unavailable(self.send, self.names, self.unavailable)
            return
        await problems.send_problem(
            self.send,
            problems.NOT_COMMITTED,
            "The request was not run: its effects did not commit. Retry it with the same key.",
            [(b"retry-after", self.answers.retry_after)],
        )

    async def answer_unavailable(self, exc: DatabaseUnavailableError) -> bool:
        """The app met the database unavailable (at ``connection()``) and raised: answered
        503 here, if none of its response went out; else False (the app's error stands)."""
        if self.sent or self.answered:
            return False
        self.held.clear()
        self.answered = True
        await self.answers.database_unavailable(self.send, self.names, exc)
        return True

    async def flush(self) -> None:
        held, self.held = self.held, []
        self.sent = self.sent or bool(held)
        for message in held:
            await self.send(message)


@dataclass(frozen=True, slots=True)
class Unkeyed:
    """The app, for an HTTP request run without a claimed key: ``connection()`` and
    ``session()`` are an ordinary transaction, begun on first use. It commits when the
    response starts with a status below 500 (the handler succeeded), before that start is
    sent, so a commit that fails is answered 503 and never follows a 2xx; it rolls back on
    a 5xx, an exception or a cancel."""

    app: ASGIApp
    records: Records
    retry_after: bytes

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        if scope["type"] != "http":
            await self.app(scope, receive, send)
            return
        tx = self.records.transaction()
        token = tx.enter()
        committing = _Committing(tx, send, self.retry_after, scope)
        try:
            await self.app(scope, receive, committing.send)
        finally:
            tx.leave(token)
            await tx.rollback()  # undoes a failed request's writes; after a commit, nothing


@dataclass(eq=False, slots=True)
class _Committing:
    """`Unkeyed`'s send: the transaction ends at the response start."""

    tx: RunTransaction
    server_send: Send
    retry_after: bytes
    scope: Scope
    failed: bool = False  # answered 503: the app's messages are dropped

    async def send(self, message: Message) -> None:
        if self.failed:
            return
        if message["type"] == "http.response.start":
            if message["status"] >= 500:
                await self.tx.rollback()
            else:
                try:
                    await self.tx.commit_work()
                except Exception as exc:
                    self.failed = True
                    logger.error(
                        "%s %s: the request's writes did not commit: answering 503 (%s)",
                        self.scope["method"],
                        self.scope["path"],
                        describe(exc),
                    )
                    await problems.send_problem(
                        self.server_send,
                        problems.NOT_COMMITTED,
                        "The request's effects did not commit. Retry it.",
                        [(b"retry-after", self.retry_after)],
                    )
                    return
        await self.server_send(message)
