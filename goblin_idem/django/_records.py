"""``RECORDS: "django"``: the records in a Django database, committed with the view's ORM writes.

A `ThreadRecords` backend (`goblin_idem._threads._records`): every step runs in the request's
thread, on Django's connection of that thread for the records' alias
(``RECORDS_DATABASE``, ``"default"`` unless set). A keyed run's work is
``transaction.atomic(using=alias)``, entered before the view runs; the view's own
``atomic()`` blocks (and ``ATOMIC_REQUESTS``'s) nest in it as savepoints. Its commit:

- the record's row inserted in that transaction, over an expired row only (``INSERT ... ON
  CONFLICT (key) DO UPDATE ... WHERE expired RETURNING``, PostgreSQL and SQLite), then the
  atomic block left, which commits the view's writes and the row together, before any of
  the response leaves; ``transaction.on_commit`` callbacks run then, after the COMMIT;
- the key's unexpired row already there (another run committed first): nothing returned,
  so this run's transaction is rolled back and that run's record answered;
- the view's writes undone (its block marked for rollback, ATOMIC_REQUESTS' block
  around the view included, which Django rolls back to its savepoint before the run's
  commit: `DjangoWork._request_undone`): nothing commits, the record neither;
- proof of the COMMIT: a callback of this module's registered first with
  ``on_commit``, which Django runs only once the COMMIT has succeeded (an atomic block left
  on a connection closed in the transaction commits nothing, and says nothing).

Begun inside an atomic block of the caller's (django.test.TestCase wraps each test in
one), the run's block is a savepoint, released at its commit: that block commits it, or
rolls it back, and its on_commit callbacks run (or not) as that block decides.

Whatever ends the request, the atomic block is left rolling back in the request's thread
(`goblin_idem._threads._records`); a request without a claimed key gets none (`Unrecorded`).

No silent gap: while a run is under way, a write through another connection to the same
database in the request's thread (another alias naming it, or a connection the app made
with ``connections.create_connection`` or ``connection.copy()``, seen by Django's
``connection_created`` signal) commits apart from the record: Django's execute wrappers,
installed on those connections for the run only, log a WARNING once per route.
"""

from __future__ import annotations

import contextvars
import datetime
import logging
import sqlite3
import weakref
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from django.apps import apps  # type: ignore[import-untyped]
from django.conf import settings  # type: ignore[import-untyped]
from django.core.exceptions import ImproperlyConfigured  # type: ignore[import-untyped]
from django.db import (  # type: ignore[import-untyped]
    DEFAULT_DB_ALIAS,
    InterfaceError,
    OperationalError,
    connections,
    transaction,
)
from django.db.backends.signals import connection_created  # type: ignore[import-untyped]
from django.utils import timezone  # type: ignore[import-untyped]

from .._log import describe
from .._recording import RecordRow
from .._unavailable import sqlite_unavailable, sqlstate_unavailable
from ..exceptions import DatabaseUnavailableError, SqlRecordsError

__all__ = ["APP", "DjangoRecords", "unavailable"]

logger = logging.getLogger("goblin_idem.django")

APP = "goblin_idem.django"  # what INSTALLED_APPS names
VENDORS = ("postgresql", "sqlite")
COLUMNS = ("key", "key_hash", "fingerprint", "record", "created_at", "expires_at")
# The first words of the statements that write (a CTE is looked into).
WRITES = frozenset({"INSERT", "UPDATE", "DELETE", "MERGE", "REPLACE", "COPY", "TRUNCATE"})


def unavailable(exc: BaseException) -> bool:
    """Whether `exc` (or the driver's error it wraps) says the database is unavailable, not
    that this run failed: an OS error, Django's InterfaceError (a closed connection), a
    SQLSTATE of class 08, 53 or 57, a driver's OperationalError with no SQLSTATE (it could
    not connect, or lost the connection), SQLite busy, locked, unable to open, disk I/O or
    full. A serialization failure (40001) is not: the database answered."""
    error: BaseException | None = exc
    seen = 0
    while error is not None and seen < 6:
        seen += 1
        if isinstance(error, (OSError, InterfaceError)):
            return True
        if isinstance(error, sqlite3.OperationalError):
            return sqlite_unavailable(error)
        sqlstate = getattr(error, "sqlstate", None) or getattr(error, "pgcode", None)
        if isinstance(sqlstate, str):
            return sqlstate_unavailable(sqlstate)
        cause = error.__cause__
        if cause is None and isinstance(error, OperationalError):
            return True  # Django's own, of no driver error: its connection is unusable
        if cause is None and type(error).__name__ == "OperationalError":
            return True  # a driver's (psycopg's), with no SQLSTATE: connecting or lost
        error = cause
    return False


