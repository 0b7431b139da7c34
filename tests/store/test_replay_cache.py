"""The replay cache on real servers: a duplicate of a key this process saw completed is
answered from memory with no command sent, and never once the server said the key changed
(expired, evicted, deleted by another client, flushed, the server restarted), after a fork,
or after this process forgot it. Redis and Valkey, native and script mode."""

from __future__ import annotations

import asyncio
import os
import secrets
import signal
from collections.abc import AsyncIterator, Awaitable, Callable
from typing import Any

import pytest

from goblin_idem import CLAIMED, MemoryStore, RedisStore, forget
from goblin_idem._keys import key_names
from goblin_idem.store import Published, _autopipeline
from goblin_idem.store._autopipeline import HEARD_SECONDS, AutoPipeline
from goblin_idem.store._replay_cache import DEFAULT_REPLAY_CACHE_BYTES, ENTRY_OVERHEAD, ReplayCache
from tests.support.procs import in_child
from tests.support.proxy import Proxy
from tests.support.servers import Server, start_server
from tests.support.waits import until

BUDGET = 4 << 20
SERVERS = ["redis_server", "valkey_server", "redis_native_server", "valkey_native_server"]


@pytest.fixture(params=SERVERS)
def server(request: pytest.FixtureRequest) -> Server:
    found: Server = request.getfixturevalue(request.param)
    return found


@pytest.fixture
async def store(server: Server) -> AsyncIterator[RedisStore]:
    s = RedisStore.from_url(server.url, replay_cache_bytes=BUDGET)
    yield s
    await s.aclose()


# What asking for the figures costs: the client's INFO and its connection's own setup.
_ASKING = ("cmdstat_info", "cmdstat_client|setinfo", "cmdstat_hello")


def commands_served(server: Server) -> int:
    """Every command the server has run (INFO commandstats), the asking left out."""
    with server.sync_client() as client:
        stats = client.info("commandstats")
    return sum(int(v["calls"]) for k, v in stats.items() if k not in _ASKING)


def keys() -> tuple[str, str]:
    tag = secrets.token_hex(8)
    return f"{{{tag}}}:c", f"{{{tag}}}:r"


def pipeline_of(store: RedisStore) -> AutoPipeline:
    pipeline = store._executor.replays
    assert pipeline is not None
    return pipeline


def kept(store: RedisStore, r: str) -> bool:
    """Is `r` in the running loop's cache? (Not whether it would be served: that also asks
    that the connection heard from the server within a second.)"""
    conn = pipeline_of(store)._conn
    return conn is not None and conn.cache is not None and r.encode() in conn.cache.entries


async def completed(
    store: RedisStore, value: bytes = b"done", ttl_ms: int = 60_000, *, duplicated: bool = True
) -> str:
    """A key run and published by `store`; its result key. `duplicated`: then asked once
    more, as a duplicate, which reads the result from the store, and kept in `store`'s
    replay cache once that read's fill is in."""
    c, r = keys()
    assert await store.claim_unless_done(c, r, "t", 30) is CLAIMED
    assert await store.publish(r, value, ttl_ms, c, "t") is Published.STORED
    if duplicated:
        replays = store._executor.replays
        assert replays is not None
        assert await store.claim_unless_done(c, r, "u", 30) == value
        await until(lambda: replays.cached(r.encode()) is not None)
    return r


def tracked_keys(server: Server) -> int:
    """The keys in the server's tracking table, of every client."""
    with server.sync_client() as client:
        return int(client.info("stats")["tracking_total_keys"])


def claim_key(r: str) -> str:
    return r[:-1] + "c"


async def test_a_key_is_tracked_from_its_first_duplicate_and_then_replays_from_memory(
    store: RedisStore, server: Server
) -> None:
    """A first run tracks nothing (most keys never see a duplicate): the server's tracking
    table grows only with the keys that had one. The first duplicate reads the store and
    fills the cache (its result and its claim tracked); later ones send no command."""
    tracked = tracked_keys(server)
    r = await completed(store, b"\x00answer\xff", duplicated=False)
    assert tracked_keys(server) == tracked
    assert not kept(store, r)
    before = commands_served(server)
    assert await store.claim_unless_done(claim_key(r), r, "u", 30) == b"\x00answer\xff"
    assert commands_served(server) > before
    await until(lambda: kept(store, r))
    assert tracked_keys(server) == tracked + 2
    before = commands_served(server)
    for _ in range(3):
        assert await store.claim_unless_done(claim_key(r), r, "u", 30) == b"\x00answer\xff"
    assert commands_served(server) == before


