"""Redis Cluster (3 primaries, 3 replicas): script and native modes, failovers, and the
``wait_replicas`` durability option of RedisStore.

- both modes spread keys over every primary and run each key once;
- a graceful ``CLUSTER FAILOVER`` in the middle of the load loses nothing, with and without
  ``wait_replicas``;
- ``wait_replicas``: the claim and WAIT go to the primary that owns the key on one
  connection (a stopped replica makes the claim fail, where a WAIT on any other connection
  would succeed), follow MOVED after a failover, and fail with 503 when too few replicas ack;
  a publish too few replicas ack is an error the middleware counts and logs;
- a publish never replaces a stored result, on both cluster paths;
- a forced failover with a lagging replica under load, with and without ``wait_replicas``:
  how many handler runs the failover duplicates;
- ``redis-cli --cluster reshard`` under load: no key runs twice while its slot migrates.
"""

from __future__ import annotations

import asyncio
import logging
import os
import random
import secrets
import signal
import subprocess
import time
from collections import Counter
from collections.abc import Iterator
from pathlib import Path

import pytest
import redis.exceptions
from redis.asyncio.cluster import RedisCluster
from redis.crc import key_slot
from starlette.types import Receive, Scope, Send

from goblin_idem import CLAIMED, IdempotencyMiddleware, RedisStore
from goblin_idem._keys import key_names
from goblin_idem.exceptions import NotReplicatedError
from goblin_idem.records._format import decode
from goblin_idem.store import Published
from goblin_idem.store._cluster import TRYAGAIN_SECONDS
from tests.reliability.cluster import failover, primary_of, settled_cluster, shards, wait_settled
from tests.reliability.failover import FailoverResult, failover_under_load
from tests.reliability.report import FULL, ms, pick, record
from tests.support.backends import assert_published_together_or_not_at_all
from tests.support.inproc import CountingApp, Tally, send_once, until_done
from tests.support.proxy import Proxy, resp_args
from tests.support.servers import Cluster, Server, start_cluster, start_server
from tests.support.waits import until_sync

KEYS = pick(120, 1200)
DUPLICATES = 3


@pytest.fixture(scope="module")
def cluster(native_module: Path) -> Iterator[Cluster]:
    with settled_cluster("redis", modules=[str(native_module)]) as c:
        yield c


async def _initialized(store: RedisStore) -> None:
    client = store.client
    assert isinstance(client, RedisCluster)
    await client.initialize()


async def _exercise(
    mw: IdempotencyMiddleware, keys: list[str], tally: Tally, concurrent: int = 12
) -> None:
    gate = asyncio.Semaphore(concurrent)
    deadline = time.monotonic() + 60

    async def one(key: str) -> None:
        async with gate:
            await asyncio.gather(*(until_done(mw, key, tally, deadline) for _ in range(DUPLICATES)))

    await asyncio.gather(*(one(k) for k in keys))


@pytest.mark.parametrize("mode", ["script", "native"])
async def test_cluster_spreads_keys_over_every_primary(cluster: Cluster, mode: str) -> None:
    namespace = f"idem-{mode}-{random.getrandbits(24):06x}"
    store = RedisStore.from_url(cluster.servers[0].url, cluster=True, mode=mode)  # type: ignore[arg-type]
    handler = CountingApp(work_s=0.005)
    mw = IdempotencyMiddleware(handler, store=store, namespace=namespace, lease_seconds=2)
    keys = [f"{mode}-{i:05d}" for i in range(KEYS)]
    tally = Tally()
    try:
        assert await store.detect() == mode
        # Warm the cluster client first, so the figures measure steady load.
        await _initialized(store)
        started = time.monotonic()
        await _exercise(mw, keys, tally)
        duration = time.monotonic() - started
        replays = [await send_once(mw, k) for k in keys]
        per_primary: Counter[int] = Counter(
            primary_of(store, key_names(namespace.encode(), b"", k.encode()).claim) for k in keys
        )
        stored = 0
        for shard in shards(cluster):
            with shard.primary.sync_client() as c:
                stored += sum(1 for _ in c.scan_iter(match=f"{namespace}:*", count=1000))
    finally:
        await store.aclose()

    statuses = Counter(a.status for _, a in tally.answers)
    runs = {k: len(handler.runs[k]) for k in keys}
    record(
        f"cluster-{mode}",
        f"Redis Cluster, {mode} mode: keys over 3 primaries",
        {
            "mode": mode,
            "keys": KEYS,
            "requests": len(tally.answers),
            "keys_per_primary": sorted(per_primary.values()),
            "side_effects": sum(runs.values()),
            "duplicate_runs": sum(runs.values()) - KEYS,
            "status_counts": {str(k): v for k, v in sorted(statuses.items())},
            "duration_s": round(duration, 2),
        },
        checks=["keys on all 3 primaries; each key ran once; every key replays afterwards"],
    )
    assert len(per_primary) == 3 and min(per_primary.values()) > 0
    assert stored == 2 * KEYS  # a claim and a result per key, on the primaries
    assert runs == dict.fromkeys(keys, 1), {k: n for k, n in runs.items() if n != 1}
    assert all(a.status in (201, 409) and not a.escaped for _, a in tally.answers), statuses
    for reply in replays:
        assert reply.status == 201 and reply.replayed, reply


