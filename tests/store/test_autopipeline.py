"""RedisStore's shared, auto-pipelined connection on a real redis-server: batching, reply
order under concurrency and cancellation, timeouts, broken connections, the handshake, and
when it steps aside for redis-py."""

from __future__ import annotations

import asyncio
import logging
import os
import signal
import time
from collections.abc import AsyncIterator, Awaitable, Callable

import pytest
import redis.asyncio
import uvloop
from redis.asyncio.retry import Retry
from redis.backoff import NoBackoff
from redis.exceptions import AuthenticationError, DataError, NoScriptError, ResponseError
from redis.exceptions import ConnectionError as RedisConnectionError
from redis.exceptions import TimeoutError as RedisTimeoutError

from goblin_idem import CLAIMED, RedisStore
from goblin_idem.store import _autopipeline as autopipeline
from goblin_idem.store import _redis as goblin_store
from goblin_idem.store._autopipeline import (
    MAX_DRAINING,
    STALL_SECONDS,
    AutoPipeline,
    _pack_in_python,
    pack,
)
from goblin_idem.store._wire import Packed, claim_step, claim_wire, publish_step, publish_wire
from tests.support.proxy import Proxy
from tests.support.servers import Server, start_server
from tests.support.waits import until


@pytest.fixture
def server(own_redis: Server) -> Server:
    """A server of the test's own: these tests stop, pause and kill its connections."""
    return own_redis


@pytest.fixture
async def store(server: Server) -> AsyncIterator[RedisStore]:
    s = RedisStore.from_url(server.url, mode="script", socket_timeout=0.5)
    yield s
    await s.aclose()


async def reads_processed(client: redis.asyncio.Redis) -> int:
    return int((await client.info("stats"))["total_reads_processed"])


def pipeline_of(store: RedisStore) -> AutoPipeline:
    assert store._pipeline is not None
    return store._pipeline


def test_pack_is_resp_and_refuses_what_redis_py_refuses() -> None:
    commands = [("SET", b"k\r\n", 5), ("GET", "é"), ("INCRBYFLOAT", "f", 1.5)]
    expected = (
        b"*3\r\n$3\r\nSET\r\n$3\r\nk\r\n\r\n$1\r\n5\r\n*2\r\n$3\r\nGET\r\n$2\r\n\xc3\xa9\r\n"
        b"*3\r\n$11\r\nINCRBYFLOAT\r\n$1\r\nf\r\n$3\r\n1.5\r\n"
    )
    assert pack(commands) == expected
    # hiredis packs in C; the Python packer (without hiredis) writes the same bytes
    assert b"".join(_pack_in_python(c) for c in commands) == expected
    for refused in (True, None, object()):  # redis-py's encoder refuses these too
        with pytest.raises(DataError):
            pack([("SET", "k", refused)])
        with pytest.raises(TypeError):
            _pack_in_python(("SET", "k", refused))


@pytest.mark.parametrize("native", [True, False], ids=["native", "script"])
def test_a_first_runs_steps_are_sent_as_their_commands_pack(native: bool) -> None:
    """The two steps' own bytes (`_wire`) are what packing their commands gives, for keys,
    tokens and values of any length (past the table of lengths too)."""
    for key, value in ((b"k", b""), (b"{k}" * 200, b"v" * 511), (b"k\r\n", b"v" * 70_000)):
        for step in (
            claim_step(native, key + b":c", key + b":r", b"tok", 30),
            claim_step(native, b"c", b"r", b"t" * 600, 10**15),
            publish_step(native, key + b":r", value, 86_400_000, key + b":c", b"tok"),
        ):
            assert type(step) is Packed
            assert step.wire == b"".join(_pack_in_python(command) for command in step)
            assert pack(step) is step.wire and pack(list(step)) == step.wire


