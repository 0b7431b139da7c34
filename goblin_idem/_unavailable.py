"""A database's own word for "I cannot serve now", as opposed to "I refused this statement".

One list for every part that talks to a database (the PostgreSQL store, SQL records,
Django's records), so that a down database is a 503 / UNAVAILABLE / a requeue everywhere or
nowhere. A serialization failure (40001) is not here: the database answered.
"""

from __future__ import annotations

import sqlite3

__all__ = ["sqlite_unavailable", "sqlstate_unavailable"]

# 08 connection exception, 53 insufficient resources, 57 operator intervention (shutdown,
# "cannot connect now", a statement cancelled).
_SQLSTATE_CLASSES = frozenset({"08", "53", "57"})
# SQLITE_BUSY, SQLITE_LOCKED, SQLITE_IOERR, SQLITE_FULL, SQLITE_CANTOPEN
_SQLITE_CODES = frozenset({5, 6, 10, 13, 14})
# Before Python 3.11 an OperationalError carries no code: its message's first words.
_SQLITE_TEXTS = ("database is locked", "database table is locked", "unable to open")


def sqlstate_unavailable(sqlstate: str) -> bool:
    return sqlstate[:2] in _SQLSTATE_CLASSES


def sqlite_unavailable(error: sqlite3.OperationalError) -> bool:
    code = getattr(error, "sqlite_errorcode", None)
    if code is not None:
        return code & 0xFF in _SQLITE_CODES  # the primary code of an extended one
    return str(error).startswith(_SQLITE_TEXTS)
