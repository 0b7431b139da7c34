"""Which database errors mean "the database is unavailable", not "this request failed".

The middleware answers these 503 ``database-unavailable`` (counted as `database_errors`,
never as the store's, never a reason to run unprotected); any other error of the run is
the app's own. Unavailable: no connection could be had (the pool exhausted, the server
refused or unreachable: any error while connecting), a connection lost midway
(SQLAlchemy's ``connection_invalidated``, or the driver's connection found closed), and
the server's own words for it, by SQLSTATE class (08 connection exception, 53
insufficient resources, 57 operator intervention: shutdown, "cannot connect now", a
statement cancelled), asyncpg's InterfaceError on its own calls (a closed connection),
or SQLite's result code (busy, locked, cannot open, disk I/O, full). A serialization
failure (40001) is not: the database answered, and refused this run's commit.
"""

from __future__ import annotations

import asyncio
import contextlib
import sqlite3
import sys
from collections.abc import Iterator

from sqlalchemy.exc import DBAPIError, DisconnectionError
from sqlalchemy.exc import TimeoutError as PoolTimeoutError

from .._log import describe
from .._unavailable import sqlite_unavailable, sqlstate_unavailable
from ..exceptions import DatabaseUnavailableError

__all__ = ["connecting", "unavailable", "unavailable_as"]


def unavailable(exc: BaseException) -> bool:
    """Whether `exc` (or what it wraps: a DBAPI error, the driver's own) says the database
    is unavailable (see the module docstring)."""
    seen = 0
    error: BaseException | None = exc
    while error is not None and seen < 6:
        seen += 1
        if isinstance(error, (PoolTimeoutError, DisconnectionError, OSError, asyncio.TimeoutError)):
            return True
        if isinstance(error, DBAPIError) and error.connection_invalidated:
            return True
        sqlstate = getattr(error, "sqlstate", None)
        if isinstance(sqlstate, str) and sqlstate_unavailable(sqlstate):
            return True
        if isinstance(error, sqlite3.OperationalError) and sqlite_unavailable(error):
            return True
        if _asyncpg_connection_error(error):
            return True
        wrapped = getattr(error, "orig", None)
        error = wrapped if isinstance(wrapped, BaseException) else error.__cause__
    return False


def _asyncpg_connection_error(error: BaseException) -> bool:
    """asyncpg's InterfaceError, from the driver's own calls (the lookup, the upsert): its
    connection is closed or gone ("connection is closed"), with no SQLSTATE to say so."""
    asyncpg = sys.modules.get("asyncpg")  # imported by the app's engine, if it uses it
    return asyncpg is not None and isinstance(error, asyncpg.InterfaceError)


def unavailable_as(exc: BaseException, where: str) -> DatabaseUnavailableError | None:
    """The DatabaseUnavailableError to raise from `exc` (which happened `where`), or None
    if `exc` is an error of another kind."""
    if isinstance(exc, DatabaseUnavailableError):
        return exc
    if not unavailable(exc):
        return None
    return DatabaseUnavailableError(f"the database is unavailable {where}: {describe(exc)}")


@contextlib.contextmanager
def connecting(where: str) -> Iterator[None]:
    """Taking a connection: whatever fails here (a pool exhausted, a server refused, gone
    or not answering) is the database unavailable."""
    try:
        yield
    except DatabaseUnavailableError:
        raise
    except Exception as exc:
        raise DatabaseUnavailableError(
            f"the database is unavailable {where}: {describe(exc)}"
        ) from exc
