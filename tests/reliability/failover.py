"""One failover under load on a local Redis Cluster, counting the handler runs it duplicates.

The cluster has 3 primaries with one replica each. One shard's replica is made to lag: its
primary announces the port of a `Proxy` (so the replica replicates through it) that delays
the replication stream by `lag` seconds, while the app reaches that primary directly (the
cluster client's ``address_remap`` maps the announced port back). Under load, the proxy
drops the link with whatever it still held (a network partition) and the primary is
SIGKILLed; ``CLUSTER FAILOVER FORCE`` then promotes the replica, which lacks the writes of the
last `lag` seconds, and the old primary is restarted (it rejoins as the new replica).

Every handler run is counted in process. After the load, once every lease has lapsed, each
key is requested once more: a key whose claim or result the failover lost runs again there (or
already ran again under the load). A second run is *explained* when the middleware reported a
failed publish for that key (``publish_errors``: the documented publish-failure case);
every other second run is a *silent loss*: an acknowledged write the failover dropped.
In a cluster, RedisStore publishes with MULTI/EXEC over one connection of the key's primary
(the shared one, or a plain redis-py one with ``wait_replicas``), so the counts are
replication loss only.
"""

from __future__ import annotations

import asyncio
import contextlib
import time
from collections import Counter
from collections.abc import Sequence
from dataclasses import dataclass, field
from typing import Any, Literal

from redis.asyncio.cluster import RedisCluster

from goblin_idem import IdempotencyMiddleware, RedisStore
from goblin_idem._keys import key_names
from tests.reliability.cluster import (
    failover,
    settled_cluster,
    shards,
    wait_acked,
    wait_replica_via,
)
from tests.reliability.report import ms
from tests.support.inproc import CountingApp, Tally, send_once, until_done
from tests.support.proxy import Proxy


@dataclass
class FailoverResult:
    mode: str
    wait_replicas: int
    keys: int = 0
    requests: int = 0
    keys_on_victim: int = 0
    side_effects: int = 0
    duplicate_runs: int = 0
    silent_loss_duplicates: int = 0
    publish_failure_duplicates: int = 0
    escaped_exception_duplicates: int = 0
    escaped: Counter[str] = field(default_factory=Counter)
    statuses: Counter[str] = field(default_factory=Counter)
    counters: dict[str, int] = field(default_factory=dict)
    timings: dict[str, float] = field(default_factory=dict)
    unresolved_keys: int = 0
    executor: str = ""  # how the store reached the cluster (executors.ClusterPipelined, ...)

    def figures(self) -> dict[str, Any]:
        return {
            "mode": self.mode,
            "wait_replicas": self.wait_replicas,
            "executor": self.executor,
            "keys": self.keys,
            "keys_on_failed_shard": self.keys_on_victim,
            "requests": self.requests,
            "side_effects": self.side_effects,
            "duplicate_runs": self.duplicate_runs,
            "silent_loss_duplicates": self.silent_loss_duplicates,
            "publish_failure_duplicates": self.publish_failure_duplicates,
            "escaped_exception_duplicates": self.escaped_exception_duplicates,
            "exceptions_out_of_middleware": sum(self.escaped.values()),
            **{k: v for k, v in sorted(self.statuses.items())},
            "store_errors": self.counters.get("store_errors", 0),
            "publish_errors": self.counters.get("publish_errors", 0),
            "lease_lost": self.counters.get("lease_lost", 0),
            "unresolved_keys": self.unresolved_keys,
            **self.timings,
        }


