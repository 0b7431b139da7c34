"""A cluster store on its fast path (`executors.ClusterPipelined`): one shared, auto-pipelined
connection per primary carries every call of the store; MOVED after a slot moved or a
failover, and ASK during a slot's migration, are followed; renewals of keys on every
primary go out as one write per primary; a store moves from one event loop to the next;
and the stores that must keep redis-py's path (``autopipeline=False``, ``wait_replicas``,
settings a shared connection cannot honour) keep it.
"""

from __future__ import annotations

import asyncio
import secrets
from collections.abc import Awaitable, Callable
from typing import Any

import pytest
import redis
from redis.asyncio.cluster import RedisCluster
from redis.crc import key_slot
from redis.credentials import UsernamePasswordCredentialProvider

from goblin_idem import CLAIMED, RedisStore
from goblin_idem.store import Published
from goblin_idem.store import _autopipeline as autopipeline
from goblin_idem.store._autopipeline import AutoPipeline
from goblin_idem.store._cluster import Clustered, ClusterPipelined
from tests.reliability.cluster import failover, primary_of, settled_cluster, shards, wait_settled
from tests.support.servers import Cluster, Server, start_cluster
from tests.support.waits import until_sync


def fast(store: RedisStore) -> ClusterPipelined:
    executor = store._executor
    assert isinstance(executor, ClusterPipelined), type(executor)
    return executor


def server_at(cluster: Cluster, port: int) -> Server:
    return next(s for s in cluster.servers if s.port == port)


def node_id(server: Server) -> str:
    with server.sync_client() as c:
        raw = c.execute_command("CLUSTER", "MYID")
    return raw.decode() if isinstance(raw, bytes) else str(raw)


def keys_of(tag: str) -> tuple[bytes, bytes]:
    return f"{{{tag}}}:c".encode(), f"{{{tag}}}:r".encode()


def local_port(pipeline: AutoPipeline) -> int:
    conn = pipeline._conn
    assert conn is not None and conn.transport is not None
    return int(conn.transport.get_extra_info("sockname")[1])


def client_ports(server: Server) -> set[int]:
    with server.sync_client() as c:
        clients = c.client_list()
    return {int(str(entry["addr"]).rsplit(":", 1)[1]) for entry in clients}


def begin_migration(src: Server, dst: Server, slot: int, keys: list[bytes]) -> None:
    """Slot `slot` MIGRATING on `src`, IMPORTING on `dst`, and `keys` moved over already."""
    src_id, dst_id = node_id(src), node_id(dst)
    with dst.sync_client() as d:
        d.execute_command("CLUSTER", "SETSLOT", slot, "IMPORTING", src_id)
    with src.sync_client() as s:
        s.execute_command("CLUSTER", "SETSLOT", slot, "MIGRATING", dst_id)
        for key in keys:
            s.execute_command("MIGRATE", dst.host, dst.port, key, 0, 5000)


def end_migration(cluster: Cluster, dst: Server, slot: int) -> None:
    """`dst` owns `slot`, on every primary's word (the others answer MOVED from now on)."""
    dst_id = node_id(dst)
    for server in cluster.servers[: cluster.masters]:
        with server.sync_client() as c:
            c.execute_command("CLUSTER", "SETSLOT", slot, "NODE", dst_id)


def move_slot_of(cluster: Cluster, store: RedisStore, key: bytes) -> tuple[Server, Server]:
    """Move `key`'s slot, with `key`, from its primary to another one: (from, to). The
    store's slot table still names the old owner."""
    src = server_at(cluster, primary_of(store, key))
    dst = next(s for s in cluster.servers[: cluster.masters] if s.port != src.port)
    begin_migration(src, dst, key_slot(key), [key])
    end_migration(cluster, dst, key_slot(key))
    return src, dst


def asking_get(server: Server, key: bytes) -> Any:
    """GET on an importing node (ASKING first, on the same connection)."""
    with server.sync_client() as c:
        pipe = c.pipeline(transaction=False)
        pipe.execute_command("ASKING")
        pipe.get(key)
        return pipe.execute()[1]