async def test_a_replay_read_from_the_store_fills_the_cache_of_another_process(
    store: RedisStore, server: Server
) -> None:
    other = RedisStore.from_url(server.url, replay_cache_bytes=BUDGET)
    try:
        r = await completed(other, duplicated=False)
        before = commands_served(server)
        assert await store.claim_unless_done(claim_key(r), r, "u", 30) == b"done"
        await until(lambda: pipeline_of(store).cached(r.encode()) is not None)
        after_fill = commands_served(server)
        assert after_fill > before  # the claim (and the fill) went to the server
        assert await store.claim_unless_done(claim_key(r), r, "u", 30) == b"done"
        assert commands_served(server) == after_fill
        with server.sync_client() as plain:
            assert pipeline_of(store).cached(r.encode()) == plain.get(r)  # byte for byte
    finally:
        await other.aclose()


async def test_a_key_deleted_by_another_client_is_not_replayed_from_memory(
    store: RedisStore, server: Server
) -> None:
    r = await completed(store)
    with server.sync_client() as plain:
        plain.delete(r, claim_key(r))
    await until(lambda: not kept(store, r))
    assert await store.claim_unless_done(claim_key(r), r, "u", 30) is CLAIMED


async def test_a_lost_claim_is_retaken_by_the_next_duplicate_not_answered_from_memory(
    store: RedisStore, server: Server
) -> None:
    """The claim vanished while the result stayed: as without the cache, the next duplicate
    asks the store, gets the result and takes the claim back."""
    r = await completed(store)
    with server.sync_client() as plain:
        plain.delete(claim_key(r))  # another client: this store learns it from the server
        await until(lambda: not kept(store, r))
        assert await store.claim_unless_done(claim_key(r), r, "u", 30) == b"done"
        assert plain.get(claim_key(r)) == b"u"


async def test_flushall_drops_every_result(store: RedisStore, server: Server) -> None:
    results = [await completed(store) for _ in range(3)]
    with server.sync_client() as plain:
        plain.flushall()
    await until(lambda: not any(kept(store, r) for r in results))
    for r in results:
        assert await store.claim_unless_done(claim_key(r), r, "u", 30) is CLAIMED


async def test_an_expired_result_is_not_replayed_from_memory(
    store: RedisStore, server: Server
) -> None:
    r = await completed(store, ttl_ms=200)
    assert pipeline_of(store).cached(r.encode()) == b"done"
    await asyncio.sleep(0.25)
    # the server may not have expired the key actively yet: the entry ends at the TTL read
    assert pipeline_of(store).cached(r.encode()) is None
    assert await store.claim_unless_done(claim_key(r), r, "u", 30) is CLAIMED


async def test_forget_cached_stops_replays_from_memory_at_once(
    store: RedisStore, server: Server
) -> None:
    r = await completed(store)
    store.forget_cached(r)  # the result is still stored: the next replay reads it
    before = commands_served(server)
    assert await store.claim_unless_done(claim_key(r), r, "u", 30) == b"done"
    assert commands_served(server) > before


async def test_an_evicted_result_is_not_replayed_from_memory() -> None:
    server = start_server("redis", args=["--maxmemory", "4mb", "--maxmemory-policy", "allkeys-lru"])
    store = RedisStore.from_url(server.url, replay_cache_bytes=BUDGET)
    try:
        r = await completed(store)
        with server.sync_client() as plain:
            filler = b"x" * 64 * 1024
            for i in range(400):  # 25 MB through a 4 MB server: the oldest keys go
                plain.set(f"filler:{i}", filler)
            assert plain.exists(r) == 0
        await until(lambda: not kept(store, r))
        assert await store.claim_unless_done(claim_key(r), r, "u", 30) is CLAIMED
    finally:
        await store.aclose()
        server.stop()


async def test_a_restarted_server_is_never_answered_from_memory(own_redis: Server) -> None:
    store = RedisStore.from_url(own_redis.url, replay_cache_bytes=BUDGET)
    try:
        r = await completed(store)
        conn = pipeline_of(store)._conn
        assert kept(store, r) and conn is not None
        await asyncio.to_thread(own_redis.restart)  # the loop runs meanwhile, as a server's does
        await until(lambda: conn.cache is None)  # the connection's loss dropped it
        assert await store.claim_unless_done(claim_key(r), r, "u", 30) is CLAIMED
    finally:
        await store.aclose()