async def failover_under_load(
    *,
    mode: Literal["script", "native"],
    wait_replicas: int,
    modules: Sequence[str] = (),
    lag: float = 0.25,
    clients: int = 12,
    warmup: float = 1.5,
    after: float = 2.5,
    lease: int = 2,
    wait_timeout_seconds: float = 1.0,
) -> FailoverResult:
    result = FailoverResult(mode, wait_replicas)
    handler = CountingApp(work_s=0.005)
    with settled_cluster("redis", modules) as cluster:
        victim, *others = shards(cluster)
        assert victim.replica is not None
        with Proxy(victim.primary.port) as proxy:
            with victim.primary.sync_client() as c:
                c.config_set("cluster-announce-port", proxy.port)
            wait_replica_via(victim.replica, proxy.port)
            wait_acked(victim.primary)
            proxy.replication_delay = lag
            announced = ("127.0.0.1", proxy.port)
            real = ("127.0.0.1", victim.primary.port)
            store = RedisStore.from_url(
                others[0].primary.url,
                cluster=True,
                mode=mode,
                wait_replicas=wait_replicas,
                wait_timeout_seconds=wait_timeout_seconds,
                socket_timeout=1.0,
                address_remap=lambda addr: real if tuple(addr) == announced else addr,
            )
            result.executor = type(store._executor).__name__
            tally = Tally()
            mw = IdempotencyMiddleware(
                handler, store=store, lease_seconds=lease, on_event=tally.on_event
            )
            keys: list[str] = []
            accepting = {"new": True}
            deadline = time.monotonic() + warmup + after + 60

            async def client(n: int) -> None:
                i = 0
                while accepting["new"]:
                    key = f"fo-{n:02d}-{i:06d}"
                    i += 1
                    keys.append(key)
                    await until_done(mw, key, tally, deadline, 0.05)

            try:
                await store.detect()
                loops = [asyncio.create_task(client(n)) for n in range(clients)]
                await asyncio.sleep(warmup)
                crash_at = time.monotonic()
                proxy.partition()
                victim.primary.kill()
                try:
                    promoted = await asyncio.to_thread(failover, victim.replica, "FORCE", 8.0)
                except RuntimeError:
                    promoted = await asyncio.to_thread(failover, victim.replica, "TAKEOVER")
                result.timings["promotion_ms"] = ms(promoted)
                await asyncio.to_thread(victim.primary.restart)
                result.timings["old_primary_back_ms"] = ms(time.monotonic() - crash_at)
                await asyncio.sleep(max(0.0, after - (time.monotonic() - crash_at)))
                accepting["new"] = False
                await asyncio.gather(*loops)
                result.timings["load_s"] = round(time.monotonic() - crash_at + warmup, 2)
                await asyncio.sleep(lease + 0.3)  # every claim a dead run left has lapsed
                for key in keys:
                    answer = await send_once(mw, key)
                    tally.answers.append((key, answer))
                    if answer.status != 201:
                        await until_done(mw, key, tally, time.monotonic() + lease + 3, 0.1)
                cluster_client = store.client
                assert isinstance(cluster_client, RedisCluster)
                result.keys_on_victim = sum(
                    1
                    for k in keys
                    if cluster_client.get_node_from_key(  # type: ignore[arg-type,union-attr]
                        key_names(b"idem", b"", k.encode()).claim
                    ).port
                    == victim.replica.port
                )
            finally:
                with contextlib.suppress(Exception):
                    await store.aclose()

    failed_publish = {h for e, h in tally.events if e == "publish_errors"}
    escaped_keys = {k for k, a in tally.answers if a.escaped}
    result.escaped.update(a.escaped.split(":", 1)[0] for _, a in tally.answers if a.escaped)
    result.keys = len(keys)
    result.requests = len(tally.answers)
    result.counters = mw.counters.as_dict()
    result.side_effects = sum(len(v) for v in handler.runs.values())
    for key, bodies in handler.runs.items():
        extra = len(bodies) - 1
        if extra <= 0:
            continue
        result.duplicate_runs += extra
        if key_names(b"idem", b"", key.encode()).hash in failed_publish:
            result.publish_failure_duplicates += extra
        elif key in escaped_keys:
            result.escaped_exception_duplicates += extra
        else:
            result.silent_loss_duplicates += extra
    for _, a in tally.answers:
        name = {
            0: "exception",
            201: "replayed_201" if a.replayed else "original_201",
            409: "in_flight_409",
        }
        result.statuses[name.get(a.status, f"{a.status}_{a.slug}")] += 1
    result.unresolved_keys = sum(1 for k in keys if k not in tally.completed)
    return result