@pytest.mark.parametrize("native", [True, False], ids=["native", "script"])
def test_a_steps_wire_is_its_commands_bytes_for_every_lease_and_ttl(native: bool) -> None:
    """What the shared connection writes (`Wire`) is the step's packed commands, also for
    more leases and TTLs than the formatted ones kept (`_wire._KEPT`)."""
    for n in (1, 30, 10**15, *range(100, 200)):
        step = claim_step(native, b"c", b"r", b"t", n)
        assert claim_wire(native, b"c", b"r", b"t", n) == (step.wire, len(step))
        step = publish_step(native, b"r", b"v", n, b"c", b"t")
        assert publish_wire(native, b"r", b"v", n, b"c", b"t") == (step.wire, len(step))
        assert step.wire == b"".join(_pack_in_python(command) for command in step)


async def test_concurrent_calls_share_writes_and_get_their_own_replies(
    server: Server, store: RedisStore
) -> None:
    async with server.client() as observer:
        for i in range(0, 200, 2):  # half the keys done, with a result naming them
            await observer.set(f"c{i}", "other")
            await observer.set(f"r{i}", f"result {i}")
        assert await store.cad("warm-up", "x") == 0  # scripts loaded, connection open
        before = await reads_processed(observer)
        replies = await asyncio.gather(
            *(store.claim(f"c{i}", f"r{i}", f"t{i}", 30) for i in range(200))
        )
        reads = await reads_processed(observer) - before
        for i, reply in enumerate(replies):
            assert reply == (f"result {i}".encode() if i % 2 == 0 else CLAIMED)
        for i in range(1, 200, 2):
            assert await observer.get(f"c{i}") == f"t{i}".encode()
        # 200 calls from one turn of the loop reach the server in a few reads (the kernel
        # may split the one write), not 200, over the one connection.
        assert reads <= 30, reads
        assert pipeline_of(store).opened == 1


async def test_transactions_and_single_calls_interleave_without_mixing(
    server: Server, store: RedisStore
) -> None:
    async def first_run(i: int) -> tuple[object, int, bool]:
        claimed = await store.claim(f"c{i}", f"r{i}", f"t{i}", 30)
        published = await store.publish(f"r{i}", f"v{i}".encode(), 60_000, f"c{i}", f"t{i}")
        swapped = await store.cas(f"x{i}", "nope", "new")
        return claimed, published, swapped

    results = await asyncio.gather(*(first_run(i) for i in range(100)))
    assert results == [(CLAIMED, 1, False)] * 100
    replays = await asyncio.gather(*(store.claim(f"c{i}", f"r{i}", "late", 30) for i in range(100)))
    assert replays == [f"v{i}".encode() for i in range(100)]
    async with server.client() as observer:
        assert 59_000 < await observer.pttl("c7") <= 60_000  # CAEXPIRE ran in the same EXEC


async def test_errors_come_back_in_place_with_redis_py_classes(
    server: Server, store: RedisStore
) -> None:
    async with server.client() as observer:
        await observer.hset("h", "f", "v")
    good, bad, good2 = await asyncio.gather(
        store.cas("s", "a", "b"),
        store.cas("h", "a", "b"),
        store.cad("s", "a"),
        return_exceptions=True,
    )
    assert good is False and good2 == 0
    assert type(bad) is ResponseError
    assert str(bad) == "WRONGTYPE Operation against a key holding the wrong kind of value"
    [noscript] = await pipeline_of(store).execute([("EVALSHA", "0" * 40, 0)])
    assert isinstance(noscript, NoScriptError)


async def test_script_cache_flushed_under_the_store_reloads_and_runs_once(
    server: Server, store: RedisStore
) -> None:
    assert await store.claim("c", "r", "t", 30) is CLAIMED
    async with server.client() as observer:
        await observer.script_flush()
        assert await store.publish("r", b"done", 60_000, "c", "t") == 1  # NOSCRIPT inside EXEC
        await observer.script_flush()
        assert await store.claim("c", "r", "t2", 30) == b"done"
        await observer.script_flush()
        assert await store.caexpire_many([("c", "t", 5_000), ("zz", "t", 5_000)]) == [1, 0]
        assert await observer.get("r") == b"done"