def unavailable_as(exc: BaseException, where: str) -> DatabaseUnavailableError | None:
    if isinstance(exc, DatabaseUnavailableError):
        return exc
    if not unavailable(exc):
        return None
    failure = DatabaseUnavailableError(f"the database is unavailable {where}: {describe(exc)}")
    failure.__cause__ = exc
    return failure


def _drop(conn: Any) -> None:
    """Close the thread's connection that met the database unavailable (at a lookup, the
    first statement of a keyed run), outside any atomic block, so the thread's next run
    connects anew. A thread that serves no Django request (a gRPC server's) has no
    ``request_finished`` to close it, and would otherwise meet the dead connection at every
    call."""
    if not conn.in_atomic_block:
        conn.close()


def _closed(conn: Any) -> bool:
    """Whether the driver's connection under Django's `conn` is closed (psycopg's and
    psycopg2's say so; SQLite's connection is never lost)."""
    raw = conn.connection
    return raw is not None and bool(getattr(raw, "closed", False))


def _database(alias: str) -> tuple[object, ...]:
    """What tells one database from another in `alias`'s settings (not its credentials)."""
    given = settings.DATABASES[alias]
    name = given.get("NAME")
    engine = str(given.get("ENGINE", ""))
    if engine.endswith("sqlite3") and isinstance(name, (str, Path)) and str(name) != ":memory:":
        name = str(Path(name).resolve())
    return engine, given.get("HOST") or "", str(given.get("PORT") or ""), str(name)


@dataclass(frozen=True)
class Statements:
    lookup: str
    upsert: str


