"""`RecordsTable`: the records' table and every statement on it, which the async
`SqlRecords` (`_records`) and `SyncSqlRecords` (`_sync_records`) share, in a module below
both, so that neither imports the other to get it."""

from __future__ import annotations

import datetime
from collections.abc import Callable
from typing import Any, TypeVar

from sqlalchemy import (
    Column,
    DateTime,
    LargeBinary,
    MetaData,
    String,
    Table,
    bindparam,
    delete,
    inspect,
    select,
)
from sqlalchemy.engine import Connection, make_url
from sqlalchemy.exc import ArgumentError, InvalidRequestError

from .._log import describe
from .._recording import RecordRow
from ..exceptions import SqlRecordsError

__all__ = ["DEFAULT_TABLE", "PURGE_BATCH", "RecordsTable"]

DEFAULT_TABLE = "goblin_idem_records"
DIALECTS = ("postgresql", "sqlite")
PURGE_BATCH = 1000  # rows deleted per transaction: short locks on a busy table

# The lookup and the upsert as asyncpg takes them (the statements `RecordsTable` builds, in
# PostgreSQL's words): a row only if the key had none, or an expired one.
LOOKUP_SQL = "SELECT record, expires_at FROM {table} WHERE key = $1 AND expires_at > $2"
LOOKUP_SQL_PSYCOPG = LOOKUP_SQL.replace("$1", "%s").replace("$2", "%s")
# asyncpg's commit in one round trip (`_drivers.in_one`): placeholders filled with hex
# digits and ISO timestamps only; {{table}} is the quoted table name, filled first.
IN_ONE_SQL = (
    "DELETE FROM {table} WHERE key = decode('{{key}}', 'hex') "
    "AND expires_at <= '{{now}}'::timestamptz; "
    "INSERT INTO {table} (key, key_hash, fingerprint, record, created_at, expires_at) "
    "VALUES (decode('{{key}}', 'hex'), '{{key_hash}}', decode('{{fp}}', 'hex'), "
    "decode('{{record}}', 'hex'), '{{now}}'::timestamptz, '{{expires}}'::timestamptz); "
    "COMMIT"
)
IN_ONE_MAX = 256 * 1024  # a larger record goes as a parameter (its hex text is twice its size)
# psycopg's lookup that begins the run's transaction (`_psycopg.lookup_text`): {begin} is
# the BEGIN psycopg would send, the rest literals as in IN_ONE_SQL.
LOOKUP_BEGIN_SQL = (
    "{begin}; SELECT record, expires_at FROM {table} WHERE key = decode('{key}', 'hex') "
    "AND expires_at > '{now}'::timestamptz"
)
UPSERT_SQL = (
    "INSERT INTO {table} (key, key_hash, fingerprint, record, created_at, expires_at) "
    "VALUES ($1, $2, $3, $4, $5, $6) ON CONFLICT (key) DO UPDATE SET "
    "key_hash = EXCLUDED.key_hash, fingerprint = EXCLUDED.fingerprint, "
    "record = EXCLUDED.record, created_at = EXCLUDED.created_at, "
    "expires_at = EXCLUDED.expires_at WHERE {table}.expires_at <= EXCLUDED.created_at "
    "RETURNING key"
)

E = TypeVar("E")  # an engine, sync or async


def _utcnow() -> datetime.datetime:
    return datetime.datetime.now(datetime.timezone.utc)