async def test_the_cache_is_on_by_default_with_a_small_budget(
    server: Server, monkeypatch: pytest.MonkeyPatch
) -> None:
    monkeypatch.setattr(_autopipeline, "HEARD_SECONDS", 60.0)  # a loaded machine's pauses
    store = RedisStore.from_url(server.url)
    try:
        assert store.replay_cache_bytes == DEFAULT_REPLAY_CACHE_BYTES == 1024 * 1024
        r = await completed(store)  # its first duplicate read it, and the cache kept it
        before = commands_served(server)
        assert await store.claim_unless_done(claim_key(r), r, "u", 30) == b"done"
        assert commands_served(server) == before
    finally:
        await store.aclose()


async def test_a_budget_of_0_turns_the_cache_off_and_nothing_is_tracked(server: Server) -> None:
    name = f"off-{secrets.token_hex(4)}"
    store = RedisStore.from_url(server.url, client_name=name, replay_cache_bytes=0)
    try:
        r = await completed(store, duplicated=False)
        assert store._executor.replays is None
        before = commands_served(server)
        assert await store.claim_unless_done(claim_key(r), r, "u", 30) == b"done"
        assert commands_served(server) > before
        with server.sync_client() as plain:
            mine = [c for c in plain.client_list() if c.get("name") == name]
        assert mine and not any("t" in c["flags"] for c in mine)  # none tracks
    finally:
        await store.aclose()


def test_a_bad_budget_says_what_to_pass(redis_server: Server) -> None:
    with pytest.raises(TypeError, match="replay_cache_bytes must be an int"):
        RedisStore.from_url(redis_server.url, replay_cache_bytes=1.5)  # type: ignore[arg-type]
    with pytest.raises(ValueError, match="replay_cache_bytes must be 0 \\(off\\) or a budget"):
        RedisStore.from_url(redis_server.url, replay_cache_bytes=-1)


async def test_a_server_that_refuses_tracking_leaves_the_cache_off(
    own_redis: Server, caplog: pytest.LogCaptureFixture
) -> None:
    with own_redis.sync_client() as plain:
        plain.acl_setuser(
            "app", enabled=True, passwords=["+pw"], keys=["*"], commands=["+@all", "-client"]
        )
    store = RedisStore.from_url(
        own_redis.url, username="app", password="pw", replay_cache_bytes=BUDGET
    )
    try:
        r = await completed(store, duplicated=False)
        assert await store.claim_unless_done(claim_key(r), r, "u", 30) == b"done"
        assert pipeline_of(store).cached(r.encode()) is None
        assert "refused client-side tracking" in caplog.text
    finally:
        await store.aclose()


def test_a_forks_child_starts_with_nothing_cached(redis_server: Server) -> None:
    store = RedisStore.from_url(redis_server.url, replay_cache_bytes=BUDGET)
    loop = asyncio.new_event_loop()
    try:
        r = loop.run_until_complete(completed(store))

        async def in_the_child() -> tuple[bytes | None, object]:
            with redis_server.sync_client() as plain:
                plain.delete(r, claim_key(r))  # the parent's socket would carry this news
            cached = pipeline_of(store).cached(r.encode())
            return cached, await store.claim_unless_done(claim_key(r), r, "u", 30)

        assert in_child(lambda: repr(asyncio.run(in_the_child()))) == repr((None, CLAIMED))
        # the parent's cache heard of the deletion on its own socket
        gone = until(lambda: not kept(store, r))
        loop.run_until_complete(gone)
    finally:
        loop.run_until_complete(store.aclose())
        loop.close()