def count_writes(executor: ClusterPipelined) -> dict[tuple[str, int], int]:
    """Count each call into every per-primary pipeline (one call: one write of its own, or a
    share of one loop turn's write)."""
    counts: dict[tuple[str, int], int] = {}
    for address, pipeline in executor.pipelines.items():
        counts[address] = 0
        execute = pipeline.execute

        def counted(
            commands: Any,
            execute: Callable[[Any], Awaitable[list[Any]]] = execute,
            address: tuple[str, int] = address,
        ) -> Awaitable[list[Any]]:
            counts[address] += 1
            return execute(commands)

        pipeline.execute = counted  # type: ignore[method-assign]
    return counts


async def test_every_call_goes_over_one_connection_per_primary(
    own_cluster: tuple[Cluster, str], monkeypatch: pytest.MonkeyPatch
) -> None:
    cluster, mode = own_cluster
    # A connection whose reply waits past the stall threshold is replaced, as it should be;
    # on a loaded machine 60 calls at once can wait that long, and this test counts
    # connections: stalls are another test's subject (test_autopipeline.py).
    monkeypatch.setattr(autopipeline, "STALL_SECONDS", 60.0)
    store = RedisStore.from_url(cluster.servers[0].url, cluster=True, mode=mode)  # type: ignore[arg-type]
    try:
        assert await store.detect() == mode
        executor = fast(store)
        tags = [f"one-{i}-{secrets.token_hex(3)}" for i in range(60)]

        async def every_call(tag: str) -> list[Any]:
            c, r = keys_of(tag)
            seen: list[Any] = [await store.claim_unless_done(c, r, b"t", 30)]
            seen.append(await store.caexpire(c, b"t", 30_000))
            seen.append(await store.cas(c, b"t", b"u"))
            seen.append(await store.publish(r, b"done", 60_000, c, b"u"))
            seen.append(await store.claim(c, r, b"v", 30))
            seen.append(await store.cad(c, b"u"))
            return seen

        results = await asyncio.gather(*(every_call(t) for t in tags))
        assert results == [[CLAIMED, 1, True, 1, b"done", 1]] * len(tags)
        primaries = {("127.0.0.1", s.port) for s in cluster.servers[: cluster.masters]}
        assert set(executor.pipelines) == primaries
        assert {a: p.opened for a, p in executor.pipelines.items()} == dict.fromkeys(primaries, 1)
        assert executor.primaries == {}  # no redis-py per-primary client was made
        for (_, port), pipeline in executor.pipelines.items():
            assert local_port(pipeline) in client_ports(server_at(cluster, port))
        # Keys of two slots in one call: refused as redis-py refuses them, nothing stored.
        with pytest.raises(redis.exceptions.RedisClusterException, match="same key slot"):
            await store.claim(b"a:claim", b"b:result", b"t", 30)
        with pytest.raises(redis.exceptions.RedisClusterException, match="same key slot"):
            await store.claim_unless_done(b"a:claim", b"b:result", b"t", 30)
        assert await store.get(b"a:claim") is None
    finally:
        await store.aclose()
    assert executor.pipelines == {}