@pytest.mark.parametrize("wait", [0, 1])
async def test_cluster_graceful_failover_under_load(cluster: Cluster, wait: int) -> None:
    """``CLUSTER FAILOVER`` (the replica catches up before it takes over) loses no write, so
    no key may run twice. Runs after an exception out of the middleware would be counted
    apart."""
    await asyncio.to_thread(wait_settled, cluster)
    store = RedisStore.from_url(
        cluster.servers[0].url, cluster=True, mode="script", wait_replicas=wait
    )
    handler = CountingApp(work_s=0.005)
    tally = Tally()
    mw = IdempotencyMiddleware(
        handler,
        store=store,
        namespace=f"gf{wait}-{random.getrandbits(24):06x}",
        lease_seconds=1,
        on_event=tally.on_event,
    )
    keys = [f"gf-{i:05d}" for i in range(KEYS)]
    try:
        await _initialized(store)
        victim = shards(cluster)[0]
        assert victim.replica is not None
        started = time.monotonic()
        load = asyncio.create_task(_exercise(mw, keys, tally))
        await asyncio.sleep(pick(0.3, 1.0))
        promoted_s = await asyncio.to_thread(failover, victim.replica)
        await load
        duration = time.monotonic() - started
        await asyncio.to_thread(wait_settled, cluster)
        await asyncio.sleep(1.3)  # claims left by exceptions lapse; their keys may run again
        for k in keys:
            await until_done(mw, k, tally, time.monotonic() + 10)
        replays = [await send_once(mw, k) for k in keys]
    finally:
        await store.aclose()

    mw_ns = mw.namespace
    failed = {h for e, h in tally.events if e == "publish_errors"}
    escaped_keys = {k for k, a in tally.answers if a.escaped}
    escaped = Counter(a.escaped.split(":", 1)[0] for _, a in tally.answers if a.escaped)
    extra = {k: len(handler.runs[k]) - 1 for k in keys if len(handler.runs[k]) > 1}
    silent = {
        k: n
        for k, n in extra.items()
        if k not in escaped_keys and key_names(mw_ns, b"", k.encode()).hash not in failed
    }
    statuses = Counter(a.status for _, a in tally.answers)
    record(
        f"cluster-graceful-failover-wait{wait}",
        f"Redis Cluster, graceful CLUSTER FAILOVER under load, wait_replicas={wait}",
        {
            "mode": "script",
            "wait_replicas": wait,
            "keys": KEYS,
            "requests": len(tally.answers),
            "promotion_ms": round(promoted_s * 1000, 1),
            "duplicate_runs": sum(extra.values()),
            "silent_loss_duplicates": sum(silent.values()),
            "duplicates_after_exception_out_of_middleware": sum(
                n for k, n in extra.items() if k in escaped_keys
            ),
            "exceptions_out_of_middleware": dict(escaped),
            "status_counts": {str(k): v for k, v in sorted(statuses.items())},
            "duration_s": round(duration, 2),
        },
        checks=[
            "no key ran twice without an exception out of the middleware or a failed "
            "publish for it",
            "no exception out of the middleware at all (every store call goes over the "
            "store's own primary connections: shared ones with 0, redis-py ones with 1)",
            "afterwards every key replays",
        ],
    )
    assert not silent, silent
    assert not escaped, next(a.trace for _, a in tally.answers if a.escaped)
    for reply in replays:
        assert reply.status == 201 and reply.replayed, reply


