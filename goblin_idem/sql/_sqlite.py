"""SQLite set up for SQL records with several writers (uvicorn --workers N on one file).

Two settings, each for a failure measured without it (bench/sqlite_workers.py, figures in
docs/sql.md):
- WAL: readers (the claim step's lookup) and the one writer no longer block each other;
- a busy timeout: a writer waits for the write lock another process holds, up to
  `busy_timeout_seconds`, instead of failing with "database is locked".
The lock is taken where it cannot deadlock by the driver's own transaction handling, which
is kept: it begins the run's transaction right before its first write, so a transaction
never holds a read snapshot that must become a write (SQLite refuses that upgrade at once,
whatever the busy timeout). BEGIN IMMEDIATE at the run's first ``connection()`` was
measured too: it holds the write lock through the handler's work before its first write,
and took 53 s instead of 20 s for the same 400 requests, 2 of them unanswered in 30 s.
What still fails (the lock not had within the timeout) is the database unavailable: the
middleware answers 503 ``database-unavailable``.
"""

from __future__ import annotations

from typing import Any

from sqlalchemy import event
from sqlalchemy.engine import Engine
from sqlalchemy.ext.asyncio import AsyncEngine, create_async_engine

__all__ = ["configure_sqlite", "sqlite_engine"]

DEFAULT_BUSY_TIMEOUT_SECONDS = 10.0


def sqlite_engine(
    url: str, *, busy_timeout_seconds: float = DEFAULT_BUSY_TIMEOUT_SECONDS, **kwargs: Any
) -> AsyncEngine:
    """An AsyncEngine on the SQLite file at `url` (``sqlite+aiosqlite:///app.db``) set up
    for several processes writing (see the module docstring); `kwargs` go to
    create_async_engine. ``SqlRecords("sqlite+aiosqlite:///...")`` makes its engine so."""
    engine = create_async_engine(url, **kwargs)
    configure_sqlite(engine, busy_timeout_seconds=busy_timeout_seconds)
    return engine


def configure_sqlite(
    engine: AsyncEngine | Engine, *, busy_timeout_seconds: float = DEFAULT_BUSY_TIMEOUT_SECONDS
) -> None:
    """Set up an engine made elsewhere as `sqlite_engine` does (before its first use); a
    sync Engine too (a WSGI or Flask app's)."""
    if engine.dialect.name != "sqlite":
        raise ValueError(f"configure_sqlite needs a SQLite engine, not {engine.dialect.name}")
    if isinstance(busy_timeout_seconds, bool) or not isinstance(busy_timeout_seconds, (int, float)):
        raise TypeError("busy_timeout_seconds must be a number of seconds")
    if busy_timeout_seconds < 0:
        raise ValueError(f"busy_timeout_seconds must be >= 0, got {busy_timeout_seconds!r}")
    busy_ms = round(busy_timeout_seconds * 1000)

    target = engine.sync_engine if isinstance(engine, AsyncEngine) else engine

    @event.listens_for(target, "connect")
    def _connect(dbapi_connection: Any, _record: Any) -> None:
        cursor = dbapi_connection.cursor()
        try:
            cursor.execute(f"PRAGMA busy_timeout = {busy_ms}")
            cursor.execute("PRAGMA journal_mode = WAL")  # kept in the file: once is enough
        finally:
            cursor.close()
