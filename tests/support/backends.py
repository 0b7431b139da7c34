"""The stores under test (every backend the conformance suite runs on) and what a test reads
back from them directly."""

from __future__ import annotations

import contextlib
import fnmatch
from collections.abc import AsyncIterator, Iterator
from dataclasses import dataclass
from typing import Any

import pytest
import redis.asyncio
from redis.exceptions import ResponseError

from goblin_idem import MemoryStore, PostgresStore, RedisStore
from goblin_idem.store import KeyT, Store, as_bytes
from goblin_idem.store._server_errors import WRONGTYPE
from tests.support.postgres import Postgres
from tests.support.servers import Server

# Every store the conformance suite runs against: the embedded store; the Lua scripts on a
# real redis-server 7 and valkey-server 9; and the same servers with the goblin module loaded,
# answering GOBLIN.* natively. RedisStore auto-pipelines by default; the "-direct" ones send
# every call through redis-py instead (autopipeline=False).
BACKENDS = [
    "memory",
    "redis-script",
    "valkey-script",
    "redis-native",
    "valkey-native",
    "redis-script-direct",
    "redis-native-direct",
]

# PostgresStore on its own pool of each driver, and on an SQLAlchemy AsyncEngine of each.
POSTGRES_BACKENDS = [
    "postgres-asyncpg",
    "postgres-psycopg",
    "postgres-engine-asyncpg",
    "postgres-engine-psycopg",
]


@contextlib.asynccontextmanager
async def postgres_store(
    name: str, server: Postgres, database: str, **options: Any
) -> AsyncIterator[PostgresStore]:
    """A PostgresStore of backend `name` on `database`, its table created and emptied."""
    driver = name.rsplit("-", 1)[1]
    engine = None
    if "-engine-" in name:
        from sqlalchemy.ext.asyncio import create_async_engine

        engine = create_async_engine(server.url(database, driver))
        store = PostgresStore(engine, **options)
    else:
        store = PostgresStore.from_url(server.url(database, driver), **options)
    try:
        await store.create_table()
        await store.driver.script(f"TRUNCATE {store.table}")
        yield store
    finally:
        await store.aclose()
        if engine is not None:
            await engine.dispose()


@dataclass
class _Typed:
    kind: str


class TypedMemoryStore(MemoryStore):
    """MemoryStore with HSET and ZADD (members not kept): values of other types, for WRONGTYPE."""

    async def hset(self, key: KeyT, field: KeyT, value: KeyT) -> int:
        return self._typed(as_bytes(key), "hash")

    async def zadd(self, key: KeyT, member: KeyT, score: float) -> int:
        return self._typed(as_bytes(key), "zset")

    def _typed(self, key: bytes, kind: str) -> int:
        entry = self._live(key)
        if entry is not None and (not isinstance(entry, _Typed) or entry.kind != kind):
            raise ResponseError(WRONGTYPE)
        self._replace(key, entry or _Typed(kind))
        return int(entry is None)


@dataclass
class Backend:
    """A store under test, plus the means to put a non-string value under a key."""

    name: str
    store: Store
    client: redis.asyncio.Redis | None = None

    def _typed_values(self) -> None:
        if isinstance(self.store, PostgresStore):
            pytest.skip(
                "not applicable: a PostgresStore holds strings only, so no key is of "
                "another type (docs/operating/stores.md)"
            )

    async def make_hash(self, key: str | bytes) -> None:
        self._typed_values()
        if self.client is None:
            assert isinstance(self.store, TypedMemoryStore)
            await self.store.hset(key, "field", "value")
        else:
            await self.client.hset(key, "field", "value")

    async def make_zset(self, key: str | bytes) -> None:
        self._typed_values()
        if self.client is None:
            assert isinstance(self.store, TypedMemoryStore)
            await self.store.zadd(key, "member", 1.0)
        else:
            await self.client.zadd(key, {"member": 1.0})


@contextlib.asynccontextmanager
async def open_backend(request: pytest.FixtureRequest, name: str) -> AsyncIterator[Backend]:
    """The store of backend `name` (of BACKENDS or POSTGRES_BACKENDS), emptied, closed after:
    what a `backend` fixture yields."""
    if name == "memory":
        yield Backend(name, TypedMemoryStore())
        return
    if name.startswith("postgres-"):
        database: str = request.getfixturevalue("store_database")
        pg: Postgres = request.getfixturevalue("postgres")
        async with postgres_store(name, pg, database) as pg_store:
            yield Backend(name, pg_store)
        return
    server = server_for(request, name)
    _, mode, *direct = name.split("-")
    store = RedisStore.from_url(server.url, mode=mode, autopipeline=not direct)  # type: ignore[arg-type]
    client = store.client
    assert isinstance(client, redis.asyncio.Redis)
    await client.flushall()
    try:
        yield Backend(name, store, client)
    finally:
        await store.aclose()