async def test_wait_replicas_on_a_primary_with_a_replica() -> None:
    primary = start_server("redis", args=["--repl-diskless-sync-delay", "0"])
    replica = start_server("redis", args=["--replicaof", "127.0.0.1", str(primary.port)])
    handler = CountingApp()
    store = RedisStore.from_url(primary.url, wait_replicas=1, wait_timeout_seconds=0.3)
    too_many = RedisStore.from_url(primary.url, wait_replicas=2, wait_timeout_seconds=0.1)
    try:
        _wait_link(primary)
        mw = IdempotencyMiddleware(handler, store=store, lease_seconds=2)
        names = key_names(b"idem", b"", b"w-1")
        first = await send_once(mw, "w-1")
        assert first.status == 201
        with replica.sync_client() as r:  # WAITed: on the replica once answered
            stored = r.get(names.result)
            assert stored is not None and decode(stored).body == first.body
            assert r.get(names.claim) is not None and r.pttl(names.claim) > 2000  # published
        await store.client.delete(names.claim)  # lost: the result wins, nothing runs
        lost = await send_once(mw, "w-1")
        assert lost.status == 201 and lost.replayed and len(handler.runs["w-1"]) == 1

        # Asking for more replicas than acknowledge: a clear error, 503, nothing run.
        with pytest.raises(NotReplicatedError, match=r"[01] of 2") as info:
            await too_many.claim(b"c{x}", b"r{x}", b"tok", 5)
        assert isinstance(info.value, redis.exceptions.RedisError)
        assert "1 of 2" in str(info.value)

        # The replica stops answering: a new key gets 503 and its claim stays for the lease.
        os.kill(replica.pid, signal.SIGSTOP)
        try:
            refused = await send_once(mw, "w-2")
            assert (refused.status, refused.slug) == (503, "store-unavailable")
            assert "w-2" not in handler.runs
            claim_ttl = await store.client.pttl(key_names(b"idem", b"", b"w-2").claim)
            assert 0 < claim_ttl <= 2000
            replay = await send_once(mw, "w-1")  # a done key still replays (after the WAIT)
            assert replay.status == 201 and replay.replayed
        finally:
            os.kill(replica.pid, signal.SIGCONT)
        again = await send_once(mw, "w-2")  # the claim of the refused request holds it ...
        assert (again.status, again.slug) == (409, "in-flight")
        await asyncio.sleep(claim_ttl / 1000 + 0.1)  # ... until its lease expires
        done = await send_once(mw, "w-2")
        assert done.status == 201 and not done.replayed
        assert {k: len(v) for k, v in handler.runs.items()} == {"w-1": 1, "w-2": 1}
    finally:
        await store.aclose()
        await too_many.aclose()
        replica.stop()
        primary.stop()


async def test_a_publish_too_few_replicas_acknowledge_is_an_error_counted_and_logged(
    caplog: pytest.LogCaptureFixture,
) -> None:
    """``wait_replicas``: a publish that fewer replicas acknowledge than asked raises
    NotReplicatedError (the write stays on the primary); the middleware retries it while
    the claim holds, then counts ``publish_errors`` and logs it, and the client still gets
    its response."""
    primary = start_server("redis", args=["--repl-diskless-sync-delay", "0"])
    replica = start_server("redis", args=["--replicaof", "127.0.0.1", str(primary.port)])
    store = RedisStore.from_url(primary.url, wait_replicas=1, wait_timeout_seconds=0.1)
    handler = CountingApp()
    paused = False

    async def pausing_the_replica(scope: Scope, receive: Receive, send: Send) -> None:
        nonlocal paused
        os.kill(replica.pid, signal.SIGSTOP)  # the claim was acknowledged; the publish is not
        paused = True
        await handler(scope, receive, send)

    try:
        _wait_link(primary)
        assert await store.claim(b"{p}:c", b"{p}:r", b"t", 30) is CLAIMED
        os.kill(replica.pid, signal.SIGSTOP)
        paused = True
        with pytest.raises(NotReplicatedError, match=r"0 of 1 replica\(s\) acknowledged the "):
            await store.publish(b"{p}:r", b"v", 60_000, b"{p}:c", b"t")
        with primary.sync_client() as r:
            assert r.get(b"{p}:r") == b"v" and r.pttl(b"{p}:c") > 30_000  # on the primary
        os.kill(replica.pid, signal.SIGCONT)
        paused = False

        mw = IdempotencyMiddleware(pausing_the_replica, store=store, lease_seconds=1)
        with caplog.at_level(logging.ERROR, logger="goblin_idem.middleware"):
            reply = await send_once(mw, "p-1")
        assert reply.status == 201 and not reply.replayed
        assert mw.counters.publish_errors == 1
        hashed = key_names(b"idem", b"", b"p-1").hash
        lines = [r.getMessage() for r in caplog.records]
        assert any(
            f"could not publish the response for key {hashed}" in line
            and "NotReplicatedError" in line
            for line in lines
        ), lines
    finally:
        if paused:
            os.kill(replica.pid, signal.SIGCONT)
        await store.aclose()
        replica.stop()
        primary.stop()


