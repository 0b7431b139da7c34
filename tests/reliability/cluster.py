"""Redis Cluster helpers for the reliability suite: a settled 3+3 cluster, its shards, failovers.

`settled_cluster` starts one with the test harness and waits until every node agrees on the
roles and every replica's link is up (the harness returns at ``cluster_state:ok``, before
replicas finish their first sync). Every server is stopped by PID through `Cluster.stop`.
"""

from __future__ import annotations

import contextlib
import time
from collections.abc import Iterator, Sequence
from dataclasses import dataclass

from redis.asyncio.cluster import RedisCluster
from redis.crc import key_slot

from goblin_idem import RedisStore
from tests.support.servers import Cluster, Server, start_cluster
from tests.support.waits import until_sync


@dataclass
class Shard:
    primary: Server
    replica: Server | None
    node_id: str


def _info(server: Server, section: str) -> dict[str, object]:
    with server.sync_client(socket_timeout=2, socket_connect_timeout=2) as c:
        info: dict[str, object] = c.info(section)
        return info


def _node_ids(server: Server) -> dict[int, tuple[str, str, str, bool]]:
    """port -> (node id, flags, master id, has slots), as `server` sees the cluster."""
    with server.sync_client(socket_timeout=2, socket_connect_timeout=2) as c:
        raw = c.execute_command("CLUSTER", "NODES")
    text = raw.decode() if isinstance(raw, bytes) else str(raw)
    out = {}
    for line in text.splitlines():
        parts = line.split()
        port = int(parts[1].split("@")[0].rsplit(":", 1)[1])
        out[port] = (parts[0], parts[2], parts[3], len(parts) > 8)
    return out


def _cluster_ok(server: Server) -> bool:
    with server.sync_client(socket_timeout=2, socket_connect_timeout=2) as c:
        info = c.cluster("INFO")
    if isinstance(info, dict):
        return str(info.get("cluster_state")) == "ok"
    return b"cluster_state:ok" in info


def shards(cluster: Cluster, alive: Sequence[Server] | None = None) -> list[Shard]:
    """The primaries with slots and their replica, as the first live node sees them."""
    servers = [s for s in (alive or cluster.servers) if s.running()]
    by_port = {s.port: s for s in servers}
    view = _node_ids(servers[0])
    result = []
    for port, (node_id, flags, _, has_slots) in view.items():
        if "master" not in flags or "fail" in flags or port not in by_port or not has_slots:
            continue
        replica = next(
            (
                by_port.get(p)
                for p, (_, f, master, _) in view.items()
                if master == node_id and "fail" not in f and p in by_port
            ),
            None,
        )
        result.append(Shard(by_port[port], replica, node_id))
    return result


def wait_settled(cluster: Cluster, timeout: float = 30.0) -> None:
    """Every live node sees the same primaries and replicas, and every replica's link is up."""

    def settled() -> bool:
        live = [s for s in cluster.servers if s.running()]
        try:
            views = [_node_ids(s) for s in live]
            roles = [
                {p: ("master" in f, m) for p, (_, f, m, _) in v.items() if "fail" not in f}
                for v in views
            ]
            agree = all(r == roles[0] for r in roles)
            links = all(
                _info(s, "replication").get("master_link_status") == "up"
                for s in live
                if _info(s, "replication").get("role") == "slave"
            )
            return agree and links and all(_cluster_ok(s) for s in live)
        except Exception:  # a node busy with the change: ask again
            return False

    until_sync(settled, timeout, "the cluster settled", every=0.1)


def _own_key(primary: Server) -> bytes:
    """A key in a slot that `primary` serves."""
    with primary.sync_client() as c:
        raw = c.execute_command("CLUSTER", "NODES")
    text = raw.decode() if isinstance(raw, bytes) else str(raw)
    mine = next(line for line in text.splitlines() if "myself" in line.split()[2])
    first = mine.split()[8].split("-")[0].lstrip("[")
    target = int(first)
    for i in range(100_000):
        key = f"acked-{i}".encode()
        if key_slot(key) == target:
            return key
    raise RuntimeError("no key found for the slot")


def wait_acked(primary: Server, timeout: float = 20.0) -> None:
    """Until `primary`'s replica acknowledges a write (WAIT 1), e.g. after its first sync."""
    key = _own_key(primary)
    deadline = time.monotonic() + timeout
    with primary.sync_client() as c:
        while True:
            c.set(key, 1)
            if int(c.execute_command("WAIT", 1, 200)) >= 1:
                c.delete(key)
                return
            if time.monotonic() > deadline:
                raise RuntimeError("the replica does not acknowledge writes")


@contextlib.contextmanager
def settled_cluster(kind: str = "redis", modules: Sequence[str] = ()) -> Iterator[Cluster]:
    cluster = start_cluster(kind, masters=3, replicas=1, modules=modules)
    try:
        for s in cluster.servers:
            with s.sync_client() as c:  # no 5 s wait before a replica's first full sync
                c.config_set("repl-diskless-sync-delay", 0)
        wait_settled(cluster)
        for shard in shards(cluster):
            wait_acked(shard.primary)
        yield cluster
    finally:
        cluster.stop()


def failover(replica: Server, option: str = "", timeout: float = 15.0) -> float:
    """CLUSTER FAILOVER [FORCE|TAKEOVER] on `replica`; seconds until it is a primary."""
    start = time.monotonic()
    with replica.sync_client() as c:
        c.execute_command("CLUSTER", "FAILOVER", *([option] if option else []))
    while _info(replica, "replication").get("role") != "master":
        if time.monotonic() - start > timeout:
            raise RuntimeError("the replica was not promoted")  # a caller may try harder
        time.sleep(0.02)
    return time.monotonic() - start


def wait_replica_via(replica: Server, port: int, timeout: float = 20.0) -> None:
    """Until `replica` replicates from `port` (a proxy in front of its primary), link up."""

    def linked() -> bool:
        info = _info(replica, "replication")
        return info.get("master_port") == port and info.get("master_link_status") == "up"

    until_sync(linked, timeout, f"the replica reconnected through port {port}")


def primary_of(store: RedisStore, key: bytes) -> int:
    """The port of the primary that serves `key`, as the store's slot table says."""
    client = store.client
    assert isinstance(client, RedisCluster)
    node = client.get_node_from_key(key)  # type: ignore[arg-type]
    assert node is not None
    return int(node.port)
