"""Flask-SQLAlchemy's ``db.session`` in the run's transaction, on keyed routes.

With sync SQL records (``SyncSqlRecords(db.engine)``, or ``SyncSqlRecords(url)``), a run
under a won claim has one transaction on the records' engine
(`goblin_idem.sql.sync.SyncRun`). The session ``db.session`` makes for the request (its
scoped session, one per app context) is made, in such a run, bound to the run's connection
wherever it would write to the records' database, through ``db.engine`` or another Engine of
the same database (binds of other databases keep their engines), with
``join_transaction_mode="create_savepoint"``: the view's own ``db.session.commit()``
releases a savepoint, and only the run commits, with its record, before the response goes
out. So a Flask-SQLAlchemy view needs no change. A request without a claimed key is left as
Flask-SQLAlchemy makes it (the view's commits are its own).

Whichever of ``db.init_app(app)`` and the extension comes first: the extension joins the
sessions when it is given the app if Flask-SQLAlchemy serves it then, else when the app's
first request comes (`JoinOnFirstRequest`), before any of Flask's code runs for it. A run
whose ``db.session`` wrote outside the run would let a lost claim write twice.
"""

from __future__ import annotations

import threading
from typing import Any

from flask import Flask
from sqlalchemy.engine import URL, Connection, Engine
from sqlalchemy.orm import Session

from ..sql._context import _database
from ..sql.sync import current

__all__ = ["JoinOnFirstRequest", "join_sessions"]

JOINED = "_goblin_idem_joined"  # set on the session factory once it joins runs


def join_sessions(app: Flask) -> bool:
    """Make `app`'s Flask-SQLAlchemy sessions join keyed runs: False if the app has no
    Flask-SQLAlchemy (yet)."""
    db: Any = app.extensions.get("sqlalchemy")
    if db is None:
        return False
    registry = db.session.registry
    if not getattr(registry.createfunc, JOINED, False):
        registry.createfunc = _Joining(registry.createfunc)
    return True


class JoinOnFirstRequest:
    """The app's WSGI callable, for an extension given the app before Flask-SQLAlchemy: on
    the first request, before Flask runs, the sessions join the runs (`join_sessions`).
    Once per process; every later request pays one attribute read."""

    def __init__(self, app: Flask, wsgi_app: Any) -> None:
        self.app = app
        self.wsgi_app = wsgi_app
        self.pending = True
        self._lock = threading.Lock()

    def __call__(self, environ: dict[str, Any], start_response: Any) -> Any:
        if self.pending:
            with self._lock:  # threads' first requests: none runs before the sessions join
                if self.pending:
                    join_sessions(self.app)
                    self.pending = False
        return self.wsgi_app(environ, start_response)


def same_database(found: object, engine: Engine) -> bool:
    """`found` (a session's bind) writes to the database of `engine`: it is `engine`, or an
    Engine on its database (``SyncSqlRecords(url)`` beside ``db.engine``). Never for
    SQLite in memory, which is one database per connection."""
    if found is engine:
        return True
    if not isinstance(found, Engine):
        return False
    database = _where(engine.url)
    return database[3] not in (None, "", ":memory:") and _where(found.url) == database


def _where(url: URL) -> tuple[object, ...]:
    """The database `url` names, with the server a socket directory in its query names
    (``?host=/run/pg``: two clusters may each have a database of that name)."""
    return (*_database(url), url.query.get("host"), url.query.get("port"))


class _Joining:
    """The scoped session's factory: in a keyed run, the session joins the run."""

    def __init__(self, make: Any) -> None:
        self.make = make
        setattr(self, JOINED, True)

    def __call__(self, **options: Any) -> Session:
        run = current()
        if run is None or run.where is None or run.ended:
            return self.make(**options)  # type: ignore[no-any-return]
        session: Session = self.make(**options)
        session.join_transaction_mode = "create_savepoint"
        engine, get_bind = run.engine, session.get_bind

        def bound(
            mapper: Any = None, *, clause: Any = None, bind: Any = None, **kwargs: Any
        ) -> Engine | Connection:
            found = get_bind(mapper, clause=clause, bind=bind, **kwargs)
            return run.join(session) if same_database(found, engine) else found

        session.get_bind = bound  # type: ignore[method-assign]
        return session