@pytest.mark.parametrize("path", ["shared", "redis-py", "wait_replicas"])
@pytest.mark.parametrize("mode", ["script", "native"])
async def test_publish_never_replaces_a_result_in_a_cluster(
    cluster: Cluster, mode: str, path: str
) -> None:
    """On both cluster paths (and with WAIT): a publish over a stored result writes
    nothing (SUPERSEDED), a repeat of the same publish is its own (STORED)."""
    await asyncio.to_thread(wait_settled, cluster)
    store = RedisStore.from_url(
        cluster.servers[0].url,
        cluster=True,
        mode=mode,  # type: ignore[arg-type]
        autopipeline=path == "shared",
        wait_replicas=int(path == "wait_replicas"),
    )
    tag = secrets.token_hex(4)
    c, r = f"{{{tag}}}:c".encode(), f"{{{tag}}}:r".encode()
    try:
        assert await store.claim(c, r, b"a", 30) is CLAIMED
        assert await store.publish(r, b"first", 60_000, c, b"a") == Published.STORED
        assert await store.publish(r, b"first", 60_000, c, b"a") == Published.STORED
        assert await store.delete(c) == 1  # the claim lapses; another run takes the key
        assert await store.claim(c, r, b"b", 30) is CLAIMED
        assert await store.publish(r, b"late", 90_000, c, b"b") == Published.SUPERSEDED
        assert await store.get(r) == b"first"
        started = time.monotonic()
        claim_ttl = await store.pttl(c)
        result_ttl = await store.pttl(r)
        between_ms = (time.monotonic() - started) * 1000  # a loaded machine reads slowly
        assert 0 < claim_ttl <= result_ttl + 5 + between_ms
    finally:
        await store.aclose()


def _wait_link(primary: Server) -> None:
    """Until the replica acknowledges writes (after its first sync has loaded)."""
    deadline = time.monotonic() + 20
    with primary.sync_client() as r:
        while True:
            r.set("replica-ready", 1)
            if int(r.execute_command("WAIT", 1, 200)) >= 1:
                r.delete("replica-ready")
                return
            assert time.monotonic() < deadline, "the replica never acknowledged"


def test_wait_replicas_arguments() -> None:
    client = redis.asyncio.Redis()
    with pytest.raises(ValueError):
        RedisStore(client, wait_replicas=1, wait_timeout_seconds=0)
    with pytest.raises(ValueError):
        RedisStore(client, wait_replicas=-1)
    with pytest.raises(TypeError):
        RedisStore(client, wait_replicas=True)
    store = RedisStore.from_url("redis://127.0.0.1:1/0", wait_replicas=2, wait_timeout_seconds=0.05)
    assert (store.wait_replicas, store.wait_timeout_ms) == (2, 50)


