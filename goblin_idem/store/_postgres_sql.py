"""The GOBLIN commands as SQL: one statement per step, on one table of string keys.

The table holds what a Redis keyspace of strings holds: ``key bytea`` (primary key),
``value bytea``, and ``expires_at bigint``, the deadline in milliseconds since the epoch on
the database server's clock (NULL: no TTL). A row whose deadline passed is absent to every
statement at once (each reads ``expires_at > now``), and is deleted in the background by
`PURGE` in small batches, found by the partial index on ``expires_at``.

Every statement reads the time once, ``statement_timestamp()``: the server's clock, never a
client's, so a process whose clock is off can neither steal a live claim nor keep a dead
one; and one instant for the whole statement, so a row cannot be live for one half of a
statement and expired for the other (``clock_timestamp()`` moves while a statement runs).

The arguments come first, once each and in order, in the CTE ``a``: so the same text runs
with asyncpg's ``$n`` and, with each ``$n`` replaced by ``%s``, with psycopg's.

Each statement runs alone in autocommit (its own transaction, no session state, so
PgBouncer in transaction mode is fine). Under READ COMMITTED an UPDATE re-checks its WHERE on
the row's latest committed version once it holds the row's lock, and an INSERT ... ON
CONFLICT sees every committed or in-progress row of its key: of concurrent claims of one
key exactly one takes it (`Statements._take`), and the others see it held.
"""

from __future__ import annotations

import re
from dataclasses import dataclass
from typing import Final

__all__ = ["DEFAULT_TABLE", "Statement", "Statements", "check_table", "ddl"]

DEFAULT_TABLE: Final = "goblin_idem_keys"
_IDENTIFIER: Final = re.compile(r"[A-Za-z_][A-Za-z0-9_]{0,62}(\.[A-Za-z_][A-Za-z0-9_]{0,62})?")
# The server's now, in ms since the epoch (one value per statement).
_NOW: Final = "(extract(epoch FROM statement_timestamp()) * 1000)::bigint"
# A live row: no deadline, or one still ahead.
_LIVE: Final = "(t.expires_at IS NULL OR t.expires_at > a.now)"


def check_table(table: object) -> str:
    """A table name is spliced into SQL, so only a plain identifier (or schema.table) is
    accepted: never anything an attacker could choose."""
    if not isinstance(table, str) or not _IDENTIFIER.fullmatch(table):
        raise ValueError(
            f"table must be a plain SQL identifier such as {DEFAULT_TABLE!r} or "
            f"'schema.{DEFAULT_TABLE}' (letters, digits, underscores), not {table!r}"
        )
    return table


def ddl(table: str = DEFAULT_TABLE) -> str:
    """The table and its index, idempotent: what `PostgresStore.create_table` runs and
    ``python -m goblin_idem postgres-ddl`` prints for a migration tool."""
    table = check_table(table)
    index = table.rsplit(".", 1)[-1] + "_expires_at"
    return (
        f"CREATE TABLE IF NOT EXISTS {table} (\n"
        "    key bytea PRIMARY KEY,\n"
        "    value bytea NOT NULL,\n"
        "    expires_at bigint  -- ms since the epoch, the server's clock; NULL: no TTL\n"
        ");\n"
        f"CREATE INDEX IF NOT EXISTS {index} ON {table} (expires_at)"
        " WHERE expires_at IS NOT NULL;\n"
        # Stored responses come compressed already: PostgreSQL's own compression of a
        # large value would cost time for nothing.
        f"ALTER TABLE {table} ALTER COLUMN value SET STORAGE EXTERNAL;\n"
    )


def _deadline(ms: str) -> str:
    """now + ms, held to the bigint range (a lease the client let through may not fit with
    the server's now, if the client's clock runs behind the server's)."""
    return f"LEAST(a.now::numeric + {ms}, 9223372036854775807)::bigint"


@dataclass(frozen=True)
class Statement:
    """One statement's text for asyncpg (``$n``) and for psycopg (``%s``)."""

    asyncpg: str
    psycopg: str

    @classmethod
    def of(cls, sql: str) -> Statement:
        return cls(sql, re.sub(r"\$\d+", "%s", sql))