async def test_moved_after_a_slot_moved_is_followed(own_cluster: tuple[Cluster, str]) -> None:
    cluster, mode = own_cluster
    store = RedisStore.from_url(cluster.servers[0].url, cluster=True, mode=mode)  # type: ignore[arg-type]
    try:
        await store.detect()
        executor = fast(store)
        c, r = keys_of("moving")
        assert await store.claim_unless_done(c, r, b"t", 30) is CLAIMED
        src, dst = move_slot_of(cluster, store, c)
        assert primary_of(store, c) == src.port  # the store's table does not know yet
        # The old owner answers MOVED; the store refreshes its table and sends to the new.
        assert await store.caexpire(c, b"t", 60_000) == 1
        assert primary_of(store, c) == dst.port
        with dst.sync_client() as d:
            assert d.get(c) == b"t" and d.pttl(c) > 30_000
        # A MULTI/EXEC met by MOVED (before EXECABORT), and renewals in one call.
        other_c, other_r = keys_of("moving-again")
        assert await store.claim(other_c, other_r, b"t", 30) is CLAIMED
        _, target = move_slot_of(cluster, store, other_c)
        assert await store.publish(other_r, b"v", 60_000, other_c, b"t") == 1
        with target.sync_client() as d:
            assert d.get(other_r) == b"v" and d.pttl(other_c) > 30_000
        # Renewals, one of them on a slot that moved since: MOVED for it alone, followed.
        third_c, third_r = keys_of("moving-renewed")
        assert await store.claim(third_c, third_r, b"t", 30) is CLAIMED
        _, to = move_slot_of(cluster, store, third_c)
        renewed = [(k, b"t", 50_000) for k in (c, third_c, other_c)]
        assert await store.caexpire_many(renewed) == [1, 1, 1]
        assert primary_of(store, third_c) == to.port
        with to.sync_client() as d:
            assert 40_000 < d.pttl(third_c) <= 50_000
        assert {a for a in executor.pipelines} >= {("127.0.0.1", dst.port)}
    finally:
        await store.aclose()


async def test_ask_during_a_migration_is_followed(own_cluster: tuple[Cluster, str]) -> None:
    cluster, mode = own_cluster
    store = RedisStore.from_url(cluster.servers[0].url, cluster=True, mode=mode)  # type: ignore[arg-type]
    try:
        await store.detect()
        executor = fast(store)
        c, r = keys_of("asked")
        assert await store.claim(c, r, b"t", 30) is CLAIMED
        assert await store.publish(r, b"v", 60_000, c, b"t") == 1
        src = server_at(cluster, primary_of(store, c))
        dst = next(s for s in cluster.servers[: cluster.masters] if s.port != src.port)
        begin_migration(src, dst, key_slot(c), [c, r])
        # The source lacks the keys: ASK; the store asks the importing node, once per call.
        assert await store.caexpire(c, b"t", 50_000) == 1
        assert 40_000 < int(asking_get_pttl(dst, c)) <= 50_000
        # Two commands: ASKING before each (it lasts one command).
        assert await store.claim_unless_done(c, r, b"u", 30) == b"v"
        # A MULTI/EXEC: one ASKING before MULTI lasts until EXEC (the stored result stands,
        # read there too).
        assert await store.publish(r, b"v2", 60_000, c, b"t") == Published.SUPERSEDED
        assert asking_get(dst, r) == b"v"
        assert await store.caexpire_many([(c, b"t", 40_000)]) == [1]
        assert 30_000 < int(asking_get_pttl(dst, c)) <= 40_000
        assert await store.cad(c, b"t") == 1
        assert asking_get(dst, c) is None
        # ASK never changes the slot table: the slot is still the source's until it ends.
        assert primary_of(store, c) == src.port
        assert ("127.0.0.1", dst.port) in executor.pipelines
        with src.sync_client() as s:  # nothing was written on the source
            assert s.execute_command("CLUSTER", "COUNTKEYSINSLOT", key_slot(c)) == 0
    finally:
        await store.aclose()


def asking_get_pttl(server: Server, key: bytes) -> Any:
    with server.sync_client() as c:
        pipe = c.pipeline(transaction=False)
        pipe.execute_command("ASKING")
        pipe.pttl(key)
        return pipe.execute()[1]


def tryagain_errors(cluster: Cluster) -> int:
    """How many TRYAGAIN refusals the primaries have answered (INFO errorstats)."""
    total = 0
    for server in cluster.servers[: cluster.masters]:
        with server.sync_client() as c:
            total += int(c.info("errorstats").get("errorstat_TRYAGAIN", {}).get("count", 0))
    return total