async def test_wait_replicas_in_a_cluster_follows_the_primary(cluster: Cluster) -> None:
    await asyncio.to_thread(wait_settled, cluster)
    store = RedisStore.from_url(
        cluster.servers[0].url,
        cluster=True,
        mode="script",
        wait_replicas=1,
        wait_timeout_seconds=0.3,
    )
    try:
        await store.detect()
        layout = shards(cluster)
        by_port = {s.primary.port: s for s in layout}
        keys = [f"wc-{i}".encode() for i in range(60)]
        for k in keys:
            assert await store.claim(b"c{" + k + b"}", b"r{" + k + b"}", b"tok", 30) is CLAIMED
            shard = by_port[primary_of(store, b"c{" + k + b"}")]
            assert shard.replica is not None
            with shard.replica.sync_client() as r:  # the claim was acknowledged there
                r.execute_command("READONLY")
                assert r.get(b"c{" + k + b"}") == b"tok"
        assert len({primary_of(store, b"c{" + k + b"}") for k in keys}) == 3

        # One shard's replica stops: its claims fail (WAIT ran on the connection that
        # wrote; on any other connection it would have been satisfied), the others go on.
        stopped = layout[0]
        assert stopped.replica is not None
        mine = next(k for k in keys if primary_of(store, b"c{" + k + b"}") == stopped.primary.port)
        other = next(k for k in keys if primary_of(store, b"c{" + k + b"}") != stopped.primary.port)
        os.kill(stopped.replica.pid, signal.SIGSTOP)
        try:
            with pytest.raises(NotReplicatedError):
                await store.claim(b"c2{" + mine + b"}", b"r2{" + mine + b"}", b"tok", 30)
            assert (
                await store.claim(b"c2{" + other + b"}", b"r2{" + other + b"}", b"t", 30) is CLAIMED
            )
        finally:
            os.kill(stopped.replica.pid, signal.SIGCONT)

        # A graceful failover: the old primary answers MOVED; the store follows it.
        await asyncio.to_thread(failover, stopped.replica)
        await asyncio.to_thread(wait_settled, cluster)
        assert await store.claim(b"c3{" + mine + b"}", b"r3{" + mine + b"}", b"tok", 30) is CLAIMED
        assert primary_of(store, b"c3{" + mine + b"}") == stopped.replica.port
        with stopped.primary.sync_client() as r:  # now the replica of that shard
            r.execute_command("READONLY")
            assert r.get(b"c3{" + mine + b"}") == b"tok"
        assert (
            await store.publish(b"r3{" + mine + b"}", b"v", 5000, b"c3{" + mine + b"}", b"tok") == 1
        )
        assert ("127.0.0.1", stopped.replica.port) in store._executor.primaries  # type: ignore[attr-defined]
    finally:
        await store.aclose()


async def test_cluster_failover_duplicates_with_and_without_wait(native_module: Path) -> None:
    """A forced failover with a lagging replica loses acknowledged writes; ``wait_replicas=1``
    keeps the claims and results that answers were based on."""
    modes = ["script", "native"] if FULL else ["script"]
    trials = pick(1, 2)
    results: list[tuple[int, FailoverResult]] = []
    for mode in modes:
        for trial in range(1, trials + 1):
            for wait in (0, 1):
                result = await failover_under_load(
                    mode=mode,  # type: ignore[arg-type]
                    wait_replicas=wait,
                    modules=[str(native_module)] if mode == "native" else [],
                    clients=pick(12, 16),
                    warmup=pick(1.0, 2.0),
                    after=pick(1.5, 3.0),
                    lease=pick(1, 2),
                )
                results.append((trial, result))
    for trial, r in results:
        record(
            f"failover-{r.mode}-wait{r.wait_replicas}-trial{trial}",
            f"Redis Cluster forced failover, {r.mode} mode, wait_replicas={r.wait_replicas}"
            + (f", trial {trial}" if trials > 1 else ""),
            r.figures(),
            checks=[
                "wait_replicas=1: no silent-loss duplicate (only runs whose publish failed "
                "may run again)",
                "wait_replicas=0: the lagging replica loses acknowledged claims/results, "
                "seen as duplicate runs",
            ],
            notes=[
                "the replica of the failed shard lags by 250 ms (a delaying proxy on its "
                "replication link), so the loss window is visible at loopback speed",
                "the cluster publish goes as MULTI/EXEC on one connection of the key's "
                "primary: the shared one with wait_replicas=0, a plain redis-py one with 1 "
                "(redis-py 8.1's async cluster transaction pipeline breaks after a topology "
                "change)",
            ],
        )
    for _, r in results:
        assert r.unresolved_keys == 0, r.figures()
        if r.wait_replicas:
            assert r.silent_loss_duplicates == 0, r.figures()
            assert r.escaped_exception_duplicates == 0, r.figures()
        else:
            assert r.silent_loss_duplicates > 0, r.figures()  # the scenario does lose writes