class Statements:
    """Every statement the store sends, for one table."""

    def _take(self, token: str, deadline: str) -> str:
        """The CTEs that take the claim ``a.ck`` if it is free: `taken`, an expired row
        rewritten, `inserted`, an absent one written; at most one of them has a row.

        A live claim is neither written nor locked (UPDATE skips a row its WHERE rejects,
        and ON CONFLICT DO NOTHING locks nothing), so a replay or an in-flight duplicate
        writes nothing and commits without waiting for the WAL to reach the disk. Two
        claims of one expired row: the second waits for the first's row lock, then finds
        the row live and skips it; two of an absent key: the second's insert conflicts."""
        t = self.table
        return (
            f" taken AS (UPDATE {t} AS t SET value = {token}, expires_at = {deadline} FROM a"
            " WHERE t.key = a.ck AND t.expires_at <= a.now RETURNING 1),"
            f" inserted AS (INSERT INTO {t} AS t (key, value, expires_at)"
            f" SELECT a.ck, {token}, {deadline} FROM a"
            " ON CONFLICT (key) DO NOTHING RETURNING 1)"
        )

    def __init__(self, table: str = DEFAULT_TABLE) -> None:
        t = check_table(table)
        self.table = t
        self.ddl = ddl(t)
        self._steps(t)
        self._conditional(t)
        self._plain(t)

    def _steps(self, t: str) -> None:
        """A run's steps: CLAIM, CLAIM where a stored result wins, and publish."""
        # CLAIM: SET claim token NX PX lease, else GET result. Replies (won, result): the
        # result as the statement's snapshot had it (read only when the claim was held).
        self.claim = Statement.of(
            f"WITH a AS (SELECT $1::bytea AS ck, $2::bytea AS rk, $3::bytea AS tok,"
            f" $4::bigint AS lease, {_NOW} AS now),"
            f"{self._take('a.tok', _deadline('a.lease'))}"
            " SELECT EXISTS (SELECT 1 FROM taken) OR EXISTS (SELECT 1 FROM inserted),"
            f" (SELECT t.value FROM {t} AS t, a WHERE t.key = a.rk AND {_LIVE})"
        )
        # CLAIM where a stored result wins: the claim, if won, lasts as long as the result
        # it found (a lease at least). Replies (won, result).
        self.claim_unless_done = Statement.of(
            f"WITH a AS (SELECT $1::bytea AS ck, $2::bytea AS rk, $3::bytea AS tok,"
            f" $4::bigint AS lease, {_NOW} AS now),"
            f" res AS (SELECT t.value, t.expires_at FROM {t} AS t, a"
            f" WHERE t.key = a.rk AND {_LIVE}),"
            + self._take("a.tok", f"GREATEST({_deadline('a.lease')}, (SELECT expires_at FROM res))")
            + " SELECT EXISTS (SELECT 1 FROM taken) OR EXISTS (SELECT 1 FROM inserted),"
            " (SELECT value FROM res)"
        )
        # Publish: SET result value PX ttl NX, and CAEXPIRE claim token ttl, as one
        # statement. A live result is locked and kept as it is (the upsert rewrites it
        # unchanged), so the reply says which value stands: (same, its deadline, renewed).
        # The claim lasts as long as the result that stands. Claim and result must differ.
        self.publish = Statement.of(
            f"WITH a AS (SELECT $1::bytea AS rk, $2::bytea AS v, $3::bigint AS ttl,"
            f" $4::bytea AS ck, $5::bytea AS tok, {_NOW} AS now),"
            f" res AS (INSERT INTO {t} AS t (key, value, expires_at)"
            f" SELECT a.rk, a.v, {_deadline('a.ttl')} FROM a"
            " ON CONFLICT (key) DO UPDATE SET"
            " value = CASE WHEN t.expires_at <= (SELECT now FROM a)"
            " THEN EXCLUDED.value ELSE t.value END,"
            " expires_at = CASE WHEN t.expires_at <= (SELECT now FROM a)"
            " THEN EXCLUDED.expires_at ELSE t.expires_at END"
            " RETURNING t.value = (SELECT v FROM a) AS same, t.expires_at),"
            f" renewed AS (UPDATE {t} AS t SET expires_at = CASE WHEN res.same"
            f" THEN {_deadline('a.ttl')} ELSE COALESCE(res.expires_at, {_deadline('a.ttl')}) END"
            f" FROM a, res WHERE t.key = a.ck AND t.value = a.tok AND {_LIVE} RETURNING 1)"
            " SELECT res.same, EXISTS (SELECT 1 FROM renewed) FROM res"
        )

    def _conditional(self, t: str) -> None:
        """What changes a row only where it holds a token: CAEXPIRE, CAD, CAS, FORGET."""
        # CAEXPIRE with ms > 0: the new deadline, only on a live row holding the token.
        self.caexpire = Statement.of(
            f"WITH a AS (SELECT $1::bytea AS k, $2::bytea AS e, $3::bigint AS ms, {_NOW} AS now)"
            f" UPDATE {t} AS t SET expires_at = {_deadline('a.ms')} FROM a"
            f" WHERE t.key = a.k AND t.value = a.e AND {_LIVE} RETURNING 1"
        )
        # CAEXPIRE with ms <= 0 and CAD: delete a live row holding the token.
        self.cad = Statement.of(
            f"WITH a AS (SELECT $1::bytea AS k, $2::bytea AS e, {_NOW} AS now)"
            f" DELETE FROM {t} AS t USING a"
            f" WHERE t.key = a.k AND t.value = a.e AND {_LIVE} RETURNING 1"
        )
        # CAEXPIRE of many (key, token, ms > 0) at once: the (key, token) pairs renewed.
        self.caexpire_many = Statement.of(
            f"WITH a AS (SELECT {_NOW} AS now),"
            " v AS (SELECT * FROM unnest($1::bytea[], $2::bytea[], $3::bigint[]) AS v(k, e, ms))"
            f" UPDATE {t} AS t SET expires_at = {_deadline('v.ms')} FROM a, v"
            f" WHERE t.key = v.k AND t.value = v.e AND {_LIVE} RETURNING t.key, t.value"
        )
        # CAS: the value swapped on a live row holding `expected`; the deadline kept.
        self.cas = Statement.of(
            f"WITH a AS (SELECT $1::bytea AS k, $2::bytea AS e, $3::bytea AS n, {_NOW} AS now)"
            f" UPDATE {t} AS t SET value = a.n FROM a"
            f" WHERE t.key = a.k AND t.value = a.e AND {_LIVE} RETURNING 1"
        )
        # FORGET: unless a run holds the claim (it is live, holds another token than
        # `expected`, and no result is stored), delete the result, the others and the
        # claim; the claim row is locked meanwhile. Replies -1 (held, nothing deleted) or
        # the count of live keys deleted. Rows written after the statement began are not
        # seen, so are not deleted: a claim taken meanwhile stands.
        self.forget = Statement.of(
            f"WITH a AS (SELECT $1::bytea AS ck, $2::bytea AS rk, $3::bytea[] AS others,"
            f" $4::bytea AS expected, {_NOW} AS now),"
            f" c AS (SELECT t.value FROM {t} AS t, a WHERE t.key = a.ck AND {_LIVE} FOR UPDATE),"
            " held AS (SELECT EXISTS (SELECT 1 FROM c, a"
            " WHERE a.expected IS NULL OR c.value <> a.expected)"
            f" AND NOT EXISTS (SELECT 1 FROM {t} AS t, a WHERE t.key = a.rk AND {_LIVE})"
            " AS held),"
            f" gone AS (DELETE FROM {t} AS t USING a, held WHERE NOT held.held"
            f" AND t.key = ANY (ARRAY[a.ck, a.rk] || a.others) RETURNING {_LIVE} AS live)"
            " SELECT CASE WHEN held.held THEN -1"
            " ELSE (SELECT count(*) FROM gone WHERE live) END FROM held"
        )

    def _plain(self, t: str) -> None:
        """The plain commands (GET, SET, SET NX, PTTL, DEL), and one batch of the purge."""
        self.get = Statement.of(
            f"WITH a AS (SELECT $1::bytea AS k, {_NOW} AS now)"
            f" SELECT t.value FROM {t} AS t, a WHERE t.key = a.k AND {_LIVE}"
        )
        # SET key value [PX ms] (ms NULL: no TTL, the old one dropped, as SET does).
        self.set = Statement.of(
            f"WITH a AS (SELECT $1::bytea AS k, $2::bytea AS v, $3::bigint AS ms, {_NOW} AS now)"
            f" INSERT INTO {t} AS t (key, value, expires_at)"
            f" SELECT a.k, a.v, CASE WHEN a.ms IS NULL THEN NULL ELSE {_deadline('a.ms')} END"
            " FROM a ON CONFLICT (key) DO UPDATE SET value = EXCLUDED.value,"
            " expires_at = EXCLUDED.expires_at RETURNING 1"
        )
        # SET ... NX: written only over an absent or expired row; replies a row if written.
        self.set_nx = Statement.of(
            f"WITH a AS (SELECT $1::bytea AS k, $2::bytea AS v, $3::bigint AS ms, {_NOW} AS now)"
            f" INSERT INTO {t} AS t (key, value, expires_at)"
            f" SELECT a.k, a.v, CASE WHEN a.ms IS NULL THEN NULL ELSE {_deadline('a.ms')} END"
            " FROM a ON CONFLICT (key) DO UPDATE SET value = EXCLUDED.value,"
            " expires_at = EXCLUDED.expires_at"
            " WHERE t.expires_at <= (SELECT now FROM a) RETURNING 1"
        )
        # PTTL, by the server's clock: -1 without TTL, no row for a missing key.
        self.pttl = Statement.of(
            f"WITH a AS (SELECT $1::bytea AS k, {_NOW} AS now)"
            " SELECT CASE WHEN t.expires_at IS NULL THEN -1"
            f" ELSE t.expires_at - a.now END FROM {t} AS t, a WHERE t.key = a.k AND {_LIVE}"
        )
        # DEL: the rows named go, expired ones too; the count is of the live ones.
        self.delete = Statement.of(
            f"WITH a AS (SELECT $1::bytea[] AS ks, {_NOW} AS now)"
            f" DELETE FROM {t} AS t USING a WHERE t.key = ANY (a.ks) RETURNING {_LIVE}"
        )
        # One batch of the purge: expired rows not locked by anyone, by the index.
        # Replies the count of rows deleted.
        self.purge = Statement.of(
            f"WITH a AS (SELECT $1::bigint AS batch, {_NOW} AS now),"
            f" gone AS (DELETE FROM {t} AS t USING a WHERE t.ctid IN (SELECT ctid FROM {t}"
            " WHERE expires_at <= (SELECT now FROM a) ORDER BY expires_at"
            " LIMIT (SELECT batch FROM a) FOR UPDATE SKIP LOCKED)"
            " AND t.expires_at <= a.now RETURNING 1)"
            " SELECT count(*) FROM gone"
        )