class RecordsTable:
    """What `SqlRecords` and `SyncSqlRecords` share: the table, the statements on it (a
    run's lookup and insert, forget, purge), the URL that logs show, and what a check says
    of a table that is missing or of another shape. One definition, so both write the same
    rows."""

    def __init__(self, url: str, table: str) -> None:
        try:
            parsed = make_url(url)
        except ArgumentError as exc:
            raise ValueError(f"{type(self).__name__}: not a database URL: {exc}") from None
        if parsed.get_backend_name() not in DIALECTS:
            raise ValueError(
                f"{type(self).__name__} supports PostgreSQL and SQLite, not "
                f"{parsed.get_backend_name()}"
            )
        if not isinstance(table, str) or not table:
            raise TypeError("table must be a non-empty str")
        self.where = parsed.render_as_string(hide_password=True)
        self.metadata = MetaData()
        self.table = Table(
            table,
            self.metadata,
            Column("key", LargeBinary(255), primary_key=True),
            Column("key_hash", String(64), nullable=False),
            Column("fingerprint", LargeBinary(16), nullable=False),
            Column("record", LargeBinary, nullable=False),
            Column("created_at", DateTime(timezone=True), nullable=False),
            Column("expires_at", DateTime(timezone=True), nullable=False, index=True),
        )
        # The statements a run executes, built once: building one costs more than its
        # round trip (SQLAlchemy coerces every clause), compiling it is cached per dialect.
        t = self.table
        self._lookup = select(t.c.record, t.c.expires_at).where(
            t.c.key == bindparam("wanted"), t.c.expires_at > bindparam("now")
        )
        self._upserts: dict[str, Any] = {}

    def _upsert(self, dialect: str) -> Any:
        """INSERT ... ON CONFLICT (key) DO UPDATE ... WHERE the row has expired, RETURNING
        key: a row only if the key had none, or an expired one. Built once per dialect."""
        statement = self._upserts.get(dialect)
        if statement is not None:
            return statement
        insert: Any
        if dialect == "postgresql":
            from sqlalchemy.dialects.postgresql import insert
        else:
            from sqlalchemy.dialects.sqlite import insert
        t = self.table
        upsert = insert(t)
        updated = [c.name for c in t.columns if c.name != "key"]
        statement = upsert.on_conflict_do_update(
            index_elements=[t.c.key],
            set_={name: upsert.excluded[name] for name in updated},
            where=t.c.expires_at <= upsert.excluded.created_at,
        ).returning(t.c.key)
        self._upserts[dialect] = statement
        return statement

    def _forget(self, key: bytes) -> Any:
        """The DELETE of `key`'s row, expired or not."""
        return delete(self.table).where(self.table.c.key == key)

    def _purge(self, batch: object) -> Any:
        """The DELETE of up to `batch` expired rows (one short transaction each); ValueError
        unless `batch` is a whole number >= 1."""
        if isinstance(batch, bool) or not isinstance(batch, int) or batch < 1:
            raise ValueError(f"batch must be a whole number >= 1, got {batch!r}")
        t = self.table
        expired = select(t.c.key).where(t.c.expires_at <= _utcnow()).limit(batch)
        return delete(t).where(t.c.key.in_(expired.scalar_subquery()))

    def _sql(self, conn: Any, text: str) -> str:
        """`text` (one of the statements above) with this table's name, quoted as `conn`'s
        dialect quotes it."""
        return text.format(table=conn.dialect.identifier_preparer.format_table(self.table))

    @staticmethod
    def _row(row: RecordRow) -> dict[str, Any]:
        """The record's row, committed now, expiring in its `ttl_ms`."""
        now = _utcnow()
        return {
            "key": row.key,
            "key_hash": row.key_hash,
            "fingerprint": row.fp,
            "record": row.data,
            "created_at": now,
            "expires_at": now + datetime.timedelta(milliseconds=row.ttl_ms),
        }

    def _in_one(self, dialect: Any, row: RecordRow) -> str | None:
        """IN_ONE_SQL for `row`: the expired row's DELETE, the INSERT and COMMIT as one text
        (one round trip, one query), its values written as hex digits and ISO timestamps
        only, never text from outside; None if the record is too large to send as hex."""
        if len(row.data) > IN_ONE_MAX:
            return None
        if not row.key_hash.isascii() or not row.key_hash.isalnum():
            return None  # never the case (a hex digest), but a literal must hold no quote
        now = _utcnow()
        expires = now + datetime.timedelta(milliseconds=row.ttl_ms)
        table = dialect.identifier_preparer.format_table(self.table)
        return IN_ONE_SQL.format(table=table.replace("{", "{{").replace("}", "}}")).format(
            key=row.key.hex(),
            key_hash=row.key_hash,
            fp=row.fp.hex(),
            record=row.data.hex(),
            now=now.isoformat(),
            expires=expires.isoformat(),
        )

    def _lookup_begun(self, dialect: Any, begin: str, key: bytes, now: datetime.datetime) -> str:
        """LOOKUP_BEGIN_SQL for `key`: `begin` (made of keywords only) and the lookup."""
        table = dialect.identifier_preparer.format_table(self.table)
        return LOOKUP_BEGIN_SQL.format(begin=begin, table=table, key=key.hex(), now=now.isoformat())

    def _pipeline(self, dialect: Any, row: RecordRow) -> list[tuple[str, tuple[Any, ...] | None]]:
        """What psycopg's pipeline sends to commit the record with the run's writes: the
        key's expired row deleted, the row inserted (the primary key refuses an unexpired
        one, which aborts what follows), and a COMMIT statement, not the driver's commit(),
        which would sync the pipeline (a second round trip)."""
        table = dialect.identifier_preparer.format_table(self.table)
        now = _utcnow()
        expires = now + datetime.timedelta(milliseconds=row.ttl_ms)
        return [
            (f"DELETE FROM {table} WHERE key = %s AND expires_at <= %s", (row.key, now)),
            (
                f"INSERT INTO {table} (key, key_hash, fingerprint, record, created_at, "
                "expires_at) VALUES (%s, %s, %s, %s, %s, %s)",
                (row.key, row.key_hash, row.fp, row.data, now, expires),
            ),
            ("COMMIT", None),
        ]

    @staticmethod
    def _found(row: Any, now: datetime.datetime) -> tuple[bytes, int] | None:
        """A lookup's row as the record and the milliseconds it has left."""
        if row is None:
            return None
        expires = row[1] if row[1].tzinfo else row[1].replace(tzinfo=datetime.timezone.utc)
        return bytes(row[0]), max(1, int((expires - now).total_seconds() * 1000))

    def _engine_made(self, make: Callable[[], E], drivers: str) -> E:
        """The engine `make` returns, made now (which imports its driver); SqlRecordsError
        saying what to install, or which driver to name (`drivers`), if it cannot be."""
        try:
            return make()
        except ModuleNotFoundError as exc:
            raise SqlRecordsError(
                f"goblin-idem records: the database driver {exc.name!r} is not installed: "
                f"install it (pip install {exc.name}), or name an installed driver in the URL "
                f"{self.where}"
            ) from exc
        except InvalidRequestError as exc:
            raise SqlRecordsError(f"goblin-idem records: {exc}: name {drivers}") from exc

    def _unreachable(self, exc: Exception) -> SqlRecordsError:
        """What check() says of a database it could not ask."""
        return SqlRecordsError(
            f"goblin-idem records: cannot use the database at {self.where} "
            f"({describe(exc)}); start it, or fix the URL"
        )

    def _taken(self, exc: Any) -> bool:
        """Whether psycopg's UniqueViolation `exc` is this table's key (another run committed
        the key first), not an app's own constraint checked at COMMIT (its error stands)."""
        return bool(exc.diag.table_name == self.table.name)

    def _shaped(self, columns: tuple[set[str], list[str]] | None, create: str) -> str:
        """What check() says: raise SqlRecordsError unless the table exists with this
        release's columns (`columns` as `_shape` found them); `create` is how to make it."""
        name = self.table.name
        if columns is None:
            raise SqlRecordsError(
                f"goblin-idem records: the table {name!r} does not exist in {self.where}: "
                f"create it with `{create}` (or from `records.table` in a migration), or pass "
                "table= the name of the one you created"
            )
        expected = {c.name for c in self.table.columns}
        missing = sorted(expected - columns[0])
        if missing or columns[1] != ["key"]:
            raise SqlRecordsError(
                f"goblin-idem records: the table {name!r} in {self.where} has another shape "
                f"(missing columns: {', '.join(missing) or 'none'}; primary key: "
                f"{', '.join(columns[1]) or 'none'}, should be key): create the table from "
                f"`records.table` (`{create}`), or pass table= another name"
            )
        return f"table {name} in {self.where}"


def _shape(conn: Connection, name: str) -> tuple[set[str], list[str]] | None:
    """The table's column names and primary key, or None if there is no such table."""
    inspector = inspect(conn)
    if not inspector.has_table(name):
        return None
    columns = {c["name"] for c in inspector.get_columns(name)}
    primary = list(inspector.get_pk_constraint(name).get("constrained_columns") or [])
    return columns, primary
