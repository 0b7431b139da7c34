"""One store used from several event loops at once: threads each in ``asyncio.run``, as a
synchronous (WSGI) app calls a store, or a loop thread next to the app's own loop.

Every loop gets connections of its own (a copy of the client where another open loop uses
the store's), its own wait for detection and its own lease watchdog; a loop that has
closed leaves no connection open on the server. A MemoryStore's steps stay atomic across
threads."""

from __future__ import annotations

import asyncio
import gc
import itertools
import logging
import secrets
import sys
import threading
import time
from collections import Counter
from collections.abc import Awaitable, Callable, Iterator
from typing import Any, TypeVar

import pytest
import uvloop

from goblin_idem import CLAIMED, Lock, MemoryStore, RedisStore, Store, once
from goblin_idem._lease import Lease, Watchdog
from tests.support.servers import Cluster, Server, start_cluster

T = TypeVar("T")

NAME = "goblin-loops-test"  # the client name of the store's connections, for CLIENT LIST
JOIN_SECONDS = 60  # a thread still running after this is taken as hung


def in_threads(
    count: int, work: Callable[[int], Awaitable[T]], run: Callable[[Any], Any] = asyncio.run
) -> list[T]:
    """`work(i)` in `count` threads, each in an event loop of its own (`run`: asyncio's or
    uvloop's), started together; what each returned (a thread's error is raised here)."""
    start = threading.Barrier(count)
    outcomes: list[Any] = [None] * count

    def thread(i: int) -> None:
        start.wait()
        try:
            outcomes[i] = run(work(i))
        except BaseException as exc:
            outcomes[i] = exc

    threads = [threading.Thread(target=thread, args=(i,), daemon=True) for i in range(count)]
    for t in threads:
        t.start()
    deadline = time.monotonic() + JOIN_SECONDS
    for t in threads:
        t.join(max(0.0, deadline - time.monotonic()))
    hung = sum(t.is_alive() for t in threads)
    assert not hung, f"{hung} of {count} threads never returned"
    for outcome in outcomes:
        if isinstance(outcome, BaseException):
            raise outcome
    return outcomes


def connections(servers: list[Server]) -> int:
    """The store's connections open on `servers` (by client name)."""
    total = 0
    for server in servers:
        with server.sync_client() as c:
            total += sum(1 for client in c.client_list() if client.get("name") == NAME)
    return total


def settled(servers: list[Server], most: int) -> int:
    """The store's connections once the servers have seen closed ones go (a socket shut
    down is dropped by the server on its next turn), or the count after 5 s."""
    deadline = time.monotonic() + 5
    while (found := connections(servers)) > most and time.monotonic() < deadline:
        time.sleep(0.05)
    return found


async def claims(store: Store, tag: str, count: int, concurrency: int) -> Counter[str]:
    """`count` claim steps on fresh keys, `concurrency` at a time: what they ended in."""
    outcomes: Counter[str] = Counter()
    for first in range(0, count, concurrency):
        keys = [f"{{{tag}-{i}}}" for i in range(first, min(first + concurrency, count))]
        replies = await asyncio.gather(
            *(store.claim_unless_done(f"{k}:c", f"{k}:r", b"t", 30) for k in keys),
            return_exceptions=True,
        )
        for reply in replies:
            outcomes["claimed" if reply is CLAIMED else f"{type(reply).__name__}: {reply}"] += 1
    return outcomes


# -- a single server ---------------------------------------------------------------------


@pytest.mark.parametrize(
    ("autopipeline", "threads", "run"),
    [
        (True, 2, asyncio.run),
        (True, 4, asyncio.run),
        (False, 2, asyncio.run),
        (False, 4, asyncio.run),
        (True, 2, uvloop.run),
        (False, 2, uvloop.run),
    ],
    ids=["shared-2", "shared-4", "direct-2", "direct-4", "shared-2-uvloop", "direct-2-uvloop"],
)
def test_threads_in_loops_of_their_own_share_one_store(
    redis_server: Server, autopipeline: bool, threads: int, run: Callable[[Any], Any]
) -> None:
    """First calls together (detection from every loop at once), then thousands of claims
    each, with and without the auto-pipelined connection, on asyncio's loops and
    uvloop's: no call fails or hangs, every loop keeps to connections of its own, and
    none is left once the loops have closed."""
    store = RedisStore.from_url(redis_server.url, autopipeline=autopipeline, client_name=NAME)
    tag = secrets.token_hex(4)
    count, concurrency = 4000 // threads, 20

    async def work(i: int) -> Counter[str]:
        return await claims(store, f"{tag}-{i}", count, concurrency)

    assert in_threads(threads, work, run) == [Counter(claimed=count)] * threads
    # The loops have closed; their connections go at the next loop's first call.
    per_loop = 2 if autopipeline else concurrency + 1
    assert connections([redis_server]) <= threads * per_loop
    assert run(work(threads)) == Counter(claimed=count)
    assert settled([redis_server], per_loop) <= per_loop
    run(store.aclose())
    assert settled([redis_server], 0) == 0