@pytest.mark.parametrize("path", ["shared", "redis-py"])
async def test_tryagain_while_a_slot_migrates_is_sent_again_until_it_ends(
    own_cluster: tuple[Cluster, str], path: str
) -> None:
    """While a slot migrates, a command of two keys that are not both on the node answering
    is refused with TRYAGAIN: a publish whose claim has moved and whose result does not
    exist yet, and a new key's claim (its keys on neither node). Both are sent again until
    the migration ends, then land on the new owner, on both cluster paths."""
    cluster, mode = own_cluster
    store = RedisStore.from_url(
        cluster.servers[0].url,
        cluster=True,
        mode=mode,  # type: ignore[arg-type]
        autopipeline=path == "shared",
    )
    try:
        await store.detect()
        assert isinstance(store._executor, ClusterPipelined) == (path == "shared")
        before = tryagain_errors(cluster)
        c, r = keys_of("moving")
        assert await store.claim(c, r, b"t", 30) is CLAIMED
        src = server_at(cluster, primary_of(store, c))
        dst = next(s for s in cluster.servers[: cluster.masters] if s.port != src.port)
        begin_migration(src, dst, key_slot(c), [c])  # the claim moved, no result yet
        ending = asyncio.create_task(ended_after(0.3, cluster, dst, key_slot(c)))
        assert await store.publish(r, b"v", 60_000, c, b"t") == Published.STORED
        await ending
        with dst.sync_client() as d:
            assert d.get(r) == b"v" and 59_000 < d.pttl(c) <= 60_000

        new_c, new_r = keys_of("fresh")
        src = server_at(cluster, primary_of(store, new_c))
        dst = next(s for s in cluster.servers[: cluster.masters] if s.port != src.port)
        begin_migration(src, dst, key_slot(new_c), [])
        ending = asyncio.create_task(ended_after(0.3, cluster, dst, key_slot(new_c)))
        assert await store.claim_unless_done(new_c, new_r, b"t", 30) is CLAIMED
        await ending
        with dst.sync_client() as d:
            assert d.get(new_c) == b"t"
        assert tryagain_errors(cluster) > before  # refused, and sent again
    finally:
        await store.aclose()


async def ended_after(seconds: float, cluster: Cluster, dst: Server, slot: int) -> None:
    await asyncio.sleep(seconds)
    await asyncio.to_thread(end_migration, cluster, dst, slot)


async def test_renewals_go_as_one_write_per_primary_in_the_callers_order(
    own_cluster: tuple[Cluster, str],
) -> None:
    cluster, mode = own_cluster
    store = RedisStore.from_url(cluster.servers[0].url, cluster=True, mode=mode)  # type: ignore[arg-type]
    try:
        await store.detect()
        executor = fast(store)
        tags = [f"renew-{i}-{secrets.token_hex(3)}" for i in range(30)]
        for tag in tags:
            c, r = keys_of(tag)
            assert await store.claim(c, r, b"t", 30) is CLAIMED
        assert len({primary_of(store, keys_of(t)[0]) for t in tags}) == 3
        writes = count_writes(executor)
        renewals = [
            (keys_of(t)[0], b"t" if i % 3 else b"not-the-token", 90_000) for i, t in enumerate(tags)
        ]
        replies = await store.caexpire_many(renewals)
        assert replies == [0 if i % 3 == 0 else 1 for i in range(len(tags))]
        assert sorted(writes.values()) == [1, 1, 1]
        for i, tag in enumerate(tags):
            with server_at(cluster, primary_of(store, keys_of(tag)[0])).sync_client() as c:
                ttl = c.pttl(keys_of(tag)[0])
            assert (ttl > 60_000) == (i % 3 != 0), (tag, ttl)
    finally:
        await store.aclose()


def test_a_store_used_in_one_loop_works_in_the_next() -> None:
    cluster = start_cluster("redis", masters=3)
    try:
        store = RedisStore.from_url(cluster.servers[0].url, cluster=True)
        seen: list[set[int]] = []

        async def use(tag: str) -> list[Any]:
            c, r = keys_of(tag)
            replies = [await store.claim_unless_done(c, r, b"t", 30)]
            replies.append(await store.publish(r, b"v", 30_000, c, b"t"))
            replies.append(await store.caexpire_many([(c, b"t", 30_000)]))
            seen.append({local_port(p) for p in fast(store).pipelines.values()})
            return replies

        assert asyncio.run(use("loop-1")) == [CLAIMED, 1, [1]]
        first = fast(store).pipelines
        assert asyncio.run(use("loop-2")) == [CLAIMED, 1, [1]]  # the closed loop's are dropped
        assert fast(store).pipelines is not first and not seen[0] & seen[1]
        asyncio.run(store.aclose())
    finally:
        cluster.stop()


