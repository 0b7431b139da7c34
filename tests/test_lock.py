"""Lock: exclusion across processes, renewal by the shared watchdog, freeing after a crash."""

from __future__ import annotations

import asyncio
import os
import signal
import time

import pytest
import redis.asyncio

from goblin_idem import Lock, LockError, LockNotOwnedError, MemoryStore, RedisStore, Store, Watchdog
from tests.support.backends import Backend
from tests.support.procs import APPS, spawn, stop
from tests.support.servers import Server
from tests.support.waits import until


async def test_only_one_holder_at_a_time(store: Store) -> None:
    first = Lock(store, "job", lease_seconds=5)
    second = Lock(store, "job", lease_seconds=5)
    assert await first.acquire()
    assert not await second.acquire(blocking=False)
    assert not await second.acquire(timeout=0.2)
    await first.release()
    assert await second.acquire(blocking=False)
    await second.release()


async def test_renewal_keeps_a_long_holder(store: Store) -> None:
    # Renewed every 300 ms; a lease lapses only if a renewal is 600 ms late, which a loaded
    # machine's scheduling does not cause (a 300 ms lease did, once, under CI).
    lock = Lock(store, "long", lease_seconds=0.9)
    other = Lock(store, "long", lease_seconds=0.9)
    async with lock:
        for renewals in range(1, 9):  # 2.4 s: over two and a half leases' worth
            await until(lambda n=renewals: lock.watchdog.renewals >= n, what=f"{renewals} renewals")
            assert not await other.acquire(blocking=False)
            assert await lock.owned()
        lock.check()
    assert lock.watchdog.renewals >= 3
    assert await store.get("long") is None


async def test_the_first_renewal_of_a_3_s_lease_comes_at_a_third_of_it() -> None:
    """The schedule, read from the store: when PTTL jumps back up, the renewal happened
    (3 s - PTTL) before the read, whenever the read itself ran. A renewal at a third of
    the lease lands at 1 s (later only by the loop's lag), one at half of it at 1.5 s;
    the bounds keep 400 ms for lag and still tell them apart."""
    store = MemoryStore()
    dog = Watchdog(store)
    await store.set("leased", "t", px=3000)
    start = time.monotonic()
    lease = dog.hold("leased", "t", 3000)
    try:
        last = await store.pttl("leased")
        while time.monotonic() - start < 5:
            await asyncio.sleep(0.02)
            ttl = await store.pttl("leased")
            if ttl > last:
                break
            last = ttl
        renewed_at = time.monotonic() - start - (3000 - ttl) / 1000
    finally:
        await dog.release(lease)
    assert dog.renewals == 1
    assert 0.8 <= renewed_at <= 1.4, renewed_at


async def test_lost_lock_raises_lock_not_owned(store: Store) -> None:
    lock = Lock(store, "stolen", lease_seconds=0.3)
    await lock.acquire()
    await store.set("stolen", "thief", px=10_000)
    await until(lambda: lock.lost, what="the next renewal found the thief's token")
    assert lock.lost and not lock.held
    with pytest.raises(LockNotOwnedError):
        lock.check()
    with pytest.raises(LockNotOwnedError):
        await lock.release()
    assert await store.get("stolen") == b"thief"  # the thief's lock was not released


async def test_blocking_acquire_waits_for_release(store: Store) -> None:
    holder = Lock(store, "wait", lease_seconds=5)
    await holder.acquire()
    waiter = Lock(store, "wait", lease_seconds=5, retry_interval=0.02)
    task = asyncio.create_task(waiter.acquire(timeout=5))
    await asyncio.sleep(0.2)
    assert not task.done()
    await holder.release()
    assert await task
    await waiter.release()


async def test_misuse_is_a_clear_error(store: Store) -> None:
    lock = Lock(store, "m")
    with pytest.raises(LockError):
        await lock.release()
    await lock.acquire()
    with pytest.raises(LockError):
        await lock.acquire()
    await lock.release()
    busy = Lock(store, "m2", blocking=False)
    await Lock(store, "m2").acquire()
    with pytest.raises(LockError, match="could not acquire"):
        async with busy:
            pass
    with pytest.raises(ValueError):
        Lock(store, "x", lease_seconds=0)


async def test_middleware_and_locks_share_one_watchdog(backend: Backend) -> None:
    from goblin_idem import IdempotencyMiddleware

    async def app(scope: object, receive: object, send: object) -> None:
        return None

    mw = IdempotencyMiddleware(app, store=backend.store)
    assert Lock(backend.store, "x").watchdog is mw.watchdog is Watchdog.for_store(backend.store)


def lock_holder(server: Server, name: str, lease_ms: int, hold_ms: int, log: str):  # type: ignore[no-untyped-def]
    return spawn(
        ["-m", f"{APPS}.lock_holder", server.url, name, str(lease_ms), str(hold_ms), log], {}
    )