@pytest.mark.parametrize("mode", ["script", "native"])
async def test_cluster_killed_primary_under_load_on_the_fast_path(
    native_module: Path, mode: str
) -> None:
    """A primary SIGKILLed under load and its replica promoted, the store on its fast path
    (one shared connection per primary): calls to the dead primary fail as store errors
    (never resent while it still owns the slot), then follow MOVED to the new primary.

    No replication lag is injected, yet replication stays asynchronous: a claim the primary
    acknowledged in the instant before the kill may not have reached the replica, and its
    key then runs again (``wait_replicas`` is the option against that; it keeps redis-py's
    path). Usually none does; each client has at most one request in flight, so at most
    `clients` can. Any other second run (after an exception out of the middleware, or a
    failed publish) fails the test."""
    clients = pick(12, 16)
    result = await failover_under_load(
        mode=mode,  # type: ignore[arg-type]
        wait_replicas=0,
        modules=[str(native_module)] if mode == "native" else [],
        lag=0.0,
        clients=clients,
        warmup=pick(1.0, 2.0),
        after=pick(1.5, 3.0),
        lease=pick(1, 2),
    )
    record(
        f"failover-fast-path-{mode}",
        f"Redis Cluster, primary killed under load, {mode} mode, shared connection per primary",
        result.figures(),
        checks=[
            "the store used executors.ClusterPipelined",
            "every key completed; no exception out of the middleware",
            "a second run only where the failover lost an acknowledged claim (asynchronous "
            "replication, no WAIT), at most one per client",
        ],
        notes=["no replication delay injected: the replica is as current as loopback allows"],
    )
    assert result.executor == "ClusterPipelined", result.figures()
    assert result.unresolved_keys == 0, result.figures()
    assert result.keys_on_victim > 0, result.figures()
    assert sum(result.escaped.values()) == 0, result.figures()
    assert result.duplicate_runs == result.silent_loss_duplicates <= clients, result.figures()


@pytest.mark.parametrize("mode", ["script", "native"])
async def test_cluster_publish_lands_together_or_not_at_all_when_the_connection_drops_between(
    cluster: Cluster, mode: str
) -> None:
    """The cluster path sends publish to the key's primary over one connection: cut it
    after the server has read the SET and before the claim's CAEXPIRE, and neither may take
    effect (the server saw MULTI and the SET, then the client go without EXEC)."""
    await asyncio.to_thread(wait_settled, cluster)
    proxies = {s.primary.port: Proxy(s.primary.port).start() for s in shards(cluster)}
    tag = secrets.token_hex(4)
    claim_key, result_key, value = f"{{{tag}}}:c", f"{{{tag}}}:r", b"result " + tag.encode()
    try:

        def through_proxy(address: tuple[str, int]) -> tuple[str, int]:
            proxy = proxies.get(address[1])
            return ("127.0.0.1", proxy.port) if proxy is not None else address

        store = RedisStore.from_url(
            cluster.servers[0].url,
            cluster=True,
            mode=mode,  # type: ignore[arg-type]
            address_remap=through_proxy,
            socket_timeout=5,
        )
        try:
            # Discover the layout first: redis-py remaps the addresses it discovers, but a
            # command that initializes the client lazily can leave the startup node's real
            # address in its slot table.
            await _initialized(store)
            assert await store.claim(claim_key, result_key, "tok", 30) is CLAIMED
            for proxy in proxies.values():
                proxy.cut_after(resp_args(value, "PX", 60_000))
            with pytest.raises(redis.exceptions.ConnectionError):
                await store.publish(result_key, value, 60_000, claim_key, "tok")
            assert sum(p.cuts for p in proxies.values()) == 1
        finally:
            await store.aclose()
    finally:
        for proxy in proxies.values():
            proxy.stop()
    direct = cluster.client()
    try:
        await assert_published_together_or_not_at_all(direct, result_key, claim_key, b"tok", 30_000)
    finally:
        await direct.aclose()


