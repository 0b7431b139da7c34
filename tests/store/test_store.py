"""Store behaviour beyond the spec pages: the compound steps, RedisStore's modes and pool,
MemoryStore's eviction, and what happens when a server is not there."""

from __future__ import annotations

import asyncio
import gc
import logging
import re
import secrets
import time
from collections.abc import Iterator

import pytest
import redis
import redis.asyncio
from redis.asyncio.retry import Retry
from redis.backoff import NoBackoff
from redis.exceptions import ConnectionError as RedisConnectionError
from redis.exceptions import RedisClusterException, ResponseError

from goblin_idem import CLAIMED, Lock, MemoryStore, NotReplicatedError, RedisStore, Store
from goblin_idem.store import Published, _memory
from goblin_idem.store._scripts import ALL as ALL_SCRIPTS
from goblin_idem.store._scripts import GOBLIN as GOBLIN_SCRIPTS
from goblin_idem.store._server_errors import NOT_INTEGER, VALUE_TOO_LARGE, WRONGTYPE
from tests.support.backends import (
    Backend,
    TypedMemoryStore,
    assert_published_together_or_not_at_all,
)
from tests.support.proxy import Proxy, resp_args
from tests.support.servers import Cluster, Server, free_port, start_cluster, start_server

# -- publish and caexpire_many, on every store ----------------------------------------------


async def test_publish_stores_the_result_and_extends_the_claim(store: Store) -> None:
    assert await store.claim("{k}:c", "{k}:r", "tok", 1) is CLAIMED
    assert await store.publish("{k}:r", b"record", 60_000, "{k}:c", "tok") == 1
    assert await store.get("{k}:r") == b"record"
    assert 59_000 < await store.pttl("{k}:r") <= 60_000
    assert 59_000 < await store.pttl("{k}:c") <= 60_000  # the lease now lasts as the result
    await asyncio.sleep(1.1)  # past the original 1 s lease
    assert await store.claim("{k}:c", "{k}:r", "other", 1) == b"record"


async def test_publish_after_losing_the_claim_replies_0(store: Store) -> None:
    assert await store.claim("{k}:c", "{k}:r", "tok", 30) is CLAIMED
    await store.set("{k}:c", "someone-else", px=30_000)
    assert await store.publish("{k}:r", b"record", 60_000, "{k}:c", "tok") == 0
    assert await store.get("{k}:r") == b"record"  # the work happened: its result is kept
    assert await store.get("{k}:c") == b"someone-else"


async def test_publish_never_replaces_a_stored_result(store: Store) -> None:
    """A run that lost its claim publishes after another run did: the first result stands
    for its TTL (duplicates were already given it), and the late run's claim, should it hold
    the key again, lasts no longer than that result."""
    assert await store.publish("{k}:r", b"first", 60_000, "{k}:c", "t1") == Published.LAPSED
    await store.set("{k}:c", "t2", px=30_000)
    assert await store.publish("{k}:r", b"late", 90_000, "{k}:c", "t2") == Published.SUPERSEDED
    assert await store.get("{k}:r") == b"first"
    result_ttl = await store.pttl("{k}:r")
    assert 59_000 < result_ttl <= 60_000
    assert await store.get("{k}:c") == b"t2"
    assert 59_000 < await store.pttl("{k}:c") <= result_ttl + 5  # cut to the result's
    # A late run whose claim another run holds changes nothing at all.
    await store.set("{k}:c", "t3", px=30_000)
    assert await store.publish("{k}:r", b"later", 90_000, "{k}:c", "t2") == Published.SUPERSEDED
    assert (await store.get("{k}:r"), await store.get("{k}:c")) == (b"first", b"t3")
    assert 29_000 < await store.pttl("{k}:c") <= 30_000


async def test_a_publish_repeated_after_it_landed_is_its_own(store: Store) -> None:
    """The first attempt landed and its reply was lost: the repeat meets its own result,
    which is not another run's, and replies as the first attempt would have."""
    assert await store.claim("{k}:c", "{k}:r", "tok", 30) is CLAIMED
    assert await store.publish("{k}:r", b"record", 60_000, "{k}:c", "tok") == Published.STORED
    assert await store.publish("{k}:r", b"record", 60_000, "{k}:c", "tok") == Published.STORED
    await store.set("{k}:c", "someone-else", px=30_000)
    assert await store.publish("{k}:r", b"record", 60_000, "{k}:c", "tok") == Published.LAPSED
    assert await store.get("{k}:c") == b"someone-else"


