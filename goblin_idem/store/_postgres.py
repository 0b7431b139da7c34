"""PostgresStore: the GOBLIN commands made by SQL, for services whose only server is their
database.

Every step is one statement, one round trip (`_postgres_sql` has them and says why each is
atomic); time is the database server's; an expired row is absent at once and deleted in
the background in small batches. The table holds strings only: the spec's rows about a key
of another type (WRONGTYPE) do not apply, as for MemoryStore.
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
import os
import weakref
from collections.abc import Sequence
from typing import Any

from redis.exceptions import ResponseError

from ._arguments import (
    DEFAULT_MAX_VALUE_BYTES,
    WRITTEN,
    as_bytes,
    caexpire_ms,
    check_size,
    claim_reply,
    claim_seconds,
    publish_ttl,
    set_ttl_ms,
)
from ._postgres_pool import Driver, driver_for_engine, driver_for_url
from ._postgres_sql import DEFAULT_TABLE, Statements
from ._protocol import CLAIMED, ClaimReply, KeyT, Published

__all__ = ["PostgresStore"]

logger = logging.getLogger("goblin_idem.store")

#: Rows one purge statement deletes at most: a short statement, locks on few rows.
PURGE_BATCH = 1000


class PostgresStore:
    """The four GOBLIN commands and plain GET/SET/PTTL/DEL on a PostgreSQL table.

    ``PostgresStore.from_url("postgresql://...")`` opens connections of its own (asyncpg,
    or psycopg 3 when that is the one installed; ``postgresql+psycopg://`` chooses);
    ``PostgresStore(engine)`` uses an SQLAlchemy AsyncEngine's pool (asyncpg or psycopg).
    Same replies and error texts as MemoryStore and RedisStore; the table must exist
    (`create_table`, or the DDL of ``python -m goblin_idem postgres-ddl``).

    Expired rows are deleted every `purge_interval_seconds` (None: never, call
    `purge_expired` yourself) by a task of the event loop that used the store first.
    """

    def __init__(
        self,
        engine: Any = None,
        *,
        table: str = DEFAULT_TABLE,
        max_value_bytes: int | None = None,
        purge_interval_seconds: float | None = 60.0,
        timeout: float = 5.0,
        _driver: Driver | None = None,
    ) -> None:
        if purge_interval_seconds is not None and not purge_interval_seconds > 0:
            raise ValueError(
                "purge_interval_seconds must be a positive number of seconds, or None to "
                f"purge only when purge_expired() is called, not {purge_interval_seconds!r}"
            )
        self.sql = Statements(table)
        if _driver is None:
            if engine is None:
                raise TypeError(
                    "PostgresStore takes an SQLAlchemy AsyncEngine, or use "
                    "PostgresStore.from_url('postgresql://...')"
                )
            _driver = driver_for_engine(engine, self.sql.table, timeout=timeout)
        self.driver = _driver
        self.table = self.sql.table
        self.max_value_bytes = (
            DEFAULT_MAX_VALUE_BYTES if max_value_bytes is None else max_value_bytes
        )
        self.purge_interval_seconds = purge_interval_seconds
        self._purge = _Purge()
        _stores.add(self)

    @classmethod
    def from_url(
        cls,
        url: str,
        *,
        table: str = DEFAULT_TABLE,
        max_value_bytes: int | None = None,
        purge_interval_seconds: float | None = 60.0,
        max_connections: int = 20,
        timeout: float = 5.0,
        prepared_statements: bool = True,
        synchronous_commit: bool = True,
    ) -> PostgresStore:
        """A store with a pool of its own per event loop, of up to `max_connections`.

        `timeout` bounds connecting, waiting for a free connection and each statement;
        past it the database is unavailable (a store error, never a silent wait).
        `prepared_statements=False` for PgBouncer in transaction mode before 1.21 (or
        with ``max_prepared_statements = 0``): each statement is then parsed every time.

        `synchronous_commit=False` sets ``synchronous_commit = off`` on the store's own
        connections: a claim or publish no longer waits for its WAL to reach the disk (the
        server writes it within 3 x ``wal_writer_delay``, 0.6 s by default), so a crash of
        the server loses at most the last moment's claims, as Redis with ``appendfsync
        everysec`` does; any synchronous commit after them (SQL records' in the same
        database) makes them durable too. It never changes what is atomic.
        """
        driver = driver_for_url(
            url,
            table,
            size=max_connections,
            timeout=timeout,
            prepared=prepared_statements,
            settings={} if synchronous_commit else {"synchronous_commit": "off"},
        )
        return cls(
            table=table,
            max_value_bytes=max_value_bytes,
            purge_interval_seconds=purge_interval_seconds,
            _driver=driver,
        )

    @property
    def address(self) -> str:
        """host:port/database, for log lines."""
        return self.driver.where

    def __repr__(self) -> str:
        return f"PostgresStore({self.driver.name} at {self.address}, table={self.table})"

    def forget_cached(self, result_key: KeyT) -> None:
        """Nothing: a PostgresStore keeps no copy of a result beside the table."""

    async def check(self) -> str:
        """One read of the table, made at startup: a database that is down or a table not
        created stops the app there, with the fix, not at its first keyed request (a 503).
        The startup line it returns names the database and the table."""
        await self.get(b"goblin-idem startup check")
        return f"postgres at {self.address}, table {self.table}"

    async def create_table(self) -> None:
        """Create the table and its index if they do not exist (idempotent)."""
        await self.driver.script(self.sql.ddl)

    async def aclose(self) -> None:
        await self._purge.stop()
        await self.driver.aclose()

    async def purge_expired(self) -> int:
        """Delete the expired rows, in batches of `PURGE_BATCH` (one short statement each,
        rows locked by another statement skipped); the rows removed."""
        return await self._purge.batches(self)

    # -- the four GOBLIN commands --

    async def claim(
        self, claim_key: KeyT, result_key: KeyT, token: KeyT, seconds: int
    ) -> ClaimReply:
        """SET claim_key token NX EX seconds, else GET result_key: one statement."""
        return await _claim(self, self.sql.claim, claim_key, result_key, token, seconds)

    async def claim_unless_done(
        self, claim_key: KeyT, result_key: KeyT, token: KeyT, seconds: int
    ) -> ClaimReply:
        """CLAIM where a stored result wins over a free claim (see Store): one statement."""
        return await _claim(self, self.sql.claim_unless_done, claim_key, result_key, token, seconds)

    async def caexpire(self, key: KeyT, expected: KeyT, ms: int) -> int:
        k, e = as_bytes(key), as_bytes(expected, "expected")
        ttl = caexpire_ms(ms)
        if ttl <= 0:  # a non-positive TTL deletes, as PEXPIRE in the past does
            return int(await self.driver.row(self.sql.cad, (k, e)) is not None)
        return int(await self.driver.row(self.sql.caexpire, (k, e, ttl)) is not None)

    async def cas(self, key: KeyT, expected: KeyT, new: KeyT) -> bool:
        k, e = as_bytes(key), as_bytes(expected, "expected")
        n = check_size(as_bytes(new, "new"), self.max_value_bytes)
        return await self.driver.row(self.sql.cas, (k, e, n)) is not None

    async def cad(self, key: KeyT, expected: KeyT) -> int:
        k, e = as_bytes(key), as_bytes(expected, "expected")
        return int(await self.driver.row(self.sql.cad, (k, e)) is not None)

    async def forget(
        self, claim_key: KeyT, result_key: KeyT, *others: KeyT, expected: KeyT | None = None
    ) -> int:
        """Delete a key's result, `others` and its claim, unless a run holds the claim (it
        is live, holds a token other than `expected`, and no result is stored): then -1 and
        nothing deleted. Else the count of the keys that existed. One statement, the claim's
        row locked, so no claim is taken or published between the check and the delete."""
        args = (
            as_bytes(claim_key),
            as_bytes(result_key),
            [as_bytes(k) for k in others],
            None if expected is None else as_bytes(expected, "expected"),
        )
        row = await self.driver.row(self.sql.forget, args)
        assert row is not None
        return int(row[0])

    # -- compound steps --

    async def publish(
        self, result_key: KeyT, value: bytes, ttl_ms: int, claim_key: KeyT, token: KeyT
    ) -> Published:
        """SET result PX ttl NX + CAEXPIRE claim, as one statement (see `Store.publish`);
        a repeat of a publish that landed reads its own bytes and replies as the first."""
        rk, ck = as_bytes(result_key), as_bytes(claim_key)
        v = check_size(as_bytes(value, "value"), self.max_value_bytes)
        ttl = publish_ttl(ttl_ms)
        args = (rk, v, ttl, ck, as_bytes(token, "token"))
        row = await self.driver.row(self.sql.publish, args)
        assert row is not None
        same, renewed = row[0], row[1]
        if same:
            return WRITTEN[int(renewed)]
        return Published.SUPERSEDED

    async def caexpire_many(
        self, renewals: Sequence[tuple[KeyT, KeyT, int]]
    ) -> list[int | Exception]:
        """Every renewal with a positive TTL in one statement (the watchdog's); an argument
        error, or a non-positive TTL's delete, in place."""
        replies: list[int | Exception] = [0] * len(renewals)
        keys: list[bytes] = []
        tokens: list[bytes] = []
        ttls: list[int] = []
        batched: list[tuple[int, bytes, bytes]] = []
        for i, (key, expected, ms) in enumerate(renewals):
            try:
                k, e = as_bytes(key), as_bytes(expected, "expected")
                ttl = caexpire_ms(ms)
                if ttl <= 0:
                    replies[i] = await self.caexpire(k, e, ttl)
                    continue
            except ResponseError as exc:
                replies[i] = exc
                continue
            keys.append(k)
            tokens.append(e)
            ttls.append(ttl)
            batched.append((i, k, e))
        if batched:
            rows = await self.driver.rows(self.sql.caexpire_many, (keys, tokens, ttls))
            renewed = {(bytes(row[0]), bytes(row[1])) for row in rows}
            for i, k, e in batched:
                replies[i] = int((k, e) in renewed)
        return replies

    # -- plain commands --

    async def get(self, key: KeyT) -> bytes | None:
        row = await self.driver.row(self.sql.get, (as_bytes(key),))
        return None if row is None else bytes(row[0])

    async def set(
        self,
        key: KeyT,
        value: KeyT,
        *,
        ex: int | None = None,
        px: int | None = None,
        nx: bool = False,
    ) -> bool:
        """SET with Redis' meaning: a plain SET drops any TTL the key had."""
        k, v = as_bytes(key), check_size(as_bytes(value, "value"), self.max_value_bytes)
        ttl_ms = set_ttl_ms(ex, px)
        if nx:
            return await self.driver.row(self.sql.set_nx, (k, v, ttl_ms)) is not None
        await self.driver.row(self.sql.set, (k, v, ttl_ms))
        return True

    async def pttl(self, key: KeyT) -> int:
        """Milliseconds left by the server's clock; -1 without TTL, -2 for a missing key."""
        row = await self.driver.row(self.sql.pttl, (as_bytes(key),))
        return -2 if row is None else int(row[0])

    async def delete(self, *keys: KeyT) -> int:
        if not keys:
            return 0
        rows = await self.driver.rows(self.sql.delete, ([as_bytes(k) for k in keys],))
        return sum(1 for row in rows if row[0])


class _Purge:
    """A store's background purge: a task of the event loop that used the store first,
    every `purge_interval_seconds`; another loop starts its own once that one has closed."""

    task: asyncio.Task[None] | None = None

    def soon(self, store: PostgresStore) -> None:
        """Start the task on first use, in the running loop (cheap once started)."""
        task = self.task
        if store.purge_interval_seconds is not None and (
            task is None or task.get_loop().is_closed()
        ):
            self.task = asyncio.get_running_loop().create_task(self._every(store))

    async def _every(self, store: PostgresStore) -> None:
        interval = store.purge_interval_seconds
        assert interval is not None
        while True:
            await asyncio.sleep(interval)
            try:
                removed = await store.purge_expired()
            except Exception as exc:
                logger.warning("could not purge expired keys of %r: %s", store, exc)
            else:
                if removed:
                    logger.debug("purged %d expired keys of %r", removed, store)

    async def batches(self, store: PostgresStore) -> int:
        """`PostgresStore.purge_expired`: statements until one deletes less than a batch."""
        removed = 0
        while True:
            row = await store.driver.row(store.sql.purge, (PURGE_BATCH,))
            count = int(row[0]) if row is not None else 0
            removed += count
            if count < PURGE_BATCH:
                return removed

    async def stop(self) -> None:
        task, self.task = self.task, None
        if task is not None and not task.done():
            task.cancel()
            with contextlib.suppress(BaseException):
                await task


async def _claim(
    store: PostgresStore, stmt: Any, claim_key: KeyT, result_key: KeyT, token: KeyT, seconds: int
) -> ClaimReply:
    """CLAIM, or claim_unless_done (`stmt`), for `PostgresStore`: one statement."""
    args = (
        as_bytes(claim_key),
        as_bytes(result_key),
        as_bytes(token, "token"),
        claim_seconds(seconds) * 1000,
    )
    store._purge.soon(store)
    row = await store.driver.row(stmt, args)
    assert row is not None
    won, result = row[0], row[1]
    # CLAIM: a won claim is CLAIMED; claim_unless_done: a stored result is the reply,
    # the claim won or not.
    if won and (result is None or stmt is store.sql.claim):
        return CLAIMED
    return None if result is None else claim_reply(bytes(result))


# Every PostgresStore of the process, for the fork handler.
_stores: weakref.WeakSet[PostgresStore] = weakref.WeakSet()


def _after_fork() -> None:
    """In a fork's child: the parent's connections and purge task are not ours."""
    for store in list(_stores):
        store._purge = _Purge()
        store.driver.after_fork()


if hasattr(os, "register_at_fork"):
    os.register_at_fork(after_in_child=_after_fork)