async def test_cluster_publish_after_a_node_failure_is_a_store_error() -> None:
    """A primary dies: its keys fail as store errors; a live primary's keys can still be
    published while the cluster serves partial coverage, and once it declares itself down,
    a publish is a store error that stores nothing."""
    small = start_cluster("redis", masters=3)
    store = RedisStore.from_url(small.servers[0].url, cluster=True, mode="script", socket_timeout=1)
    try:
        client = store.client
        assert isinstance(client, RedisCluster)
        await client.initialize()
        dead, live = small.servers[2], small.servers[:2]
        keys = [f"n{i}".encode() for i in range(100)]
        on_dead = next(k for k in keys if primary_of(store, b"c{" + k + b"}") == dead.port)
        alive = next(k for k in keys if primary_of(store, b"c{" + k + b"}") != dead.port)
        claim, result = b"c{" + alive + b"}", b"r{" + alive + b"}"
        assert await store.claim(claim, result, b"t", 30) is CLAIMED
        _require_full_coverage(small.servers, False)
        dead.kill()
        with pytest.raises(redis.exceptions.RedisError):
            await store.claim(b"c{" + on_dead + b"}", b"r{" + on_dead + b"}", b"t", 30)

        assert await store.publish(result, b"v1", 5000, claim, b"t") == 1
        owner = next(s for s in live if s.port == primary_of(store, claim))
        with owner.sync_client() as r:
            assert r.get(result) == b"v1" and 4000 < r.pttl(claim) <= 5000

        _require_full_coverage(live, True)
        await asyncio.to_thread(_wait_cluster_state, live, "fail")
        with pytest.raises(redis.exceptions.ClusterDownError):
            await store.publish(result, b"v2", 60_000, claim, b"t")
        _require_full_coverage(live, False)  # serving again, to be read
        await asyncio.to_thread(_wait_cluster_state, live, "ok")
        with owner.sync_client() as r:
            assert r.get(result) == b"v1" and r.pttl(claim) <= 5000  # neither write landed
    finally:
        await store.aclose()
        small.stop()


def _require_full_coverage(servers: list[Server], required: bool) -> None:
    for server in servers:
        with server.sync_client() as r:
            r.config_set("cluster-require-full-coverage", "yes" if required else "no")


def _wait_cluster_state(servers: list[Server], state: str, timeout: float = 20.0) -> None:
    def reached() -> bool:
        for server in servers:
            with server.sync_client() as r:
                if r.cluster("INFO")["cluster_state"] != state:
                    return False
        return True

    until_sync(reached, timeout, f"cluster_state {state} on every node", every=0.1)


RESHARD_SLOTS = pick(4, 16)  # slots moved, each holding RESHARD_FILL keys of other data
RESHARD_FILL = pick(5_000, 20_000)
RESHARD_KEYS = pick(150, 1_600)  # idempotency keys sent during the move, all in those slots
RESHARD_CLIENTS = pick(8, 16)


async def test_reshard_under_load_runs_no_key_twice() -> None:
    """``redis-cli --cluster reshard`` moves slots full of keys from one primary to another
    while clients send new keys, and their duplicates, that all fall in those slots. While
    a slot migrates, its keys are split between the two nodes and every command of two keys
    on it (the claim step, publish) is refused with TRYAGAIN until the slot has moved. The
    store sends them again (the claim step for up to 2 s, a publish while its claim holds),
    so no key runs twice, and a request gets 503 only if its slot takes longer than that."""
    cluster = start_cluster("redis", masters=3)
    store = RedisStore.from_url(cluster.servers[0].url, cluster=True, mode="script")
    try:
        src, dst = cluster.servers[0], cluster.servers[1]
        moving = _first_slots(src, RESHARD_SLOTS)
        await asyncio.to_thread(_fill, src, moving, RESHARD_FILL)
        run_id = f"{random.getrandbits(32):08x}"
        keys = _keys_in(moving, RESHARD_KEYS, f"rs-{run_id}")
        handler = CountingApp(work_s=0.05)
        tally = Tally()
        mw = IdempotencyMiddleware(handler, store=store, lease_seconds=2, on_event=tally.on_event)
        await _initialized(store)
        tryagain_before = _tryagain_count(cluster)

        # Spread the keys over the move (about 25,000 keys of data a second on loopback).
        pace = RESHARD_CLIENTS * RESHARD_SLOTS * RESHARD_FILL / 25_000 / RESHARD_KEYS
        waiting = iter(keys)
        deadline = time.monotonic() + 120

        async def client() -> None:
            for key in waiting:
                await asyncio.gather(
                    *(until_done(mw, key, tally, deadline) for _ in range(DUPLICATES))
                )
                await asyncio.sleep(pace)

        clients = [asyncio.create_task(client()) for _ in range(RESHARD_CLIENTS)]
        await asyncio.sleep(0.3)
        started = time.monotonic()
        reshard = await asyncio.to_thread(_reshard, src, dst, RESHARD_SLOTS)
        moved_s = time.monotonic() - started
        await asyncio.gather(*clients)
        during = len(tally.answers)
        await asyncio.sleep(2.5)  # a claim left without its result has lapsed: runs again
        replays = [await send_once(mw, k) for k in keys]
        owners = {primary_of(store, key_names(b"idem", b"", k.encode()).claim) for k in keys}
        tryagain = _tryagain_count(cluster) - tryagain_before
    finally:
        await store.aclose()
        cluster.stop()

    statuses = Counter(a.status for _, a in tally.answers)
    extra = {k: len(handler.runs[k]) - 1 for k in keys if len(handler.runs[k]) > 1}
    record(
        "cluster-reshard",
        "Redis Cluster: redis-cli --cluster reshard under load",
        {
            "slots_moved": RESHARD_SLOTS,
            "keys_per_slot": RESHARD_FILL,
            "reshard_s": round(moved_s, 2),
            "per_slot_ms": ms(moved_s / RESHARD_SLOTS),
            "keys": len(keys),
            "requests": during,
            "tryagain_refusals": tryagain,
            "503_answers": statuses.get(503, 0),
            "409_answers": statuses.get(409, 0),
            "side_effects": sum(len(handler.runs[k]) for k in keys),
            "duplicate_runs": sum(extra.values()),
            "publish_errors": sum(1 for e, _ in tally.events if e == "publish_errors"),
            "status_counts": {str(k): v for k, v in sorted(statuses.items())},
        },
        checks=[
            "the reshard moved every slot (redis-cli exit status 0; the keys' slots are on "
            "the new primary)",
            "no key ran twice; every key replays afterwards, past its lease",
            "no exception out of the middleware",
            "no 503 answer, when every slot moved within half the claim step's TRYAGAIN "
            "budget (2 s) on average",
        ],
        notes=[
            "each moving slot holds keys_per_slot keys of other data, moved 10 per MIGRATE "
            "(redis-cli's default pipeline), so each slot's keys stay split for per_slot_ms",
        ],
    )
    assert reshard.returncode == 0, reshard.stderr
    assert owners == {dst.port}
    assert not extra, extra
    if moved_s / RESHARD_SLOTS < TRYAGAIN_SECONDS / 2:  # each slot moved within the budget
        assert 503 not in statuses, statuses  # the claim step waited for its slot instead
    assert not [a for _, a in tally.answers if a.escaped], statuses
    for reply in replays:
        assert reply.status == 201 and reply.replayed, reply