async def test_publish_over_a_result_of_another_type(backend: Backend) -> None:
    """SET NX finds the key taken whatever its type, and reading it back is WRONGTYPE."""
    await backend.make_hash("{h}:r")
    with pytest.raises(ResponseError) as info:
        await backend.store.publish("{h}:r", b"v", 60_000, "{h}:c", "t")
    assert str(info.value) == WRONGTYPE


async def test_publish_rejects_a_bad_ttl(store: Store) -> None:
    with pytest.raises(ResponseError):
        await store.publish("{k}:r", b"record", 0, "{k}:c", "tok")
    with pytest.raises(ResponseError, match=NOT_INTEGER):
        await store.publish("{k}:r", b"record", "soon", "{k}:c", "tok")  # type: ignore[arg-type]
    assert await store.get("{k}:r") is None


@pytest.mark.parametrize("mode", ["script", "native"])
@pytest.mark.parametrize("path", ["auto-pipelined", "redis-py"])
async def test_publish_lands_together_or_not_at_all_when_the_connection_drops_between(
    redis_native_server: Server, path: str, mode: str
) -> None:
    """The connection is cut after the server has read publish's SET and before the claim's
    CAEXPIRE: the server then sees the client go without EXEC, so neither may take effect.
    (Without MULTI/EXEC the SET would run alone, and the claim would expire long before the
    result it guards: a duplicate would win a fresh claim and run the work again.)"""
    tag = secrets.token_hex(4)
    claim_key, result_key, value = f"{{{tag}}}:c", f"{{{tag}}}:r", b"result " + tag.encode()
    with Proxy(redis_native_server.port) as proxy:
        store = RedisStore.from_url(
            proxy.url,
            mode=mode,  # type: ignore[arg-type]
            autopipeline=path == "auto-pipelined",
            retry=Retry(NoBackoff(), 0),  # a resent transaction would land whole anyway
            socket_timeout=5,
        )
        try:
            assert await store.claim(claim_key, result_key, "tok", 30) is CLAIMED
            proxy.cut_after(resp_args(value, "PX", 60_000))  # the end of the SET
            with pytest.raises(RedisConnectionError):
                await store.publish(result_key, value, 60_000, claim_key, "tok")
            assert proxy.cuts == 1
        finally:
            await store.aclose()
    async with redis_native_server.client() as direct:
        await assert_published_together_or_not_at_all(direct, result_key, claim_key, b"tok", 30_000)


async def test_caexpire_many_renews_each_in_place(backend: Backend) -> None:
    store = backend.store
    await store.set("a", "ta", px=1000)
    await store.set("b", "tb", px=1000)
    await backend.make_hash("h")
    replies = await store.caexpire_many(
        [("a", "ta", 60_000), ("b", "wrong", 60_000), ("missing", "x", 60_000), ("h", "x", 1)]
    )
    assert replies[:3] == [1, 0, 0]
    assert isinstance(replies[3], ResponseError) and str(replies[3]) == WRONGTYPE
    assert await store.pttl("a") > 59_000
    assert await store.pttl("b") <= 1000
    assert await store.caexpire_many([]) == []


# -- RedisStore -----------------------------------------------------------------------------


@pytest.fixture(params=["redis", "valkey"])
def server(request: pytest.FixtureRequest) -> Server:
    s: Server = request.getfixturevalue(f"{request.param}_server")
    return s


async def test_auto_mode_picks_script_on_a_stock_server(
    server: Server, caplog: pytest.LogCaptureFixture
) -> None:
    store = RedisStore.from_url(server.url)
    try:
        await store.delete("{d}:c", "{d}:r")  # a plain command: it detects nothing
        assert store.mode == "auto"
        with caplog.at_level(logging.INFO, logger="goblin_idem.store"):
            assert await store.claim("{d}:c", "{d}:r", "t", 5) is CLAIMED
            assert await store.cad("{d}:c", "t") == 1
        assert store.mode == "script"
        lines = [r.getMessage() for r in caplog.records if r.name == "goblin_idem.store"]
        assert lines == [
            "goblin-idem store mode: script "
            "(server lacks GOBLIN.CLAIM; running the Lua scripts with EVALSHA)"
        ]
        # detection loaded the scripts, so the first EVALSHA did not meet NOSCRIPT
        loaded = await store.client.script_exists(*(s.sha for s in ALL_SCRIPTS))
        assert all(loaded)
    finally:
        await store.aclose()


