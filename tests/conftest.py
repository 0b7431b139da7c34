from __future__ import annotations

from collections.abc import AsyncIterator, Iterator
from dataclasses import dataclass
from pathlib import Path

import pytest
import redis.asyncio
from servers import Server, start_server

from goblin_idem import MemoryStore, RedisStore
from goblin_idem.store import Store

# Every store the conformance suite runs against: the embedded store, and the Lua scripts
# on a real redis-server 7 and valkey-server 9.
BACKENDS = ["memory", "redis-script", "valkey-script"]


@pytest.fixture(scope="session")
def redis_server() -> Iterator[Server]:
    server = start_server("redis")
    yield server
    server.stop()


@pytest.fixture(scope="session")
def valkey_server() -> Iterator[Server]:
    server = start_server("valkey")
    yield server
    server.stop()


@dataclass
class Backend:
    """A store under test, plus the means to put a non-string value under a key."""

    name: str
    store: Store
    client: redis.asyncio.Redis | None = None

    async def make_hash(self, key: str | bytes) -> None:
        if self.client is None:
            assert isinstance(self.store, MemoryStore)
            await self.store.hset(key, "field", "value")
        else:
            await self.client.hset(key, "field", "value")

    async def make_zset(self, key: str | bytes) -> None:
        if self.client is None:
            assert isinstance(self.store, MemoryStore)
            await self.store.zadd(key, "member", 1.0)
        else:
            await self.client.zadd(key, {"member": 1.0})


def server_for(request: pytest.FixtureRequest, name: str) -> Server:
    kind = name.split("-", 1)[0]
    server: Server = request.getfixturevalue(f"{kind}_server")
    return server


@pytest.fixture(params=BACKENDS)
async def backend(request: pytest.FixtureRequest) -> AsyncIterator[Backend]:
    name: str = request.param
    if name == "memory":
        yield Backend(name, MemoryStore())
        return
    server = server_for(request, name)
    store = RedisStore.from_url(server.url, mode=name.split("-", 1)[1])  # type: ignore[arg-type]
    client = store.client
    assert isinstance(client, redis.asyncio.Redis)
    await client.flushall()
    yield Backend(name, store, client)
    await store.aclose()


@pytest.fixture
def store(backend: Backend) -> Store:
    return backend.store


@pytest.fixture(scope="session")
def tests_dir() -> Path:
    return Path(__file__).parent