class DjangoRecords:
    """Records in the Django database `using`, in goblin_idem.django's table (its migration
    applied there). Made by the middleware from ``settings.GOBLIN_IDEM``, or given to a
    sync gRPC server's ``IdempotencyInterceptor(store, records=DjangoRecords())``;
    `validate` raises ImproperlyConfigured, saying what to change, for what cannot work."""

    def __init__(self, using: str = DEFAULT_DB_ALIAS) -> None:
        if not isinstance(using, str) or not using:
            raise ImproperlyConfigured(
                "settings.GOBLIN_IDEM['RECORDS_DATABASE'] must name a database of "
                f"settings.DATABASES (a str such as 'default'), not {using!r}"
            )
        self.using = using
        self.where = f"Django database {using!r}"
        # The writes that join a run (read by the lapsed-claim log line, `_run`).
        self.joined = f"through Django's ORM on the database {using!r}"
        self._sql: Statements | None = None
        self._peers: list[str] | None = None  # the other aliases naming the same database

    def __repr__(self) -> str:
        return f"DjangoRecords(using={self.using!r})"

    def validate(self) -> None:
        """What can be known without asking the database: the app installed, the alias
        known, its vendor one whose upsert this module speaks."""
        key = "settings.GOBLIN_IDEM['RECORDS']"
        if not apps.is_installed(APP):
            raise ImproperlyConfigured(
                f"{key} is 'django', and the records' table belongs to the app {APP!r}, "
                f"which is not installed: add {APP!r} to INSTALLED_APPS, then run "
                "`python manage.py migrate goblin_idem`"
            )
        if self.using not in settings.DATABASES:
            raise ImproperlyConfigured(
                f"settings.GOBLIN_IDEM['RECORDS_DATABASE'] names the database {self.using!r}, "
                f"which settings.DATABASES does not define (it has: "
                f"{', '.join(map(repr, settings.DATABASES)) or 'none'}): name one of those"
            )
        vendor = connections[self.using].vendor
        if vendor not in VENDORS:
            raise ImproperlyConfigured(
                f"{key} is 'django', whose records need PostgreSQL or SQLite (INSERT ... ON "
                f"CONFLICT ... RETURNING), and the database {self.using!r} is {vendor}: set "
                "RECORDS_DATABASE to a PostgreSQL or SQLite database, or remove RECORDS (the "
                "store alone guards each key)"
            )
        if vendor == "sqlite" and sqlite3.sqlite_version_info < (3, 35):
            raise ImproperlyConfigured(
                f"{key} is 'django' on SQLite {sqlite3.sqlite_version}, which has no RETURNING: "
                "SQLite 3.35 or later is needed (a newer Python, or pysqlite3)"
            )

    # -- ThreadRecords (goblin_idem._threads._records) --

    def work(self, where: Callable[[], str] | None) -> DjangoWork | Unrecorded:
        """A keyed run's atomic block; a request without a claimed key, Django's own."""
        if where is None:
            return UNRECORDED
        if self._peers is None:
            mine = _database(self.using)
            others = (a for a in settings.DATABASES if a != self.using)
            self._peers = [a for a in others if _database(a) == mine]
        return DjangoWork(self, where, self._peers)

    def lookup(self, key: bytes) -> tuple[bytes, int] | None:
        """The key's unexpired record and the milliseconds it has left, asked in autocommit
        (the run's atomic block is not begun yet); DatabaseUnavailableError if the database
        could not be asked. Django's cursor, not a queryset: building the query cost ten
        times its round trip on SQLite (185 us against 16)."""
        conn = connections[self.using]
        now = timezone.now()
        try:
            with conn.cursor() as cursor:
                cursor.execute(self.sql().lookup, [key, conn.ops.adapt_datetimefield_value(now)])
                row = cursor.fetchone()
        except Exception as exc:
            failure = unavailable_as(exc, "for the record's lookup")
            if failure is None:
                raise
            _drop(conn)
            raise failure from exc
        if row is None:
            return None
        expires = row[1]
        if isinstance(expires, str):  # SQLite, without Django's converters
            expires = datetime.datetime.fromisoformat(expires)
        if timezone.is_aware(expires) and timezone.is_naive(now):  # USE_TZ off
            expires = timezone.make_naive(expires)
        elif timezone.is_naive(expires) and timezone.is_aware(now):  # SQLite stores UTC
            expires = expires.replace(tzinfo=datetime.timezone.utc)
        return bytes(row[0]), max(1, int((expires - now).total_seconds() * 1000))

    def sql(self) -> Statements:
        """The lookup, and the upsert of the module docstring, quoted for the alias's
        database; built once."""
        if self._sql is None:
            from .models import TABLE

            q = connections[self.using].ops.quote_name
            table = q(TABLE)
            columns = ", ".join(q(c) for c in COLUMNS)
            updated = ", ".join(f"{q(c)} = EXCLUDED.{q(c)}" for c in COLUMNS[1:])
            self._sql = Statements(
                lookup=(
                    f"SELECT {q('record')}, {q('expires_at')} FROM {table} "
                    f"WHERE {q('key')} = %s AND {q('expires_at')} > %s"
                ),
                upsert=(
                    f"INSERT INTO {table} ({columns}) VALUES (%s, %s, %s, %s, %s, %s) "
                    f"ON CONFLICT ({q('key')}) DO UPDATE SET {updated} "
                    f"WHERE {table}.{q('expires_at')} <= EXCLUDED.{q('created_at')} "
                    f"RETURNING {q('key')}"
                ),
            )
        return self._sql

    def check(self) -> str:
        """SqlRecordsError saying what to change unless the database answers and the table
        exists with its columns (its migration applied); else where records go. Run in a
        thread of its own, whose connection is closed after."""
        from .models import TABLE

        conn = connections[self.using]
        try:
            with conn.cursor() as cursor:
                found = TABLE in conn.introspection.table_names(cursor)
                columns = (
                    {c.name for c in conn.introspection.get_table_description(cursor, TABLE)}
                    if found
                    else set()
                )
        except Exception as exc:
            raise SqlRecordsError(
                f"goblin-idem records: cannot use the {self.where} ({describe(exc)}); start "
                f"it, or fix settings.DATABASES[{self.using!r}]"
            ) from exc
        finally:
            conn.close()
        if not found:
            raise SqlRecordsError(
                f"goblin-idem records: the table {TABLE!r} does not exist in the {self.where}: "
                f"apply goblin_idem's migration there (python manage.py migrate goblin_idem "
                f"--database {self.using})"
            )
        missing = sorted(set(COLUMNS) - columns)
        if missing:
            raise SqlRecordsError(
                f"goblin-idem records: the table {TABLE!r} in the {self.where} has another "
                f"shape (missing columns: {', '.join(missing)}): drop it and apply "
                "goblin_idem's migration (python manage.py migrate goblin_idem)"
            )
        return f"table {TABLE} in the {self.where}"

    def forget(self, key: bytes) -> bool:
        """Delete `key`'s record, expired or not; True if there was one. Run in a thread
        of its own, whose connection is closed after."""
        from .models import Record

        try:
            deleted, _ = Record.objects.using(self.using).filter(key=key).delete()
        finally:
            connections[self.using].close()
        return bool(deleted)

    def unavailable(self, exc: Exception) -> DatabaseUnavailableError | None:
        return unavailable_as(exc, "for the run's writes")


