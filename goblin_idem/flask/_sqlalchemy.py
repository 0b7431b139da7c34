"""Flask-SQLAlchemy's ``db.session`` in the run's transaction, on keyed routes.

With ``records=SqlRecords(db.engine)``, a run under a won claim has one transaction on the
records' engine (`goblin_idem.sql.sync.SyncRun`). The session ``db.session`` makes for the
request (its scoped session, one per app context) is made, in such a run, bound to the
run's connection wherever it would use ``db.engine`` (other binds keep their engines), with
``join_transaction_mode="create_savepoint"``: the view's own ``db.session.commit()``
releases a savepoint, and only the run commits, with its record, before the response
goes out. So a Flask-SQLAlchemy view needs no change. A request without a claimed key is
left as Flask-SQLAlchemy makes it (the view's commits are its own).
"""

from __future__ import annotations

from typing import Any

from flask import Flask
from sqlalchemy.engine import Connection, Engine
from sqlalchemy.orm import Session

from ..sql._context import _database
from ..sql._sync_records import SyncSqlRecords
from ..sql.sync import current

__all__ = ["join_sessions"]

JOINED = "_goblin_idem_joined"  # set on the session factory once it joins runs


def join_sessions(app: Flask, records: SyncSqlRecords) -> None:
    """Make `app`'s Flask-SQLAlchemy sessions join keyed runs, if it has the extension.
    ValueError, saying what to pass, for records on the app's database through another
    Engine than Flask-SQLAlchemy's (its sessions could not join their runs)."""
    db: Any = app.extensions.get("sqlalchemy")
    if db is None:
        return
    with app.app_context():
        engines: list[Engine] = list(db.engines.values())
    if records.engine not in engines:
        same = [e for e in engines if _database(e.url) == _database(records.engine.url)]
        if same:
            raise ValueError(
                "records: the SqlRecords engine is not Flask-SQLAlchemy's, so db.session "
                "could not join the run's transaction: pass records=SqlRecords(db.engine) "
                "(made in an app context, after db.init_app(app))"
            )
        return
    registry = db.session.registry
    if getattr(registry.createfunc, JOINED, False):
        return
    registry.createfunc = _Joining(registry.createfunc)


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
            return run.join(session) if found is engine else found

        session.get_bind = bound  # type: ignore[method-assign]
        return session