async def test_concurrent_first_calls_detect_once(server: Server) -> None:
    store = RedisStore.from_url(server.url)
    try:
        await store.client.execute_command("CONFIG", "RESETSTAT")
        await asyncio.gather(*(store.get(f"k{i}") for i in range(1)))
        await asyncio.gather(*(store.cad(f"k{i}", "t") for i in range(50)))
        stats = await store.client.info("commandstats")
        assert stats["cmdstat_command|list"]["calls"] == 1
        assert stats["cmdstat_config|get"]["calls"] == 2  # maxmemory*, proto-max-bulk-len
        # the detection's probe runs each GOBLIN script once (not forget's), then the 50 CADs
        assert stats["cmdstat_evalsha"]["calls"] == len(GOBLIN_SCRIPTS) + 50
    finally:
        await store.aclose()


async def test_noscript_is_reloaded_and_retried(server: Server) -> None:
    store = RedisStore.from_url(server.url, mode="script")
    try:
        await store.client.script_flush()
        assert await store.claim("{n}:c", "{n}:r", "t", 30) is CLAIMED
        await store.client.script_flush()
        assert await store.publish("{n}:r", b"v", 30_000, "{n}:c", "t") == 1
        await store.client.script_flush()
        assert await store.caexpire_many([("{n}:c", "t", 30_000)]) == [1]
        await store.client.script_flush()
        assert await store.cas("{n}:r", "v", "w") is True
        await store.client.script_flush()
        assert await store.cad("{n}:c", "t") == 1
        await store.client.script_flush()
        assert await store.claim_unless_done("{n}:c", "{n}:r", "t", 30) == b"w"
        await store.client.script_flush()
        assert await store.claim_unless_done("{n2}:c", "{n2}:r", "t", 30) is CLAIMED
    finally:
        await store.aclose()


async def test_native_mode_on_a_server_without_the_module_says_so(server: Server) -> None:
    store = RedisStore.from_url(server.url, mode="native")
    try:
        with pytest.raises(ResponseError, match=r"unknown command 'goblin\.claim'"):
            await store.claim("{x}:c", "{x}:r", "t", 30)
    finally:
        await store.aclose()


async def test_decode_responses_client_is_refused(server: Server) -> None:
    client = server.client(decode_responses=True)
    try:
        with pytest.raises(ValueError, match="decode_responses=False"):
            RedisStore(client)
    finally:
        await client.aclose()


def test_a_url_or_a_class_in_place_of_the_client_says_what_to_pass() -> None:
    with pytest.raises(TypeError, match=r"not a URL: use RedisStore\.from_url\(url\)"):
        RedisStore("redis://127.0.0.1:6379/0")  # type: ignore[arg-type]
    with pytest.raises(TypeError, match=r"needs an asyncio client .*RedisStore\.from_url"):
        RedisStore(redis.Redis(host="127.0.0.1", port=1))  # type: ignore[arg-type]
    with pytest.raises(TypeError, match=r"not a builtins\.dict: build one with"):
        RedisStore({"host": "127.0.0.1"})  # type: ignore[arg-type]


async def test_bad_mode_is_refused(server: Server) -> None:
    client = server.client()
    try:
        with pytest.raises(ValueError, match="mode must be"):
            RedisStore(client, mode="lua")  # type: ignore[arg-type]
    finally:
        await client.aclose()


async def test_from_url_pool_waits_instead_of_failing(server: Server) -> None:
    """More concurrent calls than connections: the pool queues them (a plain redis-py pool
    raises MaxConnectionsError on the 101st)."""
    store = RedisStore.from_url(server.url, max_connections=4, pool_timeout=10)
    try:
        replies = await asyncio.gather(
            *(store.claim(f"{{p{i}}}:c", f"{{p{i}}}:r", "t", 30) for i in range(300))
        )
        assert all(r is CLAIMED for r in replies)
        assert len(store.client.connection_pool._in_use_connections) == 0  # type: ignore[union-attr]
        assert len(store.client.connection_pool._available_connections) <= 4  # type: ignore[union-attr]
    finally:
        await store.aclose()


@pytest.fixture
def small_values_server() -> Iterator[Server]:
    """A redis-server that takes values of 1 MiB at most (proto-max-bulk-len's minimum)."""
    server = start_server("redis", args=["--proto-max-bulk-len", "1mb"])
    yield server
    server.stop()