async def test_stores_that_keep_redis_py_keep_it() -> None:
    url = "redis://127.0.0.1:1/0"  # never connected to: the choice is made at construction
    assert isinstance(RedisStore.from_url(url, cluster=True)._executor, ClusterPipelined)
    for store in (
        RedisStore.from_url(url, cluster=True, autopipeline=False),
        RedisStore.from_url(url, cluster=True, wait_replicas=1),
        RedisStore(
            RedisCluster(
                host="127.0.0.1",
                port=1,
                credential_provider=UsernamePasswordCredentialProvider("u", "p"),
            )
        ),
        RedisStore(RedisCluster(host="127.0.0.1", port=1, ssl=True)),
    ):
        executor = store._executor
        assert type(executor) is Clustered, type(executor)


async def test_a_failover_moves_the_calls_and_closes_the_old_primarys_pipeline() -> None:
    with settled_cluster("redis") as cluster:
        store = RedisStore.from_url(cluster.servers[0].url, cluster=True, mode="script")
        try:
            await store.detect()
            executor = fast(store)
            victim = shards(cluster)[0]
            assert victim.replica is not None
            tags = [f"fo-{i}" for i in range(40)]
            mine = next(t for t in tags if primary_of(store, keys_of(t)[0]) == victim.primary.port)
            for tag in tags:
                assert await store.claim(*keys_of(tag), b"t", 30) is CLAIMED
            old = ("127.0.0.1", victim.primary.port)
            old_pipeline = executor.pipelines[old]
            await asyncio.to_thread(failover, victim.replica)
            await asyncio.to_thread(wait_settled, cluster)
            # The old primary, now a replica, answers MOVED: followed to the new primary.
            assert await store.caexpire(keys_of(mine)[0], b"t", 60_000) == 1
            assert primary_of(store, keys_of(mine)[0]) == victim.replica.port
            assert old not in executor.pipelines and old_pipeline._conn is None
            assert ("127.0.0.1", victim.replica.port) in executor.pipelines
            assert await store.caexpire_many([(keys_of(t)[0], b"t", 60_000) for t in tags]) == [
                1
            ] * len(tags)
        finally:
            await store.aclose()


async def test_tryagain_on_the_first_send_of_the_shared_path_is_sent_again() -> None:
    """TRYAGAIN on the shared connection's own send (a claim of two keys: the claim still
    on the migrating node, the result on neither) is sent again, not the first refusal
    handed back each time: once the claim has moved and the migration ended, the claim
    finds its key held (in flight)."""
    cluster = start_cluster("redis", masters=3)
    store = RedisStore.from_url(cluster.servers[0].url, cluster=True, mode="script")
    try:
        await store.detect()
        fast(store)
        c, r = keys_of(f"first-refusal-{secrets.token_hex(3)}")
        assert await store.claim(c, r, b"t", 30) is CLAIMED
        src = server_at(cluster, primary_of(store, c))
        dst = next(s for s in cluster.servers[: cluster.masters] if s.port != src.port)
        begin_migration(src, dst, key_slot(c), [])  # the claim stays on src for now
        before = tryagain_errors(cluster)

        def move_then_end() -> None:
            refused = lambda: tryagain_errors(cluster) > before + 1  # noqa: E731
            until_sync(refused, what="the claim refused (TRYAGAIN) more than once")
            with src.sync_client() as s:
                s.execute_command("MIGRATE", dst.host, dst.port, c, 0, 5000)
            end_migration(cluster, dst, key_slot(c))

        ending = asyncio.create_task(asyncio.to_thread(move_then_end))
        assert await store.claim(c, r, b"u", 30) is None  # held by "t": in flight
        await ending
        assert tryagain_errors(cluster) > before + 1  # refused more than once: sent again
        with dst.sync_client() as d:
            assert d.get(c) == b"t"
    finally:
        await store.aclose()
        cluster.stop()
