"""psycopg's one-query lookup and commit, as both records send them (`SqlRecords` on async
psycopg, `_drivers`; `SyncSqlRecords` on sync psycopg): whether the lookup may carry the
run's BEGIN and the text it sends then, psycopg's flag set around it, and how the insert's
refusal by the key's row is told from any other error. One definition for both, so that
the sync and async records begin, look up and commit alike."""

from __future__ import annotations

import contextlib
import datetime
from collections.abc import Iterator
from typing import Any

from ._table import RecordsTable

__all__ = ["begins_nothing", "lookup_text", "taken"]


def lookup_text(
    records: RecordsTable, dialect: Any, raw: Any, key: bytes, now: datetime.datetime
) -> str | None:
    """The one query that begins the run's transaction on psycopg's connection `raw` and
    looks `key` up (`RecordsTable._lookup_begun`), led by the BEGIN psycopg would send (the
    engine's isolation level, read only, deferrable); None where it cannot be sent so: an
    engine in autocommit (which begins nothing anyway), a connection not idle, or a
    psycopg without its own autocommit flag (`begins_nothing`)."""
    if raw.autocommit or not _can_begin(raw):
        return None
    return records._lookup_begun(dialect, _begin_statement(raw), key, now)


@contextlib.contextmanager
def begins_nothing(raw: Any) -> Iterator[None]:
    """psycopg told to begin nothing for the query sent within (`lookup_text`'s, which
    carries the BEGIN psycopg would have sent ahead of it, and waited for: a round trip of
    its own, even in a pipeline). Its own autocommit flag, set and set back around it: its
    setter refuses while a transaction is open. The connection is then as after psycopg's
    own BEGIN: the run's statements are in that transaction, and a statement after a
    rollback begins another."""
    raw._autocommit = True  # as its setter would on an idle connection (`_can_begin`)
    try:
        yield
    finally:
        raw._autocommit = False  # what it was: psycopg begins again after a rollback


def taken(records: RecordsTable, exc: BaseException) -> bool:
    """Whether `exc`, met by a commit's insert, is the key's unexpired row (another run
    committed the key first: nothing of this run commits), not an error of another kind
    (an app's own constraint checked at COMMIT: its error stands)."""
    from psycopg.errors import UniqueViolation

    return isinstance(exc, UniqueViolation) and records._taken(exc)


def _can_begin(raw: Any) -> bool:
    """Whether `lookup_text` can send the BEGIN on `raw`: idle, and psycopg's own
    autocommit flag where this release keeps it."""
    from psycopg.pq import TransactionStatus

    idle = raw.info.transaction_status == TransactionStatus.IDLE
    return idle and getattr(raw, "_autocommit", None) is False


def _begin_statement(raw: Any) -> str:
    """The BEGIN psycopg would send on `raw` (its isolation level, read only, deferrable
    settings, as the engine set them), made of keywords only."""
    from psycopg import IsolationLevel

    parts = ["BEGIN"]
    if raw.isolation_level is not None:
        level = IsolationLevel(raw.isolation_level).name.replace("_", " ")
        parts.append(f"ISOLATION LEVEL {level}")
    if raw.read_only is not None:
        parts.append("READ ONLY" if raw.read_only else "READ WRITE")
    if raw.deferrable is not None:
        parts.append("DEFERRABLE" if raw.deferrable else "NOT DEFERRABLE")
    return " ".join(parts)