@pytest.mark.parametrize("autopipeline", [True, False], ids=["shared", "direct"])
def test_claim_and_publish_from_four_threads(redis_server: Server, autopipeline: bool) -> None:
    """Every step of a request (claim, publish, a duplicate's claim, renewals, plain
    commands) from four loops at once on one store."""
    store = RedisStore.from_url(redis_server.url, autopipeline=autopipeline, client_name=NAME)
    tag = secrets.token_hex(4)

    async def work(t: int) -> Counter[str]:
        outcomes: Counter[str] = Counter()

        async def one(i: int) -> str:
            c, r = f"{{{tag}-{t}-{i}}}:c", f"{{{tag}-{t}-{i}}}:r"
            seen = [await store.claim_unless_done(c, r, b"t", 30)]
            seen.append(await store.publish(r, b"done", 30_000, c, b"t"))
            seen.append(await store.claim_unless_done(c, r, b"u", 30))
            seen.append(await store.caexpire_many([(c, b"t", 30_000)]))
            seen.append(await store.get(r))
            return "ok" if seen == [CLAIMED, 1, b"done", [1], b"done"] else repr(seen)

        for first in range(0, 400, 20):
            replies = await asyncio.gather(
                *(one(i) for i in range(first, first + 20)), return_exceptions=True
            )
            outcomes.update(
                r if isinstance(r, str) else f"{type(r).__name__}: {r}" for r in replies
            )
        return outcomes

    assert in_threads(4, work) == [Counter(ok=400)] * 4
    asyncio.run(store.aclose())
    assert settled([redis_server], 0) == 0


def test_once_run_from_four_threads_each_in_asyncio_run(redis_server: Server) -> None:
    """What a synchronous caller does: ``asyncio.run(fn(...))`` per call, from four
    threads, the same keys in every thread. Each key runs once and every call returns its
    value; the loops' connections do not pile up."""
    store = RedisStore.from_url(redis_server.url, client_name=NAME)
    ran: list[int] = []
    keys = 250
    name = f"once-threads-{secrets.token_hex(4)}"

    @once(store, key=lambda n: n, wait_seconds=10, name=name)
    async def work(n: int) -> int:
        ran.append(n)
        await asyncio.sleep(0)
        return n * 2

    results: list[list[int]] = [[] for _ in range(4)]
    most = [0]

    def thread(t: int, start: threading.Barrier) -> None:
        start.wait()
        for n in range(keys):
            results[t].append(asyncio.run(work(n)))
            if n % 50 == 0:
                most[0] = max(most[0], connections([redis_server]))

    start = threading.Barrier(4)
    threads = [threading.Thread(target=thread, args=(t, start), daemon=True) for t in range(4)]
    for t in threads:
        t.start()
    for t in threads:
        t.join(JOIN_SECONDS)
    assert not any(t.is_alive() for t in threads), "a thread never returned"
    assert results == [[n * 2 for n in range(keys)]] * 4
    assert sorted(ran) == list(range(keys))  # once per key, whichever thread came first
    assert most[0] <= 4 * 3  # the open loops' own (and the closed ones not yet dropped)
    asyncio.run(store.aclose())
    assert settled([redis_server], 0) == 0


# -- a cluster -------------------------------------------------------------------------------


@pytest.fixture(scope="module")
def cluster() -> Iterator[Cluster]:
    cluster = start_cluster("redis", masters=3)
    yield cluster
    cluster.stop()


@pytest.mark.parametrize("autopipeline", [True, False], ids=["shared", "direct"])
def test_threads_share_one_cluster_store(
    cluster: Cluster, autopipeline: bool, caplog: pytest.LogCaptureFixture
) -> None:
    store = RedisStore.from_url(
        cluster.servers[0].url, cluster=True, autopipeline=autopipeline, client_name=NAME
    )
    tag = secrets.token_hex(4)

    async def work(i: int) -> Counter[str]:
        outcomes = await claims(store, f"{tag}-{i}", 600, 20)
        c, r = f"{{{tag}-{i}-0}}:c", f"{{{tag}-{i}-0}}:r"
        outcomes["published"] += await store.publish(r, b"done", 30_000, c, b"t")
        return outcomes

    assert in_threads(2, work) == [Counter(claimed=600, published=1)] * 2

    async def close() -> None:
        await store.aclose()  # drops the closed loops' executors (one on a copy)
        gc.collect()  # redis-py would log a cluster client collected unclosed, here

    with caplog.at_level(logging.ERROR):
        asyncio.run(close())
    assert "Unclosed" not in caplog.text
    assert settled(cluster.servers, 0) == 0