async def test_a_silent_server_times_out_every_call_in_flight_then_recovers(
    server: Server, store: RedisStore
) -> None:
    assert await store.claim("c0", "r0", "t", 30) is CLAIMED
    os.kill(server.pid, signal.SIGSTOP)
    try:
        started = time.monotonic()
        replies = await asyncio.gather(
            *(store.claim(f"c{i}", f"r{i}", "t", 30) for i in range(1, 6)),
            return_exceptions=True,
        )
        elapsed = time.monotonic() - started
    finally:
        os.kill(server.pid, signal.SIGCONT)
    assert all(isinstance(r, RedisTimeoutError) for r in replies), replies
    assert 0.4 < elapsed < 2.0  # socket_timeout=0.5, one timer for all five
    # The timed-out connection is dropped: the late replies cannot answer later calls.
    assert await store.claim("c0", "r0", "t", 30) is None
    assert await store.claim("fresh", "rf", "t", 30) is CLAIMED


async def test_a_cancelled_caller_does_not_shift_the_replies_of_the_others(
    server: Server, store: RedisStore
) -> None:
    async with server.client() as observer:
        await observer.set("r-other", "other result")
        await observer.set("c-other", "someone")
    assert await store.cad("warm-up", "x") == 0  # scripts loaded, connection open
    os.kill(server.pid, signal.SIGSTOP)
    try:
        doomed = asyncio.ensure_future(store.claim("c-doomed", "r-doomed", "t", 30))
        survivor = asyncio.ensure_future(store.claim("c-other", "r-other", "t", 30))
        conn = pipeline_of(store)._conn
        assert conn is not None
        written = lambda: len(conn.waiting) == 2 and not conn.pending  # noqa: E731
        await until(written, what="both written, neither answered")
        doomed.cancel()
    finally:
        os.kill(server.pid, signal.SIGCONT)
    assert await survivor == b"other result"
    with pytest.raises(asyncio.CancelledError):
        await doomed
    assert await store.cad("c-doomed", "t") == 1  # its claim ran on the server all the same


async def test_a_connection_killed_by_the_server_fails_its_calls_and_reconnects(
    server: Server, store: RedisStore
) -> None:
    assert await store.claim("c", "r", "t", 30) is CLAIMED
    async with server.client() as observer:
        killed = await observer.client_kill_filter(_type="normal", skipme=True)
        assert killed >= 1
    conn = pipeline_of(store)._conn
    assert conn is not None
    await until(lambda: conn.broken is not None, what="the loop saw the connection close")
    assert await store.claim("c", "r", "t2", 30) is None  # a new connection, same server
    assert await store.cad("c", "t") == 1


async def test_a_store_that_is_down_fails_fast_with_its_address(server: Server) -> None:
    server.stop()
    store = RedisStore.from_url(server.url, mode="native", socket_timeout=0.5)
    try:
        started = time.monotonic()
        with pytest.raises(RedisConnectionError, match=f"127.0.0.1:{server.port}"):
            await store.claim("c", "r", "t", 30)
        assert time.monotonic() - started < 1.0
    finally:
        await store.aclose()


async def test_handshake_sends_auth_db_and_name() -> None:
    server = start_server("redis")
    try:
        with server.sync_client() as admin:
            admin.config_set("requirepass", "s3cret")
        url = f"redis://:s3cret@127.0.0.1:{server.port}/3?client_name=goblin-test"
        store = RedisStore.from_url(url, mode="script")
        try:
            assert await store.claim("c", "r", "t", 30) is CLAIMED
            async with server.client(password="s3cret", db=3) as observer:
                assert await observer.get("c") == b"t"
                names = [c["name"] for c in await observer.client_list()]
                assert names.count("goblin-test") >= 1
            async with server.client(password="s3cret", db=0) as observer:
                assert await observer.get("c") is None
        finally:
            await store.aclose()
        wrong = RedisStore.from_url(
            f"redis://:wrong@127.0.0.1:{server.port}/0", mode="native", autopipeline=True
        )
        try:
            with pytest.raises(AuthenticationError):
                await wrong.claim("c", "r", "t", 30)
        finally:
            await wrong.aclose()
    finally:
        server.stop()


