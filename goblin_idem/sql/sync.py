"""The request's transaction for sync code (WSGI, Flask): ``connection()`` and ``session()``.

With ``records=SyncSqlRecords(engine)`` (a sync Engine) on the WSGI or Flask middleware, every
request has one transaction in its own thread (`SyncRun`): under a won claim the run's,
committed with its record before any of the response reaches the server; without a
claimed key (none sent, a route not covered) the request's own, committed when the app has
answered below 500, before that answer goes out, and rolled back otherwise. A commit that
fails is answered 503 (``not-committed``), never a 2xx. The connection is taken from the
engine's pool and its transaction begun on first use, so a request that writes nothing
through it costs nothing.

``connection()`` is the transaction's Connection: its ``commit()`` and ``begin()`` are
refused (``begin_nested()`` is a savepoint), as on the async side. ``session()`` is a
Session on it whose ``commit()`` releases a savepoint instead of committing
(``join_transaction_mode="create_savepoint"``): the way Flask-SQLAlchemy views are
written, ``db.session.commit()`` at the end of each, keeps working and keeps its meaning
within the request (``rollback()`` undoes back to the last commit), while only the request
commits, with its record. The sessions are flushed before the transaction commits (objects
added and never flushed are not lost), and so is a session the app makes itself on
``connection()`` (``Session(bind=connection())``: the ORM's ``after_attach`` event).

A commit on the records' database from another connection while a keyed run is under way
is not covered; it is logged once per route as a WARNING (`goblin_idem.sql._context`).
"""

from __future__ import annotations

import logging
import sys
from collections.abc import Callable
from typing import TYPE_CHECKING, Any, NoReturn

from sqlalchemy import event
from sqlalchemy.engine import Connection, NestedTransaction, RootTransaction
from sqlalchemy.orm import Session

from .._log import describe
from .._recording import RecordRow
from ..exceptions import CommitRefusedError, DatabaseUnavailableError, NotInRunError
from ._context import _current
from ._failures import connecting, unavailable_as

if TYPE_CHECKING:
    from ._sync_records import SyncSqlRecords

__all__ = ["RunConnection", "SyncRun", "connection", "session"]

logger = logging.getLogger("goblin_idem.sql")

ADVICE = (
    "goblin_idem.sql.sync.session() or connection() in place of a session or connection of "
    "the app's own (with Flask-SQLAlchemy, db.session joins the run by itself wherever it "
    "writes to the records' database, whichever of db.init_app(app) and the extension came "
    "first)"
)


class RunConnection(Connection):
    """The request's connection: everything a Connection does but commit, or begin a
    transaction of its own (one that would commit apart from the record)."""

    def commit(self) -> NoReturn:
        raise CommitRefusedError(
            "this request's transaction commits when the request ends (with the run's "
            "idempotency record under a key): do not commit it yourself; a session() "
            "commit releases a savepoint instead"
        )

    def begin(self) -> NoReturn:
        raise CommitRefusedError(
            "the request's connection is in the request's transaction already, which commits "
            "when the request ends: use begin_nested() for a savepoint"
        )

    def begin_nested(self) -> NestedTransaction:
        """A savepoint; on SQLite (pysqlite), the transaction begun first: the driver
        defers its BEGIN to the first write, and a SAVEPOINT outside a transaction would
        be one whose RELEASE (a session's commit) commits."""
        if self.dialect.name == "sqlite":
            raw: Any = self.connection.driver_connection
            if not raw.in_transaction:
                self.exec_driver_sql("BEGIN")
        return super().begin_nested()


