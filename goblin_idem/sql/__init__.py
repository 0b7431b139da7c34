"""Exactly-once in the app's own database: the record commits in the work's transaction.

``SqlRecords(engine)`` is passed as ``records=`` to IdempotencyMiddleware or `once`. A run's
writes through ``await connection()`` (or ``await session()``) commit together with its
record, before anything of the response reaches the client; the store stays the fast claim
and replay cache, the database the truth. Needs the ``sql`` extra (SQLAlchemy 2, async)
and the app's own driver (asyncpg, psycopg or aiosqlite).

A WSGI or Flask app passes ``SyncSqlRecords(engine)`` instead, with a sync Engine
(Flask-SQLAlchemy's ``db.engine``, whose ``db.session`` then joins keyed runs), and writes
through `goblin_idem.sql.sync`'s ``connection()`` and ``session()``. Each class refuses the
other's kind of engine, saying which to pass.
"""

import importlib

try:  # SQLAlchemy's asyncio half needs greenlet, which a plain `pip install sqlalchemy` lacks
    importlib.import_module("greenlet")
    importlib.import_module("sqlalchemy.ext.asyncio")
except ImportError as exc:  # what to install, not SQLAlchemy's own hint
    raise ImportError(
        f"goblin_idem.sql needs SQLAlchemy 2 with asyncio ({exc.name or exc} is missing): "
        "pip install 'goblin-idem[sql]'"
    ) from exc

from ._context import connection, session
from ._records import SqlRecords
from ._sqlite import configure_sqlite, sqlite_engine
from ._sync_records import SyncSqlRecords

__all__ = [
    "SqlRecords",
    "SyncSqlRecords",
    "configure_sqlite",
    "connection",
    "session",
    "sqlite_engine",
]