def server_for(request: pytest.FixtureRequest, name: str) -> Server:
    """ "redis-script" runs on a stock server, "redis-native" on one with the module."""
    kind, mode = name.split("-")[:2]
    fixture = f"{kind}_native_server" if mode == "native" else f"{kind}_server"
    server: Server = request.getfixturevalue(fixture)
    return server


async def stored_items(store: Store, match: bytes = b"*") -> list[tuple[bytes, bytes]]:
    """Every (key, value) of a string the store holds under `match`: what an operator, a
    dump or a SCAN would see (MemoryStore has no SCAN, so its entries are read directly;
    PostgresStore's are its table's rows)."""
    if isinstance(store, MemoryStore):
        return [
            (k, e)
            for shard in store._data
            for k, e in shard.items()
            if isinstance(e, bytes) and fnmatch.fnmatchcase(k.decode("latin-1"), match.decode())
        ]
    if isinstance(store, PostgresStore):  # the table's live rows, as a SELECT would see them
        from goblin_idem.store._postgres_sql import Statement

        every = Statement.of(
            f"SELECT key, value FROM {store.table} WHERE expires_at IS NULL"
            " OR expires_at > (extract(epoch FROM statement_timestamp()) * 1000)::bigint"
        )
        rows = await store.driver.rows(every, ())
        return [
            (bytes(k), bytes(v))
            for k, v in rows
            if fnmatch.fnmatchcase(bytes(k).decode("latin-1"), match.decode())
        ]
    assert isinstance(store, RedisStore)
    client = store.client
    items = []
    async for k in client.scan_iter(match=match, count=1000):  # type: ignore[union-attr]
        items.append((k, await client.get(k) or b""))
    return items


async def assert_published_together_or_not_at_all(
    direct: redis.asyncio.Redis | redis.asyncio.RedisCluster,
    result_key: str,
    claim_key: str,
    token: bytes,
    lease_ms: int,
) -> None:
    """After a publish cut off between its SET and its CAEXPIRE, read straight from the
    server: the result and the claim's extension took effect together or not at all, and,
    as the server never saw EXEC, not at all."""
    stored = await direct.get(result_key)
    claim_ttl = await direct.pttl(claim_key)
    extended = claim_ttl > lease_ms
    assert (stored is not None) == extended, (
        f"the result {'landed' if stored is not None else 'is missing'} but the claim "
        f"{'was' if extended else 'was not'} extended (claim PTTL {claim_ttl} ms)"
    )
    assert stored is None and 0 < claim_ttl <= lease_ms  # nothing of an unfinished EXEC ran
    assert await direct.get(claim_key) == token


# The stores the sync integrations are tested on: the embedded one, the Lua scripts on
# redis-server, the module on valkey-server, PostgresStore on psycopg. A sync test module
# uses them as its `store` fixture by importing `sync_store` from this module (with a noqa
# for F401).
SYNC_STORES = ["memory", "redis-script", "valkey-native", "postgres-psycopg"]


@pytest.fixture(params=SYNC_STORES, name="store")
def sync_store(request: pytest.FixtureRequest) -> Iterator[Store]:
    """A store for sync code: closed on the process's loop thread, where sync callers use it."""
    from goblin_idem._threads._loop import loop_thread

    if request.param == "memory":
        yield MemoryStore()
        return
    if request.param.startswith("postgres-"):
        pg: Postgres = request.getfixturevalue("postgres")
        url = pg.url(request.getfixturevalue("store_database"), request.param.rsplit("-", 1)[1])
        pg_store = PostgresStore.from_url(url)
        loop_thread().run(pg_store.create_table())
        loop_thread().run(pg_store.driver.script(f"TRUNCATE {pg_store.table}"))
        yield pg_store
        loop_thread().run(pg_store.aclose())
        return
    server = server_for(request, request.param)
    with server.sync_client() as client:
        client.flushall()
    store = RedisStore.from_url(server.url, mode=request.param.split("-")[1])
    yield store
    loop_thread().run(store.aclose())