class SyncRun:
    """One request's transaction on `records`' engine, in the request's thread (a
    `goblin_idem._threads._records.ThreadWork`), begun on first use. `where` names the route of a
    run under a won claim, whose database is watched for commits outside the run; None for
    a request without a claimed key."""

    def __init__(self, records: SyncSqlRecords, where: Callable[[], str] | None) -> None:
        self.records = records
        self.engine = records.engine
        self.where = where
        self.advice = ADVICE
        self.conn: RunConnection | None = None
        self.looked: RunConnection | None = None  # the lookup's, kept: conn on first use
        self.tx: RootTransaction | None = None
        self.sessions: list[Session] = []  # session()'s, and Flask-SQLAlchemy's joined ones
        self.adopted: list[Session] = []  # the app's own sessions on this connection
        self.ended = False  # committed or rolled back: connection() refuses
        self.dropped = False  # its connection was given back invalidated (`lost`)

    # -- the work (goblin_idem._threads._records.ThreadWork) --

    def begin(self) -> None:
        """Nothing sent: the connection is taken at the first ``connection()``; a run under
        a won claim takes the one its lookup kept, in the run's transaction already
        (`SyncSqlRecords.lookup_for_work`)."""
        if self.where is not None:
            self.looked = self.records.kept_for_work()

    def enter(self) -> object:
        return _current.set(self)

    def leave(self, token: object) -> None:
        _current.reset(token)  # type: ignore[arg-type]

    def commit(self, row: RecordRow) -> bytes | None:
        """The work's writes and the record's row, committed together (one transaction):
        the row's primary key makes a second run's commit fail, and its writes vanish with
        it. A run that wrote nothing commits the row alone, one statement in autocommit."""
        try:
            try:
                if self.conn is None and self.looked is None and not self.ended:
                    self.ended = True  # connection() refuses from here on
                    committed = self.records.insert_alone(row)
                else:
                    conn, tx = self._flushed()
                    committed = self.records.commit(conn, tx, row)
            except Exception as exc:
                failure = self.unavailable(exc, "at the run's commit")
                if failure is None:
                    raise
                raise failure from exc
            if committed:
                return None
            self.rollback()
            found = self.records.lookup(row.key)
            if found is None:  # expired between the two: nothing to replay
                raise RuntimeError(f"the record of key {row.key_hash} expired meanwhile")
            return found[0]
        finally:
            self.rollback()  # after a commit: only gives the connection back

    @property
    def lost(self) -> bool:
        """Whether the request's connection was invalidated, lost midway: SQLAlchemy answers
        every statement after that with PendingRollbackError, and an app that caught the
        first error goes on to meet only that, which says nothing of the database."""
        conn = self.conn or self.looked
        return self.dropped or (conn is not None and conn.invalidated)

    def unavailable(self, exc: Exception, where: str) -> DatabaseUnavailableError | None:
        """`exc` (met `where`) as the database unavailable: by what it says (`_failures`),
        or because the request's connection was lost (`lost`); else None."""
        failure = unavailable_as(exc, where)
        if failure is None and self.lost:
            failure = DatabaseUnavailableError(
                f"the database is unavailable {where}: the request's connection was lost "
                f"midway ({describe(exc)})"
            )
        return failure

    def commit_work(self) -> None:
        """Commit the work's writes without a record (a request without a claimed key),
        before its response goes out. Raises the database's error if nothing committed."""
        try:
            if (self.conn or self.looked) is not None and not self.ended:
                self._flushed()[1].commit()
        finally:
            self.rollback()

    def rollback(self) -> None:
        """Undo what did not commit and give the connection back; safe to repeat."""
        self.ended = True
        if self.conn is None and self.looked is None and not self.sessions:
            return
        conn, self.conn, self.looked = self.conn or self.looked, None, None
        self.dropped = self.dropped or (conn is not None and conn.invalidated)
        sessions, self.sessions = self.sessions, []
        self.adopted.clear()  # the app's: it closes them
        for s in sessions:
            try:
                s.close()
            except Exception as exc:
                logger.warning("could not close a session of the request: %s", describe(exc))
        if conn is not None:
            try:
                conn.close()  # rolls back what was not committed
            except Exception as exc:  # a connection the database dropped: nothing to undo
                logger.warning("could not give back the request's connection: %s", describe(exc))

    # -- what the app's code calls --

    def connection(self) -> RunConnection:
        """The request's connection, taken and begun on first use; DatabaseUnavailableError
        if none could be had (the pool exhausted, the database unreachable)."""
        if self.ended:
            raise NotInRunError(
                "this request's transaction has ended (it committed, with the run's record if "
                "it had a key, or rolled back): code that outlives the request, such as the "
                "rest of a streamed response, takes a connection of its own from the engine"
            )
        if self.conn is None:
            with connecting("for the request's connection()"):
                conn, self.looked = self.looked or RunConnection(self.engine), None
                try:
                    self.tx = Connection.begin(conn)  # the one begin allowed
                except BaseException:
                    conn.close()
                    raise
            self.conn = conn
        return self.conn

    def session(self, **options: Any) -> Session:
        """A Session on the request's connection whose commit releases a savepoint."""
        s = Session(bind=self.connection(), join_transaction_mode="create_savepoint", **options)
        self.sessions.append(s)
        return s

    def join(self, s: Session) -> Connection:
        """`s` (Flask-SQLAlchemy's ``db.session``) joins the request's transaction: flushed
        with it, and closed at its end if the app did not close it. Its bind."""
        conn = self.connection()
        if s not in self.sessions:
            self.sessions.append(s)
        return conn

    def adopt(self, own: Session) -> None:
        """`own`, a session the app made on this request's connection, is flushed with it."""
        if own not in self.adopted and own not in self.sessions:
            self.adopted.append(own)

    def owns(self, conn: Connection) -> bool:
        return conn is self.conn

    def route(self) -> str:
        """The route a WARNING names: Flask's URL rule, when a Flask request is under way
        (the middleware sees only the path), else what the middleware named."""
        flask = sys.modules.get("flask")
        if flask is not None and flask.has_request_context():
            rule = flask.request.url_rule
            if rule is not None:
                return f"{flask.request.method} {rule.rule}"
        assert self.where is not None
        return self.where()

    def _flushed(self) -> tuple[RunConnection, RootTransaction]:
        """The connection with the work's pending ORM writes flushed into its transaction
        (a session's savepoint released), which must still be the one begun for it."""
        if self.conn is None and self.looked is not None:
            self.connection()  # the lookup's, whose transaction is the run's
        for s in [*self.sessions, *self.adopted]:
            if s.in_transaction() or s.new or s.dirty or s.deleted:
                s.commit() if s.join_transaction_mode == "create_savepoint" else s.flush()
        conn, tx = self.conn, self.tx
        if conn is None or tx is None or not tx.is_active:
            raise RuntimeError(
                "the request's transaction was rolled back by the app: its writes are gone, "
                "so nothing of it commits"
            )
        return conn, tx