class Unrecorded:
    """The work of a request without a claimed key: nothing, so Django's own transaction
    handling (autocommit, ``ATOMIC_REQUESTS``) applies as it does without the middleware."""

    def begin(self) -> None:
        pass

    def enter(self) -> object:
        return None

    def leave(self, token: object) -> None:
        pass

    def commit(self, row: RecordRow) -> bytes | None:
        raise RuntimeError("a request without a claimed key has no record to commit")

    def commit_work(self) -> None:
        pass

    def rollback(self) -> None:
        pass


UNRECORDED = Unrecorded()

# The work of the run the request's thread is in (between its `enter` and `leave`).
_current: contextvars.ContextVar[DjangoWork | None] = contextvars.ContextVar(
    "goblin_idem_django_work", default=None
)


class _Rollback(Exception):
    """What the run's atomic block is left with to roll it back."""


class DjangoWork:
    """One keyed run's ``transaction.atomic(using=alias)``, in the request's thread."""

    __slots__ = (
        "atomic",
        "committed",
        "depth",
        "ended",
        "nested",
        "peers",
        "records",
        "undone",
        "watched",
        "where",
    )

    def __init__(self, records: DjangoRecords, where: Callable[[], str], peers: list[str]) -> None:
        self.records = records
        self.where = where
        self.peers = peers
        self.atomic: Any = None
        self.committed = False  # set by Django, after the COMMIT (`_committed`)
        self.nested = False  # begun inside an atomic block of the caller's (a TestCase's)
        self.ended = False
        self.watched: list[Any] = []  # connections whose writes are watched during the run
        self.depth = -1  # the run's block's savepoints, with ATOMIC_REQUESTS (`_request_undone`)
        self.undone = False  # ATOMIC_REQUESTS' block, in the run's, rolled back

    def begin(self) -> None:
        """Enter the run's atomic block (BEGIN, on the thread's connection; connecting if it
        must, so a database down is met here), before the view runs."""
        atomic = transaction.atomic(using=self.records.using)
        self.nested = connections[self.records.using].in_atomic_block
        atomic.__enter__()
        self.atomic = atomic
        transaction.on_commit(self._committed, using=self.records.using)  # the first callback
        conn = connections[self.records.using]
        if conn.settings_dict.get("ATOMIC_REQUESTS"):
            self.depth = len(conn.savepoint_ids)
            conn.execute_wrappers.append(self._request_undone)
        for alias in self.peers:
            self.watch(connections[alias])

    def _committed(self) -> None:
        self.committed = True

    def enter(self) -> object:
        return _current.set(self)

    def leave(self, token: object) -> None:
        _current.reset(token)  # type: ignore[arg-type]

    def commit(self, row: RecordRow) -> bytes | None:
        """`ThreadWork.commit`: `row` inserted in the run's transaction, then the atomic
        block left (the app's on_commit callbacks run after the COMMIT)."""
        if self.ended:
            raise RuntimeError("the run's transaction has ended: nothing of it can commit")
        conn = connections[self.records.using]
        try:
            if conn.needs_rollback and _closed(conn):
                raise DatabaseUnavailableError(
                    "the database is unavailable at the run's commit: its connection was "
                    "lost (the view caught the error, which marked its transaction for "
                    "rollback), so nothing of the run commits"
                )
            if conn.needs_rollback or not conn.in_atomic_block or self.undone:
                raise RuntimeError(
                    "the run's transaction was marked for rollback by the view (an error "
                    "caught inside atomic(), or set_rollback(True), ATOMIC_REQUESTS' block "
                    "included): its writes are undone, so nothing of the run commits"
                )
            now = timezone.now()
            adapt = conn.ops.adapt_datetimefield_value
            expires = now + datetime.timedelta(milliseconds=row.ttl_ms)
            with conn.cursor() as cursor:
                cursor.execute(
                    self.records.sql().upsert,
                    [row.key, row.key_hash, row.fp, row.data, adapt(now), adapt(expires)],
                )
                inserted = cursor.fetchone() is not None
        except Exception as exc:
            failure = unavailable_as(exc, "at the run's commit")
            self.rollback()
            if failure is None:
                raise
            raise failure from exc
        if not inserted:
            self.rollback()
            found = self.records.lookup(row.key)
            if found is None:  # expired between the two: nothing to replay
                raise RuntimeError(f"the record of key {row.key_hash} expired meanwhile")
            return found[0]
        self._leave_atomic(None)
        return None

    def commit_work(self) -> None:
        raise RuntimeError("a keyed run commits with its record")

    def rollback(self) -> None:
        """Leave the atomic block rolling back (nothing, after a commit); safe to repeat."""
        if not self.ended and self.atomic is not None:
            self._leave_atomic(_Rollback)

    def _leave_atomic(self, error: type[_Rollback] | None) -> None:
        """Leave the run's atomic block: committing (`error` None) or rolling back. Django
        closes a connection it could not roll back, so the thread's next request starts
        clean. A commit's failure raises here; the app's on_commit callbacks run after a
        COMMIT and one that raises does not undo it (logged)."""
        self.ended = True
        self._unwatch()
        atomic, self.atomic = self.atomic, None
        try:
            atomic.__exit__(error, error() if error else None, None)
        except Exception as exc:
            if not self.committed:
                if error is not None:  # a rollback that failed: the connection is closed
                    logger.warning("could not roll back the run's transaction: %s", describe(exc))
                    return
                failure = unavailable_as(exc, "at the run's commit")
                if failure is None:
                    raise
                raise failure from exc
            connections[self.records.using].run_commit_hooks_on_set_autocommit_on = False
            logger.exception(
                "%s: an on_commit callback raised after the run committed its writes and "
                "record (the response stands; the callbacks after it did not run)",
                self.where(),
            )
            return
        if error is None and self.nested:
            self.committed = True  # a savepoint released: the caller's block commits it
        if error is None and not self.committed:
            raise DatabaseUnavailableError(
                "the database is unavailable at the run's commit: its connection was closed "
                "in the transaction, so nothing committed"
            )

    # -- the gap: writes on the same database that are not the run's --

    def watch(self, conn: Any) -> None:
        if conn not in self.watched:
            conn.execute_wrappers.append(self._write_outside)
            self.watched.append(conn)

    def _unwatch(self) -> None:
        for conn in self.watched:
            if self._write_outside in conn.execute_wrappers:
                conn.execute_wrappers.remove(self._write_outside)
        self.watched.clear()
        if self.depth >= 0:
            wrappers = connections[self.records.using].execute_wrappers
            if self._request_undone in wrappers:
                wrappers.remove(self._request_undone)

    def _request_undone(
        self, execute: Callable[..., Any], sql: str, params: Any, many: bool, context: Any
    ) -> Any:
        """With ATOMIC_REQUESTS, Django wraps the view in an atomic block of its own, a
        savepoint directly inside the run's block: a view that marks it for rollback
        (set_rollback(True)) has it rolled back to its savepoint when the view returns, and
        the mark is gone by the run's commit. Django's ROLLBACK TO SAVEPOINT of that block
        (the one at the run's depth, popped just before) is what tells; deeper ones are
        the view's own blocks, whose failures it handled."""
        if sql.startswith("ROLLBACK TO SAVEPOINT"):
            if len(context["connection"].savepoint_ids) == self.depth:
                self.undone = True
        return execute(sql, params, many, context)

    def _write_outside(
        self, execute: Callable[..., Any], sql: str, params: Any, many: bool, context: Any
    ) -> Any:
        if not self.ended and _writes(sql):
            _tell_gap(self, context["connection"].alias)
        return execute(sql, params, many, context)