async def test_it_steps_aside_where_it_cannot_keep_redis_py_promises(server: Server) -> None:
    plain = RedisStore.from_url(server.url)
    assert plain._pipeline is not None
    off = RedisStore.from_url(server.url, autopipeline=False)
    waits = RedisStore.from_url(server.url, wait_replicas=1)  # WAIT would block everyone
    tls = RedisStore(redis.asyncio.Redis(host="127.0.0.1", port=server.port, ssl=True))
    try:
        assert off._pipeline is None and waits._pipeline is None and tls._pipeline is None
        assert await off.claim("c", "r", "t", 30) is CLAIMED
        assert await plain.claim("c", "r", "t", 30) is None
    finally:
        for s in (plain, off, waits, tls):
            await s.aclose()


@pytest.mark.parametrize(
    "scenario",
    [
        test_concurrent_calls_share_writes_and_get_their_own_replies,
        test_transactions_and_single_calls_interleave_without_mixing,
        test_script_cache_flushed_under_the_store_reloads_and_runs_once,
        test_a_silent_server_times_out_every_call_in_flight_then_recovers,
        test_a_cancelled_caller_does_not_shift_the_replies_of_the_others,
        test_a_connection_killed_by_the_server_fails_its_calls_and_reconnects,
    ],
    ids=lambda f: f.__name__.removeprefix("test_"),
)
def test_the_same_on_uvloop(
    server: Server, scenario: Callable[[Server, RedisStore], Awaitable[None]]
) -> None:
    """uvicorn runs on uvloop, whose transports and timers are its own."""

    async def run() -> None:
        store = RedisStore.from_url(server.url, mode="script", socket_timeout=0.5)
        try:
            await scenario(server, store)
        finally:
            await store.aclose()

    uvloop.run(run())


async def test_without_hiredis_it_says_so_and_uses_redis_py(
    server: Server, monkeypatch: pytest.MonkeyPatch, caplog: pytest.LogCaptureFixture
) -> None:
    monkeypatch.setattr(autopipeline, "HIREDIS", False)
    monkeypatch.setattr(goblin_store, "HIREDIS", False)
    caplog.set_level(logging.INFO, "goblin_idem.store")
    store = RedisStore.from_url(server.url)
    try:
        assert store._pipeline is None
        assert "auto-pipelining is off because hiredis is not installed" in caplog.text
        assert await store.claim("c", "r", "t", 30) is CLAIMED
    finally:
        await store.aclose()


async def test_closing_the_store_while_it_connects_leaves_no_connection(server: Server) -> None:
    store = RedisStore.from_url(server.url, mode="script")
    claim = asyncio.ensure_future(store.claim("c", "r", "t", 30))
    await asyncio.sleep(0)  # the claim is waiting for the shared connection to open
    await store.aclose()
    with pytest.raises(RedisConnectionError, match="closed by the client"):
        await claim
    async with server.client() as observer:

        async def alone() -> bool:
            return len(await observer.client_list()) == 1

        await until(alone, what="the claim's connection closed")
        assert len(await observer.client_list()) == 1  # the observer alone


async def shared_connection_alone(store: RedisStore, proxy: Proxy) -> None:
    """Detection sends its plain commands on a pooled redis-py connection: close it, so that
    the proxy carries the shared connection alone."""
    await store.detect()
    await store.client.connection_pool.disconnect()
    await until(lambda: proxy.open_connections() == 1, what="one connection through the proxy")