def test_each_event_loop_has_its_own_cache_and_forget_cached_reaches_all(
    redis_server: Server,
) -> None:
    store = RedisStore.from_url(redis_server.url, replay_cache_bytes=BUDGET)
    r = asyncio.run(completed(store))

    async def replay_twice() -> list[object]:
        c = claim_key(r)
        first = await store.claim_unless_done(c, r, "u", 30)
        await until(lambda: pipeline_of(store).cached(r.encode()) is not None)
        return [first, await store.claim_unless_done(c, r, "u", 30)]

    loops = [asyncio.new_event_loop() for _ in range(2)]
    try:
        assert loops[0].run_until_complete(replay_twice()) == [b"done", b"done"]
        assert loops[1].run_until_complete(replay_twice()) == [b"done", b"done"]
        pipelines = {loop: store._loops[loop].replays for loop in loops}
        assert len({id(p) for p in pipelines.values()}) == 2
        store.forget_cached(r)

        async def still_kept() -> bool:
            return kept(store, r)

        assert [loop.run_until_complete(still_kept()) for loop in loops] == [False, False]
    finally:
        for loop in loops:
            loop.run_until_complete(store.aclose())
            loop.close()


async def test_a_memory_store_has_nothing_to_forget() -> None:
    store = MemoryStore()
    assert await store.claim_unless_done("c", "r", "t", 30) is CLAIMED
    await store.publish("r", b"done", 60_000, "c", "t")
    store.forget_cached("r")
    assert await store.claim_unless_done("c", "r", "u", 30) == b"done"


async def test_a_silent_server_is_not_answered_from_memory(own_redis: Server) -> None:
    """A server that stopped answering (paused here; a partition looks the same) cannot push
    invalidations: the cache stops serving once the connection has heard nothing for
    `HEARD_SECONDS`, though it still holds the result."""
    store = RedisStore.from_url(own_redis.url, replay_cache_bytes=BUDGET)
    try:
        r = await completed(store)
        os.kill(own_redis.pid, signal.SIGSTOP)
        try:
            await until(lambda: pipeline_of(store).cached(r.encode()) is None)
            assert kept(store, r)
        finally:
            os.kill(own_redis.pid, signal.SIGCONT)
        assert await store.claim_unless_done(claim_key(r), r, "u", 30) == b"done"
        assert pipeline_of(store).cached(r.encode()) == b"done"  # heard again: serving
    finally:
        await store.aclose()


def test_the_budget_drops_the_oldest_fill_first() -> None:
    value = b"v" * 100
    cost = 2 + len(value) + ENTRY_OVERHEAD
    cache = ReplayCache(budget=cost * 5)
    for key in (b"a", b"b", b"c", b"d", b"e", b"f"):
        assert cache.start(key, key.upper())
        cache.finish(key, key.upper(), value, 60_000, 0.0)
    assert list(cache.entries) == [b"b", b"c", b"d", b"e", b"f"]
    assert list(cache.claims) == [b"B", b"C", b"D", b"E", b"F"]
    assert cache.size == cost * 5
    assert cache.start(b"big", b"BIG")
    cache.finish(b"big", b"BIG", b"x" * cost * 2, 60_000, 0.0)  # over a quarter of the budget
    assert b"big" not in cache.entries and b"BIG" not in cache.claims


def test_an_invalidation_while_a_fill_is_on_the_wire_spoils_it() -> None:
    cache = ReplayCache(budget=1 << 20)
    assert cache.start(b"r", b"c")
    assert not cache.start(b"r", b"c")  # one fill of a key at a time
    cache.discard(b"c")  # the claim's invalidation spoils the result's fill
    cache.finish(b"r", b"c", b"v", 60_000, 0.0)
    assert cache.get(b"r", 0.0) is None
    assert cache.start(b"r", b"c")
    cache.clear()
    cache.finish(b"r", b"c", b"v", 60_000, 0.0)
    assert cache.get(b"r", 0.0) is None and not cache.claims and not cache.pending


def test_a_claims_invalidation_drops_its_result() -> None:
    cache = ReplayCache(budget=1 << 20)
    assert cache.start(b"r", b"c")
    cache.finish(b"r", b"c", b"v", 60_000, 0.0)
    assert cache.get(b"r", 1.0) == b"v"
    cache.discard(b"c")
    assert cache.get(b"r", 1.0) is None and cache.size == 0 and not cache.claims


def test_no_push_reaches_a_caller_as_its_reply(redis_server: Server) -> None:
    """Invalidations interleave with replies on the shared connection: every caller still
    gets its own reply while another client deletes tracked keys."""

    async def main() -> None:
        store = RedisStore.from_url(redis_server.url, replay_cache_bytes=BUDGET)
        other = redis_server.client()
        try:
            results = [await completed(store, value=b"%d" % i) for i in range(100)]

            async def delete() -> None:
                for r in results:
                    await other.delete(r)

            new = [keys() for _ in range(300)]
            claims = asyncio.gather(*(store.claim_unless_done(c, r, "t", 30) for c, r in new))
            replies, _ = await asyncio.gather(claims, delete())
            assert replies == [CLAIMED] * len(new)
            await until(lambda: not any(kept(store, r) for r in results))
        finally:
            await other.aclose()
            await store.aclose()

    asyncio.run(main())