def _first_slots(server: Server, n: int) -> list[int]:
    """The first `n` slots `server` serves: the ones ``redis-cli --cluster reshard`` moves."""
    with server.sync_client() as c:
        ranges = c.execute_command("CLUSTER", "SLOTS")
    start = min(int(r[0]) for r in ranges if int(r[2][1]) == server.port)
    return list(range(start, start + n))


def _fill(server: Server, slots: list[int], per_slot: int) -> None:
    """`per_slot` small keys in each of `slots`, written to `server`, which serves them."""
    tags: dict[int, bytes] = {}
    i = 0
    while len(tags) < len(slots):
        tag = b"fill-%d" % i
        if key_slot(tag) in slots:
            tags.setdefault(key_slot(tag), tag)
        i += 1
    with server.sync_client() as c:
        for tag in tags.values():
            pipe = c.pipeline(transaction=False)
            for n in range(per_slot):
                pipe.set(b"{" + tag + b"}:%d" % n, b"x")
            pipe.execute()


def _keys_in(slots: list[int], n: int, prefix: str) -> list[str]:
    """`n` idempotency keys whose store keys fall in `slots`."""
    wanted, keys, i = set(slots), [], 0
    while len(keys) < n:
        key = f"{prefix}-{i}"
        if key_slot(key_names(b"idem", b"", key.encode()).claim) in wanted:
            keys.append(key)
        i += 1
    return keys


def _reshard(src: Server, dst: Server, slots: int) -> subprocess.CompletedProcess[str]:
    ids = []
    for server in (src, dst):
        with server.sync_client() as c:
            raw = c.execute_command("CLUSTER", "MYID")
        ids.append(raw.decode() if isinstance(raw, bytes) else str(raw))
    command = ["redis-cli", "--cluster", "reshard", f"127.0.0.1:{src.port}"]
    command += ["--cluster-from", ids[0], "--cluster-to", ids[1]]
    command += ["--cluster-slots", str(slots), "--cluster-yes"]
    return subprocess.run(command, capture_output=True, text=True, timeout=600)


def _tryagain_count(cluster: Cluster) -> int:
    """TRYAGAIN refusals the primaries have answered (INFO errorstats)."""
    total = 0
    for server in cluster.servers[: cluster.masters]:
        with server.sync_client() as c:
            total += int(c.info("errorstats").get("errorstat_TRYAGAIN", {}).get("count", 0))
    return total