@pytest.mark.parametrize("autopipeline", [True, False], ids=["shared", "direct"])
async def test_a_value_over_the_servers_limit_is_refused_before_it_is_sent(
    small_values_server: Server, autopipeline: bool
) -> None:
    """The server would drop the connection that sent it, and with it every call
    pipelined there: the store reads the limit at detection and refuses the value as it
    refuses one over max_value_bytes."""
    store = RedisStore.from_url(small_values_server.url, autopipeline=autopipeline)
    limit = 1024 * 1024
    try:
        await store.detect()
        assert store.max_value_bytes == limit
        claims = [store.claim_unless_done(f"{{u{i}}}:c", f"{{u{i}}}:r", "t", 30) for i in range(25)]
        publish = store.publish("{big}:r", b"x" * (limit + 1), 30_000, "{big}:c", "t")
        replies = await asyncio.gather(*claims[:10], publish, *claims[10:], return_exceptions=True)
        refused = replies.pop(10)
        assert isinstance(refused, ResponseError) and str(refused) == VALUE_TOO_LARGE
        assert replies == [CLAIMED] * 25
        assert await store.get("{big}:r") is None
        with pytest.raises(ResponseError, match=re.escape(VALUE_TOO_LARGE)):
            await store.set("{big}:r", b"x" * (limit + 1))
        assert await store.claim("{big}:c", "{big}:r", "t", 30) is CLAIMED
        assert await store.publish("{big}:r", b"x" * limit, 30_000, "{big}:c", "t") == 1
    finally:
        await store.aclose()


async def test_a_cluster_store_takes_the_smallest_limit_of_its_primaries() -> None:
    cluster = start_cluster("redis", masters=3)
    try:
        with cluster.servers[1].sync_client() as c:
            c.config_set("proto-max-bulk-len", 2 * 1024 * 1024)
        store = RedisStore.from_url(cluster.servers[0].url, cluster=True)
        try:
            await store.detect()
            assert store.max_value_bytes == 2 * 1024 * 1024
        finally:
            await store.aclose()
        store = RedisStore.from_url(cluster.servers[0].url, cluster=True, max_value_bytes=1000)
        try:
            await store.detect()
            assert store.max_value_bytes == 1000  # an option below the server's stays
        finally:
            await store.aclose()
    finally:
        cluster.stop()


async def test_a_store_that_is_down_raises_a_connection_error() -> None:
    store = RedisStore.from_url(f"redis://127.0.0.1:{free_port()}/0", socket_timeout=1)
    try:
        started = time.monotonic()
        with pytest.raises(RedisConnectionError):
            await store.claim("{x}:c", "{x}:r", "t", 30)
        assert time.monotonic() - started < 10
        assert store.mode == "auto"  # nothing was decided; the next call asks again
    finally:
        await store.aclose()


async def test_store_recovers_when_the_server_comes_back() -> None:
    server = start_server("redis")
    store = RedisStore.from_url(server.url, socket_timeout=1)
    try:
        assert await store.claim("{r}:c", "{r}:r", "t", 30) is CLAIMED
        server.stop(remove_dir=False)
        with pytest.raises(RedisConnectionError):
            await store.claim("{r}:c", "{r}:r", "t", 30)
        server.restart()  # an empty server: no keys, no scripts
        assert await store.claim("{r}:c", "{r}:r", "t", 30) is CLAIMED
    finally:
        await store.aclose()
        server.stop()


async def test_cluster(own_cluster: tuple[Cluster, str]) -> None:
    cluster, mode = own_cluster
    client = cluster.client()
    # No replay cache: a claim deleted by this test's plain client must be seen by the very
    # next claim step, not after the server's invalidation (test_cluster_replay_cache.py).
    store = RedisStore(client, replay_cache_bytes=0)
    try:
        assert await store.detect() == mode
        # keys spread over the three masters; claim and result share a hash tag
        owners = set()
        for i in range(30):
            ck, rk = f"{{job{i}}}:claim", f"{{job{i}}}:result"
            assert await store.claim(ck, rk, "t", 30) is CLAIMED
            assert await store.publish(rk, b"done", 60_000, ck, "t") == 1
            assert await store.claim(ck, rk, "u", 30) == b"done"
            assert await store.caexpire_many([(ck, "t", 60_000)]) == [1]
            owners.add(client.get_node_from_key(ck).name)
            # the claim step on the key's primary: a lost claim, its result kept
            assert await store.claim_unless_done(ck, rk, "u", 30) == b"done"
            await client.delete(ck)
            assert await store.claim_unless_done(ck, rk, "v", 30) == b"done"
            assert await client.get(ck) == b"v"
        assert len(owners) == 3
        if mode == "script":
            # a node that forgot its scripts reloads them on the NOSCRIPT it answers
            node = client.get_node_from_key("{job0}:claim")
            await client.execute_command("SCRIPT FLUSH", target_nodes=node)
        assert await store.cad("{job0}:claim", "v") == 1  # retaken by "v" above
        # claim and result in different slots: refused before anything is sent
        with pytest.raises(RedisClusterException, match="same key slot"):
            await store.claim("a:claim", "b:result", "t", 30)
    finally:
        await client.aclose()