async def test_a_stalled_connection_fails_only_what_was_waiting_on_it(server: Server) -> None:
    with Proxy(server.port) as proxy:
        store = RedisStore.from_url(proxy.url, mode="script", socket_timeout=1.0)
        try:
            await shared_connection_alone(store, proxy)
            assert await store.cad("warm-up", "x") == 0
            assert proxy.stall(1.5) == 1  # the shared connection stops forwarding
            stuck = asyncio.ensure_future(store.claim("c-stuck", "r-stuck", "t", 30))
            await asyncio.sleep(STALL_SECONDS * 2)
            started = time.monotonic()
            # A new call does not queue behind the stuck one: it gets a fresh connection.
            assert await store.claim("c-new", "r-new", "t", 30) is CLAIMED
            assert await store.cad("c-new", "t") == 1
            assert time.monotonic() - started < 0.5
            with pytest.raises(RedisTimeoutError):
                await stuck  # what was already waiting on the stalled socket fails
            # the proxy notices the close once its stall ends
            await until(lambda: proxy.open_connections() == 1, what="the stuck one closed")
            assert proxy.open_connections() == 1  # the stuck one is closed, the new one kept
            assert pipeline_of(store).opened == 2
        finally:
            await store.aclose()


async def test_a_slow_server_does_not_multiply_connections(server: Server) -> None:
    store = RedisStore.from_url(server.url, mode="script", socket_timeout=10.0)
    try:
        assert await store.cad("warm-up", "x") == 0
        os.kill(server.pid, signal.SIGSTOP)
        try:
            calls = []
            for i in range(8):  # every call finds the newest connection stalled
                calls.append(asyncio.ensure_future(store.claim(f"c{i}", f"r{i}", "t", 30)))
                await asyncio.sleep(STALL_SECONDS * 1.5)
        finally:
            os.kill(server.pid, signal.SIGCONT)
        replies = await asyncio.gather(*calls)
        assert replies == [CLAIMED] * 8  # the server was slow, not gone: all answered
        async with server.client() as observer:
            assert len(await observer.client_list()) <= 1 + 1 + MAX_DRAINING
    finally:
        await store.aclose()


async def test_a_late_reply_fails_its_own_call_not_the_ones_behind_it(
    server: Server, monkeypatch: pytest.MonkeyPatch
) -> None:
    monkeypatch.setattr(autopipeline, "STALL_SECONDS", 60.0)  # both calls on one connection
    store = RedisStore.from_url(server.url, mode="script", socket_timeout=0.5)
    try:
        assert await store.cad("warm-up", "x") == 0
        os.kill(server.pid, signal.SIGSTOP)
        try:
            early = asyncio.ensure_future(store.claim("c-early", "r", "t", 30))
            await asyncio.sleep(0.3)
            late = asyncio.ensure_future(store.claim("c-late", "r", "t", 30))
            await asyncio.sleep(0.3)  # past the early call's deadline, before the late one's
        finally:
            os.kill(server.pid, signal.SIGCONT)
        with pytest.raises(RedisTimeoutError):
            await early
        assert await late is CLAIMED  # answered in time, on the same connection
        assert await store.claim("c-early", "r", "t2", 30) is None  # the early one ran too
        assert pipeline_of(store).opened == 1
    finally:
        await store.aclose()


@pytest.mark.parametrize("retries", [0, 1])
async def test_the_clients_retry_policy_applies_to_the_shared_connection(
    server: Server, retries: int
) -> None:
    with Proxy(server.port) as proxy:
        store = RedisStore.from_url(
            proxy.url, mode="script", socket_timeout=2.0, retry=Retry(NoBackoff(), retries)
        )
        try:
            await shared_connection_alone(store, proxy)
            assert await store.cad("warm-up", "x") == 0
            proxy.stall(1.0)  # hold the call on the wire, then cut the connection
            call = asyncio.ensure_future(store.claim("c", "r", "t", 30))
            await asyncio.sleep(0.02)
            assert proxy.reset(1.0) == 1
            if retries:
                assert await call is CLAIMED  # sent again on a new connection
                assert pipeline_of(store).opened == 2
            else:
                with pytest.raises(RedisConnectionError):
                    await call
        finally:
            await store.aclose()