def current() -> SyncRun | None:
    """The sync request's transaction current in this thread, if any."""
    run = _current.get()
    return run if isinstance(run, SyncRun) else None


def _running() -> SyncRun:
    run = _current.get()
    if isinstance(run, SyncRun):
        return run
    if run is not None:
        raise NotInRunError(
            "goblin_idem.sql.sync serves sync apps (WSGI, Flask); this code runs in an async "
            "request or once() run: use await goblin_idem.sql.connection() / session()"
        )
    raise NotInRunError(
        "connection() and session() belong to a request handled by the WSGI or Flask "
        "middleware with records=SyncSqlRecords(engine) (any request: with a "
        "key they are the run's transaction, without one a transaction committed before the "
        "response); this code runs outside one"
    )


def connection() -> Connection:
    """The request's Connection, in its transaction (begun on first use); it commits with
    the run's record, or for a request without a claimed key when the app has answered
    below 500, before the response goes out. Its own commit() is refused."""
    return _running().connection()


def session(**options: Any) -> Session:
    """A Session on the request's connection (`connection`): its commit() releases a
    savepoint, and what it holds is flushed and committed with the request. `options` go to
    Session (``expire_on_commit=False``, say)."""
    return _running().session(**options)


@event.listens_for(Session, "after_attach")
def _attached(own: Session, _: object) -> None:
    """An object added to a session: if the session is bound to the current sync request's
    connection, the request flushes it before it commits."""
    run = _current.get()
    if isinstance(run, SyncRun) and run.conn is not None and own.bind is run.conn:
        run.adopt(own)