# -- MemoryStore ----------------------------------------------------------------------------


async def test_memory_store_reclaims_expired_entries() -> None:
    store = MemoryStore()
    for i in range(5000):
        await store.set(f"k{i}", "v", px=1000)
    assert len(store) == 5000
    await asyncio.sleep(1.05)
    for i in range(200):  # each write reclaims a bounded batch of expired entries
        await store.set(f"live{i}", "v", px=60_000)
    assert len(store) == 200


async def test_memory_store_renewals_do_not_leak() -> None:
    store = MemoryStore()
    await store.set("lease", "t", px=20)
    for _ in range(50):
        assert await store.caexpire("lease", "t", 20) == 1
    await asyncio.sleep(0.05)
    for i in range(5):
        await store.set(f"x{i}", "v")
    assert await store.get("lease") is None
    assert not any(store._deadlines) and not store._buckets  # the renewals' buckets went too


async def test_memory_store_entries_add_nothing_for_the_garbage_collector() -> None:
    """A busy store holds many completed keys: a full collection must not walk them."""
    store = TypedMemoryStore()
    await store.hset("h", "f", "v")  # a collection is an object; strings are not
    gc.collect()
    tracked = len(gc.get_objects())
    started = time.monotonic()
    for i in range(5000):
        assert await store.claim(f"c{i}", f"r{i}", "tok", 30) is CLAIMED
        assert await store.publish(f"r{i}", b"result", 60_000, f"c{i}", "tok") == 1
        assert await store.cas(f"c{i}", "tok", "tok2")
    gc.collect()
    assert len(store) == 10_001
    assert len(gc.get_objects()) - tracked < 50
    elapsed_ms = (time.monotonic() - started) * 1000  # a loaded machine writes slowly
    assert await store.pttl("c7") > 60_000 - elapsed_ms - 100 and await store.get("c7") == b"tok2"


async def test_memory_store_holds_nothing_the_collector_tracks() -> None:
    """Its tables hold only bytes and floats, so the collector neither tracks nor walks
    them; the expiry buckets number a few per TTL, not one per key."""
    store = MemoryStore()
    for i in range(3000):
        assert await store.claim(f"c{i}", f"r{i}", "tok", 30) is CLAIMED
        assert await store.publish(f"r{i}", b"result", 86_400_000, f"c{i}", "tok") == 1
    await store.set("plain", "v")
    gc.collect()
    assert not any(map(gc.is_tracked, (*store._data, *store._deadlines)))
    assert not any(map(gc.is_tracked, store._buckets.values()))
    assert len(store._buckets) == len(store._ends) < 10
    assert await store.pttl("c7") > 86_000_000 and await store.pttl("plain") == -1


class _Clock:
    """MemoryStore's time.monotonic, moved by the test instead of waited for."""

    def __init__(self) -> None:
        self.now = 1000.0

    def monotonic(self) -> float:
        return self.now


@pytest.fixture
def clock(monkeypatch: pytest.MonkeyPatch) -> _Clock:
    fake = _Clock()
    monkeypatch.setattr(_memory, "time", fake)
    return fake