# -- leases and MemoryStore ------------------------------------------------------------------


@pytest.mark.parametrize("kind", ["memory", "redis"])
def test_a_lease_outlives_a_lease_taken_and_released_in_another_loop(
    redis_server: Server, kind: str
) -> None:
    """One watchdog per store, but each lease is renewed in its own loop: a lease taken
    in a second loop, whose loop then ends, must not stop the first loop's renewals."""
    store: Store = MemoryStore() if kind == "memory" else RedisStore.from_url(redis_server.url)
    tag = secrets.token_hex(4)
    first_held, second_done = threading.Event(), threading.Event()

    async def short_lease() -> tuple[bool, int]:
        lock = Lock(store, f"{tag}-short", lease_seconds=0.6)
        await lock.acquire()
        first_held.set()
        await asyncio.to_thread(second_done.wait, 10)
        await asyncio.sleep(1.5)  # over two leases: only renewals keep it
        owned = await lock.owned() and not lock.lost
        await lock.release()
        return owned, lock.watchdog.renewals

    async def long_lease() -> tuple[bool, int]:
        await asyncio.to_thread(first_held.wait, 10)
        lock = Lock(store, f"{tag}-long", lease_seconds=30)
        await lock.acquire()
        await asyncio.sleep(0.5)  # the first loop renews meanwhile
        owned = await lock.owned()
        await lock.release()
        return owned, 0

    def work(i: int) -> Awaitable[tuple[bool, int]]:
        if i == 0:
            return short_lease()

        async def then_done() -> tuple[bool, int]:
            try:
                return await long_lease()
            finally:
                second_done.set()

        return then_done()

    (short_owned, renewals), (long_owned, _) = in_threads(2, work)
    assert short_owned and long_owned
    assert renewals >= 3
    asyncio.run(store.aclose())


def test_a_memory_store_shared_by_threads_has_one_winner_per_key() -> None:
    """Each step is atomic across threads as it is across tasks: four threads claim the
    same keys in the same order, switching as often as the interpreter can, and each key
    has exactly one winner."""
    store = MemoryStore()
    keys = 20_000
    interval = sys.getswitchinterval()
    sys.setswitchinterval(1e-6)
    try:

        async def work(t: int) -> list[int]:
            won = []
            for n in range(keys):
                if await store.claim_unless_done(f"{n}:c", f"{n}:r", b"t%d" % t, 30) is CLAIMED:
                    won.append(n)
            return won

        winners = in_threads(4, work)
    finally:
        sys.setswitchinterval(interval)
    assert sorted(itertools.chain(*winners)) == list(range(keys))


def test_a_lease_in_one_loop_leaves_the_other_loops_renewals_to_them(redis_server: Server) -> None:
    """A second loop's first lease keeps the first loop's renewals where they are: the
    first loop's leases are renewed until that loop releases them, and not after (a
    released lease renewed on, by renewals the watchdog forgot, would keep its key)."""
    store = RedisStore.from_url(redis_server.url)
    dog = Watchdog.for_store(store)
    tag = secrets.token_hex(4)
    keys = [f"{tag}-a1".encode(), f"{tag}-a2".encode(), f"{tag}-b".encode()]
    a_held, b_held, a_done = threading.Event(), threading.Event(), threading.Event()

    def pttls(names: list[bytes]) -> list[int]:
        with redis_server.sync_client() as r:
            return [int(r.pttl(key)) for key in names]

    def hold(key: bytes) -> Lease:
        with redis_server.sync_client() as r:
            r.set(key, b"t", px=600)
        return dog.hold(key, b"t", 600)

    async def first_loop() -> list[int]:
        one = hold(keys[0])
        a_held.set()
        await asyncio.to_thread(b_held.wait, 10)
        two = hold(keys[1])  # after the other loop's first lease
        await asyncio.sleep(1.0)  # over a lease: only renewals keep them
        alive = pttls(keys[:2])
        await dog.release(one)
        await dog.release(two)
        await asyncio.sleep(1.0)  # released: their keys expire
        alive += pttls(keys[:2])
        a_done.set()
        return alive

    async def second_loop() -> list[int]:
        await asyncio.to_thread(a_held.wait, 10)
        lease = hold(keys[2])
        b_held.set()
        await asyncio.to_thread(a_done.wait, 10)
        alive = pttls(keys[2:])
        await dog.release(lease)
        return alive

    first, second = in_threads(2, lambda i: second_loop() if i else first_loop())
    assert first[0] > 0 and first[1] > 0, first  # renewed while held
    assert first[2:] == [-2, -2], first  # not renewed once released
    assert second[0] > 0
    assert dog.lost == 0 and len(dog) == 0
    asyncio.run(store.aclose())