async def logged(client: redis.asyncio.Redis, key: str, n: int) -> list[bytes]:
    """The holders' log `key`, once they have written `n` lines to it."""

    async def enough() -> bool:
        return bool(await client.llen(key) >= n)

    await until(enough, what=f"{n} lines in {key}")
    items: list[bytes] = await client.lrange(key, 0, -1)
    return items


async def test_mutual_exclusion_across_processes(redis_server: Server) -> None:
    client = redis_server.client()
    await client.flushall()
    # a 1 s lease and 1.5 s of work each: without renewal the holders would overlap. (A
    # 300 ms lease let a holder starved of CPU for 200 ms on a loaded machine lose it.)
    procs = [lock_holder(redis_server, "shared", 1000, 1500, "log") for _ in range(3)]
    try:
        log = await logged(client, "log", 6)
        for i in range(0, 6, 2):  # enter/exit strictly paired: never two holders at once
            assert log[i].startswith(b"enter ") and log[i + 1] == b"exit " + log[i][6:]
        for p in procs:
            assert p.wait(timeout=10) == 0
    finally:
        for p in procs:
            stop(p)
        await client.aclose()


async def test_killed_holder_frees_after_its_lease(redis_server: Server) -> None:
    client = redis_server.client()
    await client.flushall()
    proc = lock_holder(redis_server, "crashy", 1000, 60_000, "log")
    store = RedisStore(client, mode="script")
    try:
        await logged(client, "log", 1)
        stop(proc, signal.SIGKILL)  # dies holding the lock
        killed_at = time.monotonic()
        lock = Lock(store, "crashy", lease_seconds=5, retry_interval=0.05)
        assert not await lock.acquire(blocking=False)
        assert await lock.acquire(timeout=5)
        waited = time.monotonic() - killed_at
        assert 0.3 < waited < 2.0  # freed by the lease, not before, not much after
        await lock.release()
    finally:
        stop(proc)
        await client.aclose()


# -- a release cut short can be repeated (a real server, paused to hold a call in flight) ---


async def cancel_release_on_a_paused_server(server: Server, lock: Lock, paused: float) -> None:
    """Pause the server, start a release `paused` seconds later, and cancel it while it
    waits on the server (for a renewal that went out during the pause, or for its delete)."""
    os.kill(server.pid, signal.SIGSTOP)
    try:
        await asyncio.sleep(paused)
        release = asyncio.create_task(lock.release())
        await asyncio.sleep(0.1)
        assert not release.done()  # it waits on the server
        release.cancel()
        with pytest.raises(asyncio.CancelledError):
            await release
    finally:
        os.kill(server.pid, signal.SIGCONT)


@pytest.mark.parametrize("autopipeline", [True, False], ids=["shared", "direct"])
async def test_a_release_cancelled_while_a_renewal_is_in_flight_can_be_repeated(
    own_redis: Server, autopipeline: bool
) -> None:
    store = RedisStore.from_url(own_redis.url, autopipeline=autopipeline)
    lock = Lock(store, "job", lease_seconds=0.6)  # renewed every 200 ms
    try:
        assert await lock.acquire()
        await cancel_release_on_a_paused_server(own_redis, lock, paused=0.3)
        assert lock.held  # nothing was deleted: the lock is still this object's
        await lock.release()  # the repeat completes it
        assert await store.get("job") is None and not lock.held
        with pytest.raises(LockError, match="not held"):
            await lock.release()  # once it completed, a release is a misuse again
    finally:
        await store.aclose()


@pytest.mark.parametrize("autopipeline", [True, False], ids=["shared", "direct"])
async def test_a_release_cancelled_while_its_delete_is_in_flight_can_be_repeated(
    own_redis: Server, autopipeline: bool
) -> None:
    store = RedisStore.from_url(own_redis.url, autopipeline=autopipeline)
    lock = Lock(store, "job", lease_seconds=5)
    try:
        assert await lock.acquire()
        await store.get("warm-up")  # the direct store's connection is open before the pause
        await cancel_release_on_a_paused_server(own_redis, lock, paused=0)
        renewals = lock.watchdog.renewals
        await lock.release()  # whether the first delete ran or not, the repeat completes
        assert await store.get("job") is None and not lock.held
        assert lock.watchdog.renewals == renewals
    finally:
        await store.aclose()


async def test_a_cancelled_release_stops_the_renewals(own_redis: Server) -> None:
    """Never repeated, a release cancelled before its delete still leaves nothing renewing
    the lock: only the renewal already in flight lands, and the lock expires a lease later
    instead of being kept alive by this process."""
    store = RedisStore.from_url(own_redis.url)
    lock = Lock(store, "job", lease_seconds=0.6)
    try:
        assert await lock.acquire()
        await cancel_release_on_a_paused_server(own_redis, lock, paused=0.3)
        assert await store.get("job") == lock.token  # not deleted
        renewals = lock.watchdog.renewals

        async def expired() -> bool:  # a lease later: renewals would have kept it
            return await store.get("job") is None

        await until(expired, what="the lock expired")
        assert lock.watchdog.renewals == renewals
        assert await store.get("job") is None  # expired
    finally:
        await store.aclose()