async def test_memory_store_no_table_holds_the_whole_keyspace() -> None:
    """A dict that outgrows its table copies all of it in one write: the keys are spread
    over shards and a bucket is bounded, so the largest copy is not the keyspace's."""
    store = MemoryStore()
    for i in range(20_000):
        await store.set(f"k{i}", "v", px=60_000)
    assert len(store) == 20_000
    tables = [*store._data, *store._deadlines, *store._buckets.values()]
    assert all(type(t) is dict for t in tables)
    assert max(map(len, tables)) <= max(_memory._BUCKET_KEYS, 2 * 20_000 // _memory._SHARDS)
    assert await store.get("k19999") == b"v" and await store.pttl("k7") > 0


async def test_memory_store_full_buckets_continue_and_are_all_swept(clock: _Clock) -> None:
    """Keys due in the same bucket beyond its bound go to continuations; every one is
    absent at its deadline, and the writes after it reclaim them all."""
    store = MemoryStore()
    due = 3 * _memory._BUCKET_KEYS + 5
    for i in range(due):
        await store.set(f"k{i}", "v", px=1000)
    assert len(store._buckets) == len(store._ends) == 4
    assert max(map(len, store._buckets.values())) == _memory._BUCKET_KEYS
    assert await store.get(f"k{due - 1}") == b"v"
    clock.now += 1.5
    assert await store.get("k0") is None and await store.get(f"k{due - 1}") is None
    assert await store.pttl("k5000") == -2 and len(store) == due - 3  # lazy: read, dropped
    writes = 0
    while len(store) > writes:  # each write reclaims a bounded batch
        await store.set(f"live{writes}", "v", px=60_000)
        writes += 1
    assert writes <= due // _memory._EVICT_PER_WRITE + 2
    assert len(store._buckets) == len(store._ends) == len(store._open) == 1
    assert await store.get("live0") == b"v"


async def test_memory_store_set_options() -> None:
    store = MemoryStore()
    assert await store.set("k", "v1", ex=10)
    assert 9_000 < await store.pttl("k") <= 10_000
    assert not await store.set("k", "v2", nx=True)
    assert await store.get("k") == b"v1"
    assert await store.set("k", "v3")
    assert await store.pttl("k") == -1  # a plain SET drops the TTL, as on Redis
    with pytest.raises(ResponseError, match="invalid expire time in 'set' command"):
        await store.set("k", "v", px=0)
    assert await store.delete("k", "missing") == 1
    assert await store.delete() == 0


async def test_memory_store_set_nx_takes_a_key_that_expired_with_no_write_since() -> None:
    """Expiry is lazy: a key past its deadline is free to SET NX (and a lock whose holder
    stopped renewing can be taken) before any write has reclaimed it."""
    store = MemoryStore()
    assert await store.set("k", "old", px=50)
    await asyncio.sleep(0.1)
    assert len(store) == 1  # not reclaimed: nothing has written since
    assert await store.set("k", "new", px=10_000, nx=True)
    assert await store.get("k") == b"new"
    assert await store.set("job", "a-holder-that-died", px=50)
    await asyncio.sleep(0.1)
    lock = Lock(store, "job", blocking=False)
    assert await lock.acquire()
    assert await store.get("job") == lock.token
    await lock.release()


async def test_memory_store_wrongtype_on_mixed_collections() -> None:
    store = TypedMemoryStore()
    await store.hset("h", "f", "v")
    with pytest.raises(ResponseError, match=WRONGTYPE):
        await store.zadd("h", "m", 1)
    with pytest.raises(ResponseError, match=WRONGTYPE):
        await store.get("h")
    assert await store.set("h", "now a string")  # SET replaces any type, as on Redis
    assert await store.get("h") == b"now a string"


async def test_redis_client_passed_in_is_not_closed_by_the_store(server: Server) -> None:
    client = redis.asyncio.Redis(host=server.host, port=server.port)
    store = RedisStore(client, mode="script")
    await store.aclose()
    assert await client.ping()
    await client.aclose()


# -- native mode ------------------------------------------------------------------------------


@pytest.mark.parametrize("kind", ["redis", "valkey"])
async def test_auto_mode_picks_native_where_the_module_is_loaded(
    request: pytest.FixtureRequest, kind: str, caplog: pytest.LogCaptureFixture
) -> None:
    server: Server = request.getfixturevalue(f"{kind}_native_server")
    store = RedisStore.from_url(server.url)
    try:
        with caplog.at_level(logging.INFO, logger="goblin_idem.store"):
            assert await store.detect() == "native"
        assert [r.getMessage() for r in caplog.records if r.name == "goblin_idem.store"] == [
            "goblin-idem store mode: native (GOBLIN.CLAIM found on the server)"
        ]
        await store.client.execute_command("CONFIG", "RESETSTAT")
        assert await store.claim("{n}:c", "{n}:r", "t", 30) is CLAIMED
        stats = await store.client.info("commandstats")
        assert stats["cmdstat_goblin.claim"]["calls"] == 1
        assert "cmdstat_evalsha" not in stats
    finally:
        await store.aclose()


INPUTS: list[tuple[str, tuple[object, ...]]] = [
    ("claim", ("{s}:c", "{s}:r", "t1", 30)),
    ("claim", ("{s}:c", "{s}:r", "t2", 30)),
    ("cas", ("{s}:c", "t1", b"\x00t3")),
    ("cas", ("{s}:c", "t1", "t4")),
    ("caexpire", ("{s}:c", b"\x00t3", 5000)),
    ("caexpire", ("{s}:c", "nope", 5000)),
    ("claim", ("{s}:h", "{s}:c", "t", 30)),
    ("cad", ("{s}:c", "nope")),
    ("cad", ("{s}:c", b"\x00t3")),
    ("caexpire", ("{s}:c", b"\x00t3", -1)),
    ("claim", ("{s}:c", "{s}:r", "t", 0)),
    ("caexpire", ("{s}:h", "x", 10)),
]


@pytest.mark.parametrize("kind", ["redis", "valkey"])
async def test_native_and_script_reply_alike_side_by_side(
    request: pytest.FixtureRequest, kind: str
) -> None:
    """The same inputs through both modes, one after the other: same replies, same errors."""
    native_server: Server = request.getfixturevalue(f"{kind}_native_server")
    stores = [
        RedisStore.from_url(native_server.url, mode="native"),
        RedisStore.from_url(native_server.url, mode="script"),
    ]
    outcomes: list[list[object]] = []
    try:
        for store in stores:
            await store.client.flushall()
            await store.client.hset("{s}:h", "f", "v")
            seen: list[object] = []
            for method, args in INPUTS:
                try:
                    seen.append(await getattr(store, method)(*args))
                except ResponseError as exc:
                    seen.append(("error", str(exc)))
                seen.append(round(await store.pttl("{s}:c") / 1000))
            outcomes.append(seen)
        assert outcomes[0] == outcomes[1]
        assert ("error", WRONGTYPE) in outcomes[0]
    finally:
        for store in stores:
            await store.aclose()


# -- wait_replicas -----------------------------------------------------------------------------


def _replica_linked(primary: Server) -> None:
    """Until the replica acknowledges writes (its first sync loaded)."""
    deadline = time.monotonic() + 20
    with primary.sync_client() as r:
        while int(r.execute_command("WAIT", 1, 200)) < 1:
            assert time.monotonic() < deadline, "the replica never acknowledged"
            r.set("replica-ready", 1)


@pytest.mark.parametrize("replicas", [0, 1], ids=["no-replica", "one-replica"])
async def test_a_publish_fewer_replicas_acknowledge_than_asked_raises(replicas: int) -> None:
    """``wait_replicas``: a publish is WAITed for like a won claim, and fewer replicas than
    asked acknowledging it raises NotReplicatedError (the write stays on the primary), with
    no replica attached (WAIT times out with 0) as with one that is short of the count."""
    primary = start_server("redis", args=["--repl-diskless-sync-delay", "0"])
    replica = (
        start_server("redis", args=["--replicaof", "127.0.0.1", str(primary.port)])
        if replicas
        else None
    )
    plain = RedisStore.from_url(primary.url)
    # WAIT always runs to its timeout here (one replica short): long enough for the linked
    # replica's acknowledgement to arrive on a loaded machine.
    waiting = RedisStore.from_url(primary.url, wait_replicas=replicas + 1, wait_timeout_seconds=1)
    try:
        if replica is not None:
            _replica_linked(primary)
        assert await plain.claim(b"{w}:c", b"{w}:r", b"t", 30) is CLAIMED
        with pytest.raises(NotReplicatedError, match=rf"^WAIT: {replicas} of {replicas + 1} "):
            await waiting.publish(b"{w}:r", b"v", 60_000, b"{w}:c", b"t")
        with primary.sync_client() as r:
            assert r.get(b"{w}:r") == b"v" and r.pttl(b"{w}:c") > 30_000
        # A repeat over its own landed result is checked the same way.
        with pytest.raises(NotReplicatedError):
            await waiting.publish(b"{w}:r", b"v", 60_000, b"{w}:c", b"t")
    finally:
        await plain.aclose()
        await waiting.aclose()
        if replica is not None:
            replica.stop()
        primary.stop()