def _writes(sql: str) -> bool:
    head = sql.lstrip()[:9].upper()
    word = head.split(None, 1)[0] if head else ""
    if word == "WITH":
        upper = sql.upper()
        return any(f"{w} " in upper for w in ("INSERT", "UPDATE", "DELETE"))
    return word in WRITES


# The routes whose writes outside the run were logged, per records.
_gaps_told: weakref.WeakKeyDictionary[DjangoRecords, set[str]] = weakref.WeakKeyDictionary()


def _tell_gap(work: DjangoWork, alias: str) -> None:
    where = work.where()
    told = _gaps_told.setdefault(work.records, set())
    if where in told:
        return
    told.add(where)
    using = work.records.using
    logger.warning(
        "%s: a write on the records' database (Django database %r) through a connection "
        "that is not the run's (of alias %r: another alias naming that database, or a "
        "connection the app made itself): it commits apart from the record, so "
        "the idempotency key does not cover it (a claim lost mid-run can make it twice, and "
        "it stays when the run fails). Write through the alias %r (the default manager, or "
        ".using(%r)) so that it commits with the record. Logged once for this route.",
        where,
        using,
        alias,
        using,
        using,
    )


def _created(sender: object, connection: Any, **kwargs: object) -> None:
    """A connection opened while a run is current in this thread: watched if it is to the
    records' database and is not the run's (one context variable read otherwise)."""
    work = _current.get()
    if work is None or work.ended:
        return
    using = work.records.using
    if connection is connections[using]:
        return
    try:
        same = _database(connection.alias) == _database(using)
    except KeyError:  # an alias that settings.DATABASES does not hold
        same = False
    if same:
        work.watch(connection)


connection_created.connect(_created, dispatch_uid="goblin_idem.django.records")