async def test_forget_drops_the_answer_kept_in_memory_at_once(
    store: RedisStore, server: Server
) -> None:
    """``forget`` in the process that keeps the answer in memory: the next request with the
    key runs again, never answered from memory."""
    key = secrets.token_hex(8)
    names = key_names(b"idem", b"", key.encode())
    assert await store.claim_unless_done(names.claim, names.result, "t", 30) is CLAIMED
    assert await store.publish(names.result, b"done", 60_000, names.claim, "t") is (
        Published.STORED
    )
    assert await store.claim_unless_done(names.claim, names.result, "u", 30) == b"done"
    await until(lambda: pipeline_of(store).cached(names.result) is not None)
    before = commands_served(server)
    assert await store.claim_unless_done(names.claim, names.result, "u", 30) == b"done"
    assert commands_served(server) == before  # from memory
    assert await forget(store, key) is True
    assert await store.claim_unless_done(names.claim, names.result, "u", 30) is CLAIMED


async def test_a_stalled_connection_is_not_answered_from_memory(redis_server: Server) -> None:
    """A connection whose oldest command has gone unanswered past the stall threshold may
    have invalidations stuck behind it: its cache stops serving at once, well before a
    second of silence, though it still holds the result."""
    with Proxy(redis_server.port) as proxy:
        store = RedisStore.from_url(proxy.url, replay_cache_bytes=BUDGET)
        waiting = None
        try:
            r = await completed(store)
            pipeline = pipeline_of(store)
            assert pipeline.cached(r.encode()) == b"done"
            assert proxy.stall(30) >= 1  # the server's replies (and pushes) stop here
            c2, r2 = keys()
            waiting = asyncio.ensure_future(store.claim_unless_done(c2, r2, "t", 30))
            conn = pipeline._conn
            assert conn is not None
            await until(lambda: conn.stalled(), every=0.001)
            assert conn.loop.time() - conn.heard < HEARD_SECONDS  # not yet silent that long
            assert pipeline.cached(r.encode()) is None
            assert kept(store, r)
        finally:
            proxy.reset()
            if waiting is not None:
                await asyncio.gather(waiting, return_exceptions=True)
            await store.aclose()


class FillsJustBeforeItsDelete(RedisStore):
    """A store on which `before_send` runs as a plain command is about to go out, after the
    method sending it has dropped what it changes from the cache: here, a duplicate's fill."""

    before_send: Callable[[], Awaitable[None]] | None = None

    async def _plain(self, command: Awaitable[Any]) -> Any:
        hook, self.before_send = self.before_send, None
        if hook is not None:
            await hook()
        return await super()._plain(command)


async def test_a_fill_read_just_before_a_delete_is_not_served_after_it(
    redis_server: Server,
) -> None:
    """`delete` drops the keys before its DEL (spoiling a fill under way) and again after
    it: a fill sent between the two, read before the DEL and kept, must not answer once the
    delete returned, though the server's invalidation has not reached the cache's
    connection (held up here by a stalled proxy)."""
    with Proxy(redis_server.port) as proxy:
        store = FillsJustBeforeItsDelete.from_url(proxy.url, replay_cache_bytes=BUDGET)
        other = RedisStore.from_url(redis_server.url)
        c, r = keys()
        try:
            assert await other.claim_unless_done(c, r, "t", 30) is CLAIMED
            assert await other.publish(r, b"done", 60_000, c, "t") is Published.STORED
            await store.detect()

            async def fill_then_stall() -> None:
                assert await store.claim_unless_done(c, r, "u", 30) == b"done"
                await until(lambda: kept(store, r))
                await store.client.connection_pool.disconnect()  # the DEL opens a new one
                await until(lambda: proxy.open_connections() == 1)
                assert proxy.stall(30) == 1  # the cache's connection alone

            store.before_send = fill_then_stall
            assert await store.delete(r, c) == 2
            assert store.before_send is None
            assert pipeline_of(store).cached(r.encode()) is None
        finally:
            proxy.reset()
            await other.aclose()
            await store.aclose()
